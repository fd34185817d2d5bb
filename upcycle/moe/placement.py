"""Which blocks of a stack are sparse."""

import re
from typing import Sequence, Union


def sparse_layer_indices(placement: Union[str, Sequence[int]], num_layers: int) -> tuple:
  """Indices of the MoE blocks in a stack of `num_layers` blocks.

  'every_other' -> 1, 3, 5, ... (the Sparse Upcycling default); 'all'; 'none';
  'last_N' / 'first_N'; or an explicit sequence of indices.
  """
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
      raise ValueError(f'MoE placement {placement!r} asks for {n} layers; the stack has {num_layers}.')
    return tuple(range(num_layers - n, num_layers)) if match.group(1) == 'last' else tuple(range(n))
  indices = tuple(sorted(set(int(i) for i in placement)))
  bad = [i for i in indices if not 0 <= i < num_layers]
  if bad:
    raise ValueError(
        f'MoE placement {tuple(placement)} names layers {bad} outside 0..{num_layers - 1}.')
  return indices
