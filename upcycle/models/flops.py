"""Training FLOPs per step, from the model config, the batch shape and the routing capacity.

Counts the matrix multiplications (2 FLOPs per multiply-add), which dominate; norms,
softmaxes, activations, the router's top-k and the MoE dispatch/combine (a gather/scatter
with `dispatch='indices'`) are left out. A training step is 3 forward passes (the backward
pass costs two). An MoE block computes its experts on every capacity slot, filled or not
(with `dispatch='ragged'`, on each token's k choices only):
groups x E x capacity slots of one expert MLP each, plus the router (d x E per token), with
the training capacity factor and the grouping of `MoeConfig` (padding included), and its
shared expert (`MoeConfig.shared_expert`) on every token.

Each family's config counts its own forward pass with these (`T5Config.forward_flops`,
`ViTConfig.forward_flops`, `LlamaConfig.forward_flops`); its objective gives the batch shape
(`objectives.*.train_flops`).
"""

from typing import Optional

from upcycle.moe.config import MoeConfig

TRAIN_PASSES = 3


def attention(queries: int, keys: int, d_in: int, inner: int) -> int:
  """q/o projections of the queries, k/v of the keys, scores and the weighted sum."""
  return 2 * (2 * queries * d_in * inner + 2 * keys * d_in * inner + 2 * queries * keys * inner)


def mlp_block(moe: Optional[MoeConfig], batch: int, length: int, d: int, d_ff: int,
              unit_flops: int) -> int:
  """A dense MLP of `d_ff` units, `unit_flops` per unit and token, on batch x length tokens,
  or an MoE block of it: its experts on every capacity slot, its router, its shared expert."""
  tokens = batch * length
  if moe is None:
    return tokens * d_ff * unit_flops
  plan = moe.group_plan(batch, length)
  if moe.dropless:     # each token's k rows, nothing more
    slots = plan.num_groups * plan.group_size * moe.router.experts_per_token
  else:
    slots = plan.num_groups * moe.num_experts * moe.capacity(plan.group_size, deterministic=False)
  shared = tokens * (moe.shared_d_ff(d_ff) or 0) * unit_flops
  return slots * d_ff * unit_flops + 2 * tokens * d * moe.num_experts + shared


def train_flops(forward_flops: int) -> int:
  """One training step: the forward pass and a backward pass costing two."""
  return TRAIN_PASSES * forward_flops
