"""The mesh ('data', 'expert', 'model') and the tables mapping logical axes onto it.

Models name their axes (layers.py, moe/layer.py); only a rule table decides where they live
(T5X's `logical_axis_rules`, chosen by `TrainConfig.logical_axis_rules`):

  'default'  the batch split over ('expert', 'data'), expert weights over 'expert',
             MLP/heads/vocab over 'model'; everything else replicated, the `layers` axis of
             scanned parameters included (T5X's default rules).
  'fsdp'     the same, and every parameter's d_model axis ('embed', 'mlp_embed') split over
             the devices the batch is split over, ('data', 'expert'), and over 'data' alone
             where 'expert' already splits the parameter (the experts' kernels): parameters
             and optimizer state fully sharded over the data-parallel devices (big_vision's
             `fsdp`, ZeRO-3; MaxText's 'embed' rule), gathered by XLA where a layer uses them.
             Activations keep the batch on ('expert', 'data') (flax gives each mesh axis to
             the first rule that asks for it, and 'batch' asks first).

Or any table of (logical axis, mesh axes) pairs, bound in gin.
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

Rules = Tuple[Tuple[str, Any], ...]

LOGICAL_AXIS_RULES: Rules = (
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
# Parameters' d_model axes over every data-parallel device, ('data', 'expert') (as MaxText's
# 'embed' rule, over its fsdp and expert axes), or over 'data' where 'expert' is taken (the
# experts' kernels); after 'batch', so activations keep theirs.
FSDP_RULES: Rules = tuple(
    rule for name, axes in LOGICAL_AXIS_RULES
    for rule in (((name, ('data', 'expert')), (name, 'data'))
                 if name in ('embed', 'mlp_embed') else ((name, axes),)))
RULE_SETS: Dict[str, Rules] = {'default': LOGICAL_AXIS_RULES, 'fsdp': FSDP_RULES}


def rules(value: Any, binding: str) -> Rules:
  """A rule set's name (`RULE_SETS`) or a sequence of (logical axis, mesh axes) pairs, mesh
  axes None, one of MESH_AXES or a tuple of them -> the rule table; anything else is refused
  naming `binding`."""
  if isinstance(value, str):
    if value not in RULE_SETS:
      raise fields.ConfigError(f'{binding} = {value!r}: expected one of {sorted(RULE_SETS)} or '
                               f"a list of (logical axis, mesh axes) pairs, e.g. [('batch', "
                               f"'data'), ('embed', None)].")
    return RULE_SETS[value]
  table = []
  for pair in value if isinstance(value, (list, tuple)) else [value]:
    pair = tuple(pair) if isinstance(pair, (list, tuple)) else (pair,)
    axes = pair[1] if len(pair) == 2 else None
    mesh_axes = (axes,) if isinstance(axes, str) or axes is None else tuple(axes)
    if (len(pair) != 2 or not isinstance(pair[0], str)
        or not all(a is None or a in MESH_AXES for a in mesh_axes)):
      raise fields.ConfigError(
          f'{binding}: {pair!r} is not a (logical axis, mesh axes) pair; mesh axes are None, '
          f'one of {MESH_AXES} or a tuple of them.')
    table.append((pair[0], axes if axes is None or isinstance(axes, str) else tuple(axes)))
  return tuple(table)


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


def mesh_sizes(*, expert: str, model: str) -> Dict[str, str]:
  """For `check_divisible`: each mesh axis -> the setting that sets its size, `expert` and
  `model` the bindings or flags of the expert and model partitions."""
  return {'expert': expert, 'model': model,
          'data': 'the data axis (devices / expert x model partitions)'}


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
