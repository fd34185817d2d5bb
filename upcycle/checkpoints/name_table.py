"""One table of names for both directions: another format's tensor names <-> this project's
parameter paths.

Each row is `(theirs, ours, transposed)`, where `{i}` in both names stands for the same layer
index, e.g. `('model.layers.{i}.mlp.up_proj.weight', 'decoder/layers_{i}/mlp/wi_1/kernel',
True)`. `transposed`: the two layouts are each other's transpose (torch Linear `[out, in]`
against a kernel `[in, out]`). Reading looks a name up with `ours`, writing with `theirs`, so
a reader and its writer cannot disagree. `{j}` in their name alone is an expert index: their
per-expert tensors (`...experts.{j}.w1.weight`) are the entries of our stacked leaf's first
axis (`.../expert/wi_0/kernel` `[experts, ...]`), stacked lazily when read, split when written.
"""

import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints import lazy
from upcycle.checkpoints.lazy import LazyArray

LAYER = '{i}'
EXPERT = '{j}'


def _pattern(template: str) -> re.Pattern:
  return re.compile(re.escape(template).replace(re.escape(LAYER), r'(?P<i>\d+)')
                    .replace(re.escape(EXPERT), r'(?P<j>\d+)'))


class NameTable:
  """Looks a name up in either direction; None for a name the table does not hold."""

  def __init__(self, rows: Iterable[Tuple[str, str, bool]]):
    self._rows = [(_pattern(theirs), theirs, _pattern(ours), ours, transposed)
                  for theirs, ours, transposed in rows]

  def ours(self, name: str) -> Optional[Tuple[str, bool, Optional[int]]]:
    """Their tensor name -> (our parameter path, transposed?, expert index or None)."""
    for pattern, _, _, ours, transposed in self._rows:
      m = pattern.fullmatch(name)
      if m:
        expert = m.groupdict().get('j')
        return (ours.replace(LAYER, m.groupdict().get('i') or ''), transposed,
                None if expert is None else int(expert))
    return None

  def theirs(self, path: str) -> Optional[Tuple[str, bool]]:
    """Our parameter path -> (their tensor name, `{j}` left in for stacked experts,
    transposed?)."""
    for _, theirs, pattern, _, transposed in self._rows:
      m = pattern.fullmatch(path)
      if m:
        return theirs.replace(LAYER, m.groupdict().get('i') or ''), transposed
    return None

  def to_ours(self, tensors: Dict[str, Any], skip: Callable[[str], bool]
              ) -> Tuple[Dict[str, Any], Dict[str, str], List[str]]:
    """{their tensor name: leaf} -> (flat params, transposed where the table says; {our path:
    their name} for errors; their names the table does not hold). `skip`: names that carry
    nothing of their own (aliases, buffers derived from the config)."""
    params, names, unknown, experts = {}, {}, [], {}
    for name, tensor in tensors.items():
      if skip(name):
        continue
      found = self.ours(name)
      if found is None:
        unknown.append(name)
        continue
      path, transpose, expert = found
      leaf = transposed(tensor) if transpose else tensor
      if expert is None:
        params[path], names[path] = leaf, name
      else:
        experts.setdefault(path, {})[expert] = leaf
        names[path] = self.theirs(path)[0]   # their name with `{j}` for the expert
    for path, by_index in experts.items():
      if sorted(by_index) != list(range(len(by_index))):
        missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
        raise checkpoint_error(names[path], 'expert tensors are missing', param=path,
                               expected=f'experts 0..{max(by_index)}', found=f'no {missing}',
                               fix='Re-save the model; every expert must be present')
      params[path] = lazy.stack([by_index[j] for j in range(len(by_index))], names[path])
    return params, names, unknown

  def to_theirs(self, params: Any, source: str, model: str) -> Dict[str, Any]:
    """Nested params -> {their tensor name: leaf, transposed where the table says}; a
    parameter without a name there raises CheckpointError naming it, `source` and `model`."""
    out = {}
    for path, leaf in tree.flatten(params).items():
      found = self.theirs(path)
      if found is None:
        raise checkpoint_error(source, f'{model} has no tensor for this parameter', param=path,
                               fix=f'Only what {model} computes can be written as one')
      name, transpose = found
      if EXPERT in name:   # our stacked leaf [experts, ...] -> one tensor per expert
        for j in range(leaf.shape[0]):
          out[name.replace(EXPERT, str(j))] = transposed(leaf[j]) if transpose else leaf[j]
      else:
        out[name] = transposed(leaf) if transpose else leaf
    return out


def transposed(leaf: Any) -> Any:
  """`leaf` transposed; a LazyArray stays lazy (nothing is read)."""
  if isinstance(leaf, LazyArray):
    return leaf.map(np.transpose, leaf.shape[::-1])
  return np.transpose(np.asarray(leaf))
