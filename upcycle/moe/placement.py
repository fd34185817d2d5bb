"""Which blocks of a stack are sparse: a model config's `*moe_layers` field.

A placement is 'every_other' (1, 3, 5, ..., the Sparse Upcycling default), 'all', 'none',
'last_N' / 'first_N', or explicit layer indices. It belongs to the model config, which knows
the stack's depth (`T5Config.encoder_moe_layers`, `ViTConfig.moe_layers`,
`LlamaConfig.moe_layers`); the MoE block's own config (`MoeConfig`) says how a block routes.
"""

import re
from typing import Any, Sequence, Union

from upcycle import fields

Placement = Union[str, Sequence[int]]


def sparse_layer_indices(placement: Placement, num_layers: int) -> tuple:
  """Indices of the MoE blocks in a stack of `num_layers` blocks; ValueError if `placement`
  is not understood or names a layer the stack does not have."""
  if isinstance(placement, str):
    if placement == 'every_other':
      return tuple(range(1, num_layers, 2))
    if placement == 'all':
      return tuple(range(num_layers))
    if placement == 'none':
      return ()
    match = re.fullmatch(r'(last|first)_(\d+)', placement)
    if not match:
      raise ValueError(
          f"MoE placement {placement!r} is not understood: use 'every_other', 'all', "
          f"'none', 'last_N', 'first_N' or a list of layer indices.")
    n = int(match.group(2))
    if n > num_layers:
      raise ValueError(f'MoE placement {placement!r} asks for {n} layers; the stack has '
                       f'{num_layers}.')
    return tuple(range(num_layers - n, num_layers)) if match.group(1) == 'last' else tuple(range(n))
  indices = tuple(sorted(set(int(i) for i in placement)))
  bad = [i for i in indices if not 0 <= i < num_layers]
  if bad:
    raise ValueError(
        f'MoE placement {tuple(placement)} names layers {bad} outside 0..{num_layers - 1}.')
  return indices


def check(config: Any, field: str, num_layers: int) -> None:
  """Checks `config.<field>` against a stack of `num_layers` blocks (a frozen dataclass's
  `__post_init__`); stores explicit indices as a tuple. Raises `fields.ConfigError` naming the
  gin binding."""
  value = getattr(config, field)
  if not isinstance(value, str):
    try:
      value = tuple(int(i) for i in value)
    except (TypeError, ValueError):
      raise fields.ConfigError(
          f'{fields.binding(config, field)} = {value!r}: expected a string such as '
          f"'every_other' or a sequence of layer indices.") from None
    object.__setattr__(config, field, value)
  try:
    sparse_layer_indices(value, num_layers)
  except ValueError as e:
    raise fields.ConfigError(f'{fields.binding(config, field)}: {e}') from None
