"""Parameter paths and the one upcycling rule that classifies them.

Param trees are nested dicts of arrays; a path is the '/'-joined key sequence,
e.g. 'encoder/layers_1/mlp/expert/wi_0/kernel'. Every MoE block of either
model follows one naming rule (DESIGN.md), so one classification serves the
weights and the optimizer state alike:

  X/expert/Y  <- expert initializer applied to the dense MLP leaves X/Y
  X/router/Z  <- router initializer (only where X/expert/... exists too)
  anything P  <- dense leaf P, copied
"""

import dataclasses
from typing import Any, Dict, Mapping, Tuple

from flax.core import meta

from upcycle.checkpoints.tree import unflatten  # pylint: disable=unused-import  (re-exported)

EXPERT = 'expert'
ROUTER = 'router'


def unbox(leaf: Any) -> Any:
  """The value inside flax `nn.Partitioned` / `nn.LogicallyPartitioned` boxes.

  Abstract targets from `jax.eval_shape(model.init, ...)` carry these boxes;
  their `.value` is the `jax.ShapeDtypeStruct`. No sharding constraint is
  applied, unlike `box.unbox()` under a mesh.
  """
  while isinstance(leaf, meta.AxisMetadata):
    leaf = leaf.value
  return leaf


def flatten(tree: Mapping[str, Any], prefix: str = '') -> Dict[str, Any]:
  """Nested dicts -> {'a/b/c': leaf}, boxes unboxed. Does not copy leaves."""
  flat = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, Mapping):
      flat.update(flatten(value, prefix=f'{path}/'))
    else:
      flat[path] = unbox(value)
  return flat


def join(*parts: str) -> str:
  return '/'.join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class Role:
  """What one target leaf is in the upcycled model.

  Attributes:
    kind: 'copy', 'expert' or 'router'.
    layer: X, the path of the MoE block ('' for copied leaves).
    name: Y below X/expert/ or Z below X/router/ (the full path for copies).
    source: the dense leaf it comes from: X/Y for experts, the same path for
      copies, '' for routers.
  """

  kind: str
  layer: str
  name: str
  source: str


def classify(paths) -> Dict[str, Role]:
  """Roles of all target paths under the naming rule (see module docstring).

  The first 'expert' key of a path splits it into X/expert/Y. A 'router' key
  marks a router leaf only if its prefix X also has experts, so that a dense
  model with a module that happens to be called 'router' is copied as usual.
  """
  paths = list(paths)
  layers = set()
  for path in paths:
    keys = path.split('/')
    if EXPERT in keys:
      layers.add('/'.join(keys[:keys.index(EXPERT)]))
  roles = {}
  for path in paths:
    keys = path.split('/')
    if EXPERT in keys:
      i = keys.index(EXPERT)
      layer, name = '/'.join(keys[:i]), '/'.join(keys[i + 1:])
      roles[path] = Role('expert', layer, name, join(layer, name))
      continue
    if ROUTER in keys:
      i = keys.index(ROUTER)
      layer = '/'.join(keys[:i])
      if layer in layers:
        roles[path] = Role('router', layer, '/'.join(keys[i + 1:]), '')
        continue
    roles[path] = Role('copy', '', path, path)
  return roles


def shape_of(leaf: Any) -> Tuple[int, ...]:
  return tuple(int(d) for d in leaf.shape)
