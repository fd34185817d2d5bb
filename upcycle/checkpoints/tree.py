"""Flat '/'-joined paths <-> nested dicts, the two views every reader moves between."""

from typing import Any, Dict


def flatten(tree: Any, prefix: str = '') -> Dict[str, Any]:
  """Nested dicts -> {'a/b/c': leaf}. Empty dicts vanish (they hold no parameter)."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(flatten(value, f'{prefix}/{key}' if prefix else str(key)))
  return flat


def unflatten(flat: Dict[str, Any]) -> Dict[str, Any]:
  """{'a/b/c': leaf} -> nested dicts."""
  tree = {}
  for path, leaf in flat.items():
    *parents, name = path.split('/')
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[name] = leaf
  return tree
