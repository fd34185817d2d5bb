"""Parameter trees: flat paths, flax boxes, key paths, and the MoE naming rule.

Param trees are nested dicts of arrays; a path is the '/'-joined key sequence,
e.g. 'encoder/layers_1/mlp/expert/wi_0/kernel'. Every package that walks a
param tree (moe, checkpoints, upcycling, train) does it through this module,
which imports nothing from `upcycle`.

The naming rule of every MoE block of either model:

  X/expert/Y  the experts of the dense MLP leaf X/Y, a leading expert axis
  X/router/Z  the router of block X (only where X/expert/... exists too)
  X/shared_expert/Y  the shared expert of block X: the dense MLP leaf X/Y (only
              where X/expert/... exists too)
  anything P  the dense leaf P
"""

import dataclasses
import re
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

EXPERT = 'expert'
ROUTER = 'router'
SHARED_EXPERT = 'shared_expert'
# A scanned stack's sub-block j (`upcycle.models.scan_layout`): PREFIX/NAME/subblock_{j}/REST
# with the layers axis first, unrolled PREFIX/NAME_{k*p + j}/REST.
SUBBLOCK = 'subblock_{}'
_SCANNED = re.compile(r'(.*?)([A-Za-z]\w*)/subblock_(\d+)/(.*)')


def _is_box(x: Any) -> bool:
  return isinstance(x, meta.AxisMetadata)


def _value(x: Any) -> Any:
  while _is_box(x):
    x = x.value
  return x


def unbox(tree: Any) -> Any:
  """`tree` (or one leaf) with flax `nn.Partitioned` / `LogicallyPartitioned` boxes opened.

  Abstract trees from `jax.eval_shape(model.init, ...)` carry these boxes. This
  reads `.value`; unlike `meta.unbox` it applies no sharding constraint, which
  would fail on abstract values under an active mesh.
  """
  return jax.tree.map(_value, tree, is_leaf=_is_box)


def flatten(tree: Any) -> Dict[str, Any]:
  """Nested mappings -> {'a/b/c': leaf}, boxes opened, leaves not copied.

  Empty mappings vanish (they hold no parameter); a non-mapping `tree` is the
  single leaf at path ''.
  """
  flat: Dict[str, Any] = {}

  def walk(node, prefix):
    if not isinstance(node, Mapping):
      flat[prefix] = _value(node)
      return
    for key, value in node.items():
      walk(value, f'{prefix}/{key}' if prefix else str(key))

  walk(tree, '')
  return flat


def unflatten(flat: Mapping[str, Any]) -> Dict[str, Any]:
  """{'a/b/c': leaf} -> nested dicts."""
  nested: Dict[str, Any] = {}
  for path, leaf in flat.items():
    *parents, name = path.split('/')
    node = nested
    for key in parents:
      node = node.setdefault(key, {})
    node[name] = leaf
  return nested


def join(*parts: str) -> str:
  return '/'.join(p for p in parts if p)


def shape_of(leaf: Any) -> Tuple[int, ...]:
  return tuple(int(d) for d in np.shape(leaf))


def abstract(leaf: Any) -> jax.ShapeDtypeStruct:
  """Shape and dtype of an array, lazy array or abstract leaf."""
  dtype = leaf.dtype if hasattr(leaf, 'dtype') else np.asarray(leaf).dtype
  return jax.ShapeDtypeStruct(shape_of(leaf), dtype)


def zeros_for(tree: Any) -> Any:
  """Boxes opened, abstract leaves replaced by zeros (e.g. for `optimizer.init`)."""
  concrete = lambda x: x if isinstance(x, (jax.Array, np.ndarray)) else jnp.zeros(x.shape, x.dtype)
  return jax.tree.map(concrete, unbox(tree))


# Key paths of arbitrary pytrees (optax states): one name per key.

def key_names(keypath: Sequence[Any]) -> Tuple[str, ...]:
  """A jax key path as hashable names: dict keys as is, attributes '.name', indices '[i]'."""
  out = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      out.append(f'.{k.name}')
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(f'[{k.idx}]')
    else:
      out.append(str(k))
  return tuple(out)


def render(names: Iterable[str]) -> str:
  """`key_names` output as one readable string: '0/mu/encoder/...' or '.count'."""
  return ''.join(n if n.startswith(('.', '[')) else f'/{n}' for n in names).lstrip('/') or '<root>'


def key_path(keypath: Sequence[Any]) -> str:
  """A jax key path as a '/'-joined path: '0/mu/encoder/layers_0/...'."""
  return jax.tree_util.keystr(tuple(keypath), simple=True, separator='/')


def leaves_by_path(tree: Any) -> Dict[str, Any]:
  """'/'-joined key path -> array-like leaf, for any pytree (optax states included)."""
  return {key_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if hasattr(x, 'shape') and hasattr(x, 'dtype')}


def split_param_path(keypath: Sequence[Any], param_paths) -> Any:
  """(prefix names, param path) if `keypath` ends in one of `param_paths`, else None.

  Optax slot trees mirror the param tree, so an optimizer-state leaf belongs to
  the parameter whose path its key path ends in. The longest suffix wins, so a
  state nested in dicts (multi_transform, named_chain) keeps its own keys in
  the prefix.
  """
  keypath = tuple(keypath)
  for i in range(len(keypath)):
    suffix = keypath[i:]
    if all(isinstance(k, jax.tree_util.DictKey) for k in suffix):
      path = '/'.join(str(k.key) for k in suffix)
      if path in param_paths:
        return key_names(keypath[:i]), path
  return None


# The MoE naming rule.

@dataclasses.dataclass(frozen=True)
class Role:
  """What one leaf of an MoE param tree is.

  Attributes:
    kind: 'copy', 'expert', 'router' or 'shared_expert'.
    layer: X, the path of the MoE block ('' for copied leaves).
    name: Y below X/expert/ or X/shared_expert/, Z below X/router/ (the full path
      for copies).
    source: the dense leaf it comes from: X/Y for experts and the shared expert,
      the same path for copies, '' for routers.
  """

  kind: str
  layer: str
  name: str
  source: str


def classify(paths: Iterable[str]) -> Dict[str, Role]:
  """Roles of all paths of an MoE param tree under the naming rule.

  The first 'expert' key of a path splits it into X/expert/Y. A 'router' or
  'shared_expert' key marks a router or shared-expert leaf only if its prefix X
  also has experts, so that a dense model with a module that happens to be
  called so is copied as usual.
  """
  paths = list(paths)
  layers = {'/'.join(p.split('/')[:p.split('/').index(EXPERT)])
            for p in paths if EXPERT in p.split('/')}
  roles = {}
  for path in paths:
    keys = path.split('/')
    for kind in (EXPERT, ROUTER, SHARED_EXPERT):
      if kind in keys:
        i = keys.index(kind)
        layer, name = '/'.join(keys[:i]), '/'.join(keys[i + 1:])
        if kind == EXPERT or layer in layers:
          roles[path] = Role(kind, layer, name, '' if kind == ROUTER else join(layer, name))
          break
    else:
      roles[path] = Role('copy', '', path, path)
  return roles


def moe_layers(paths: Iterable[str]) -> Tuple[str, ...]:
  """Paths X of the MoE blocks among `paths`, sorted."""
  return tuple(sorted({role.layer for role in classify(paths).values() if role.kind == EXPERT}))


def layer_positions(layers: Iterable[str]) -> Dict[str, Optional[Tuple[str, int]]]:
  """{MLP path: (stack, layer index)} as the names say, for trees without their model config:
  an MLP's parent is `<block>_<i>` in T5X's and big_vision's naming ('encoder/layers_3/mlp' ->
  ('encoder/layers', 3), 'Transformer/encoderblock_5/MlpBlock_0' ->
  ('Transformer/encoderblock', 5)); None for a path without one. The models' configs give the
  same from what they build (`T5Config.moe_positions()`)."""
  positions = {}
  for layer in layers:
    match = re.fullmatch(r'(.+)_(\d+)/[^/]+', layer)
    positions[layer] = None if match is None else (match.group(1), int(match.group(2)))
  return positions


def is_scanned(params: Any) -> bool:
  """Whether a parameter tree is in a scanned layout (has `.../subblock_{j}/...` paths)."""
  return any(_SCANNED.fullmatch(path) for path in flatten(params))


def unroll_scanned(params: Any) -> Dict[str, Any]:
  """A scanned tree unrolled from its names and shapes alone (no model config): each stack's
  `PREFIX/NAME/subblock_{j}/REST [n, ...]` becomes `PREFIX/NAME_{k·p + j}/REST` for k < n, p
  the number of sub-blocks the stack has. Leaves are indexed (`leaf[k]`: numpy, jax or lazy;
  abstract ones lose the axis). A tree whose paths extend the parameters' (optimizer slots
  `.../kernel/v_row`, the layers axis first) unrolls the same way.
  (`upcycle.models.scan_layout.unstack` inverts its `stack` given the config; this needs
  none.)"""
  flat = flatten(params)
  periods: Dict[Tuple[str, str], set] = {}
  for path in flat:
    match = _SCANNED.fullmatch(path)
    if match:
      periods.setdefault(match.group(1, 2), set()).add(int(match.group(3)))
  out = {}
  for path, leaf in flat.items():
    match = _SCANNED.fullmatch(path)
    if not match:
      out[path] = leaf
      continue
    prefix, name, j, rest = match.group(1), match.group(2), int(match.group(3)), match.group(4)
    p = len(periods[(prefix, name)])
    for k in range(leaf.shape[0]):
      out[f'{prefix}{name}_{k * p + j}/{rest}'] = (
          jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
          if isinstance(leaf, jax.ShapeDtypeStruct) else leaf[k])
  return unflatten(out)

