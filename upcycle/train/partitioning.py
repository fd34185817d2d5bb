"""The mesh ('data', 'expert', 'model') and the one table mapping logical axes onto it.

Models name their axes (layers.py, moe/layer.py); only this table decides where
they live. The batch is split over ('expert', 'data'), expert weights over
'expert', MLP/heads/vocab over 'model'. Everything else is replicated, the
`layers` axis of scanned parameters included (as T5X's default rules).
"""

import contextlib
import math
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from upcycle import fields

MESH_AXES = ('data', 'expert', 'model')

LOGICAL_AXIS_RULES: Tuple[Tuple[str, Any], ...] = (
    ('batch', ('expert', 'data')),
    ('expert_group', 'data'),
    ('expert', 'expert'),
    ('vocab', 'model'),
    ('mlp', 'model'),
    ('expert_mlp', 'model'),
    ('heads', 'model'),
    ('joined_kv', 'model'),
    ('kv', None),
    ('embed', None),
    ('mlp_embed', None),
    ('length', None),
    ('relpos_buckets', None),
    ('unmodeled', None),
    ('classes', None),
    ('layers', None),       # the stacked axis of scanned layers: every device holds all layers
)


def make_mesh(num_expert_partitions: int = 1, num_model_partitions: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A ('data', 'expert', 'model') mesh over all (or the given) devices.

  data = num_devices / (expert * model). Axes are GSPMD-style (AxisType.Auto),
  what `with_sharding_constraint` under `jax.jit` expects.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  parts = num_expert_partitions * num_model_partitions
  if n % parts:
    raise fields.ConfigError(
        f'num_expert_partitions={num_expert_partitions} x num_model_partitions='
        f'{num_model_partitions} = {parts} does not divide the {n} devices.')
  shape = (n // parts, num_expert_partitions, num_model_partitions)
  if len(devices) == jax.device_count():
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_sharding(boxed_tree: Any, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Any:
  """NamedShardings for a tree of `nn.LogicallyPartitioned` boxes (e.g. from eval_shape(init))."""
  specs = nn.get_partition_spec(boxed_tree)
  mesh_specs = nn.logical_to_mesh(specs, rules)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), mesh_specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def check_divisible(boxed_tree: Any, mesh: Mesh, sizes: Mapping[str, str],
                    rules=LOGICAL_AXIS_RULES) -> None:
  """Refuses a parameter dimension that the mesh axes it is split over do not divide (jax
  would stop later with an IndivisibleError that names no setting). `sizes`: the binding that
  sets each mesh axis's size ('expert', 'model'), named in the error with the fix."""
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  for keypath, box in jax.tree_util.tree_flatten_with_path(boxed_tree, is_leaf=is_box)[0]:
    if not is_box(box):
      continue
    spec = nn.logical_to_mesh_axes(box.names, rules)
    for size, logical, axes in zip(box.value.shape, box.names, spec):
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      ways = math.prod(mesh.shape[a] for a in axes)
      if size % ways:
        path = '/'.join(str(k.key) for k in keypath)
        what = 'NUM_EXPERTS' if logical == 'expert' else f'its {logical!r} size'
        split = ' x '.join(f'{sizes.get(a, a)} = {mesh.shape[a]}' for a in axes)
        partitions = ' x '.join(sizes.get(a, a) for a in axes)
        raise fields.ConfigError(
            f'{path} has {size} along {logical!r}, split over {split}, which does not divide '
            f'it. Fix: make {what} a multiple of {ways}, or {partitions} a divisor of {size}.')


def logical_axes(boxed_tree: Any) -> Dict[str, Optional[Tuple[Optional[str], ...]]]:
  """param path -> its logical axis names (None for an unboxed leaf), e.g. for T5XAdafactor."""
  flat = {}
  for keypath, box in jax.tree_util.tree_flatten_with_path(
      boxed_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]:
    path = '/'.join(str(k.key) for k in keypath)
    flat[path] = tuple(box.names) if isinstance(box, nn.LogicallyPartitioned) else None
  return flat


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Inputs `[batch, ...]`: batch over ('expert', 'data'), the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(('expert', 'data'), *([None] * (ndim - 1))))


@contextlib.contextmanager
def activate(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Iterator[Mesh]:
  """Within: the models' logical constraints resolve against `mesh` with `rules`."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield mesh
