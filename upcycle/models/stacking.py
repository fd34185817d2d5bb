"""A stack of blocks, unrolled or scanned over periods (`scan_layout`), with rematerialization.

`apply_stack` is called inside a model's compact `__call__`: unrolled it creates the blocks
`layers_{i}` there, scanned it creates one `nn.scan` module over `Period`s whose parameters carry
the logical axis `layers`. Remat wraps each block (`jax.checkpoint`) with one of:

  'none'     keep every activation (no remat)
  'full'     keep only each block's inputs; recompute the rest on the backward pass
  'minimal'  also keep matmul results without batch dimensions (T5X / Flaxformer 'minimal':
             `jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`)
  'dots'     keep every matmul result (`jax.checkpoint_policies.dots_saveable`)
"""

from typing import Any, Dict, Sequence, Tuple, Type

import flax.linen as nn
import jax

from upcycle import tree
from upcycle.models import scan_layout

REMAT_POLICIES = {
    'none': None,
    'full': None,
    'minimal': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'dots': jax.checkpoint_policies.dots_saveable,
}



# Collections a block may create or sow, scanned with its parameters: stacked on the `layers`
# axis (axis 0), the decoding cache on axis 1 so that every cache leaf keeps batch first.
SCANNED_AXES = {'params': 0, 'aux_loss': 0, 'moe_metrics': 0, 'router_logits': 0,
                'intermediates': 0, 'cache': 1}


def remat(layer: Type[nn.Module], policy: str, static_argnums: Sequence[int],
          scanned: bool) -> Type[nn.Module]:
  """`layer` (a block class) under `jax.checkpoint` with `policy`; itself for 'none'.

  `static_argnums` index `__call__`'s arguments with `self` as 0 (the Python flags).
  """
  if policy == 'none':
    return layer
  return nn.remat(layer, policy=REMAT_POLICIES[policy], prevent_cse=not scanned,
                  static_argnums=tuple(static_argnums))


class Period(nn.Module):
  """One period of a scanned stack: sub-blocks `subblock_{j}`, dense or MoE by `pattern`.

  `__call__(x, *dynamic) -> (x, None)`, the `nn.scan` carry signature; each sub-block is called
  as `layer(config, sparse)(x, *dynamic, *static)`.
  """

  layer: Any
  config: Any
  pattern: Tuple[bool, ...]
  static: Tuple[Any, ...] = ()

  @nn.compact
  def __call__(self, x, *dynamic):
    for j, sparse in enumerate(self.pattern):
      x = self.layer(self.config, sparse, name=tree.SUBBLOCK.format(j))(
          x, *dynamic, *self.static)
    return x, None


def apply_stack(layer: Type[nn.Module], config: Any, stack: int, x: jax.Array,
                dynamic: Sequence[Any], static: Sequence[Any]) -> jax.Array:
  """Applies stack number `stack` of `config.layer_stacks()` to `x` `[batch, length, d]`.

  Args:
    layer: the block class, built `layer(config, sparse)` and called `(x, *dynamic, *static)`.
    config: a T5Config / ViTConfig: its `layer_stacks()` (names, depth, MoE layers),
      `scan_layers` and `remat_policy` (a key of `REMAT_POLICIES`).
    dynamic: arrays (or None) every block reads, e.g. attention biases.
    static: trailing Python values (deterministic, decode flags).
  Unrolled, the blocks are `block_name.format(i)`; scanned, one module `scanned_name` runs
  `num_layers / p` periods (`scan_layout`), its parameters `[num_layers / p, ...]`.
  """
  _, block_name, scanned_name, num_layers, sparse = config.layer_stacks()[stack]
  scan = config.scan_layers
  # nn.remat and nn.scan take positional arguments: `block(...)(x, *dynamic, *static)`, so in
  # `__call__(self, x, *dynamic, *static)` the static values sit after self, x and dynamic.
  static_positions = range(2 + len(dynamic), 2 + len(dynamic) + len(static))
  block = remat(layer, config.remat_policy, static_positions, scan)
  if not scan:
    for i in range(num_layers):
      x = block(config, i in set(sparse), name=block_name.format(i))(x, *dynamic, *static)
    return x
  pattern = scan_layout.pattern(sparse, num_layers)
  scanned = nn.scan(
      Period, variable_axes=SCANNED_AXES,
      split_rngs={'params': True, 'dropout': True, 'jitter': True},
      in_axes=(nn.broadcast,) * len(dynamic), length=num_layers // len(pattern),
      metadata_params={nn.PARTITION_NAME: 'layers'})
  x, _ = scanned(block, config, pattern, tuple(static), name=scanned_name)(x, *dynamic)
  return x


def moe_positions(config: Any, mlp: str) -> Dict[str, Tuple[str, int]]:
  """{unrolled path of every MoE block's MLP: (its stack, its layer index)}, from
  `config.layer_stacks()`: ('encoder/layers', 3) for 'encoder/layers_3/mlp'."""
  return {f'{prefix}/{block.format(i)}/{mlp}': (f'{prefix}/{scanned}', i)
          for prefix, block, scanned, _, sparse in config.layer_stacks() for i in sparse}

