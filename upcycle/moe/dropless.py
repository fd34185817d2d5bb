"""The dropless dispatch: every token through its K experts, no capacity (Top-K only).

Each token's K choices become rows sorted by expert (`upcycle.moe.ragged`), the experts run
as grouped matmuls over exactly the rows that chose them (`upcycle.moe.experts`, with the
grouped kernel `Dropless.kernel`), sent to the devices of their experts where the mesh splits
the experts (`upcycle.moe.exchange`), and the outputs are unsorted and summed with the
weights. It equals `Slots` given a capacity of the whole group.
"""

import dataclasses
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import fields
from upcycle.grouped_kernels import GROUPED_KERNELS
from upcycle.moe import dispatch, exchange, experts, ragged, routers, routing

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Dropless(dispatch.Dispatch):
  """kernel: what multiplies each expert's rows, a key of `upcycle.grouped_kernels.
  GROUPED_KERNELS` (`MoeConfig.grouped_kernel`)."""

  kernel: str = 'ragged_dot'
  dropless = True

  def __post_init__(self):
    fields.choice(self, 'kernel', tuple(GROUPED_KERNELS))

  def validate(self, config) -> None:
    if not config.router.tokens_choose:
      raise fields.ConfigError(
          f"{fields.binding(config, 'dispatch')} = {config.dispatch!r} is dropless Top-K: each "
          f"token's k choices, with no capacity. Bind {fields.binding(config, 'router')} = "
          f"@routers.TopK(), or keep {config.router!r} with dispatch 'masked' or 'indices'.")

  def plan(self, routed: routers.Routing, mask: Optional[Array], num_tokens: int,
           config) -> Tuple[routing.SlotUse, Tuple[Array, Array, Array]]:
    """The plan: gates, expert_index and kept (False for padding, which goes through no
    expert) `[G, S, K]`."""
    kept = jnp.ones(routed.gates.shape, bool) if mask is None else jnp.broadcast_to(
        mask[..., None], routed.gates.shape)
    use = routing.dropless_use(routed.gates, routed.expert_index, kept, config.num_experts)
    return use, (routed.gates, routed.expert_index, kept)

  def __call__(self, grouped: Array, plan: Tuple[Array, Array, Array], *, config,
               expert: Callable[..., nn.Module], deterministic: bool) -> Array:
    gates, expert_index, kept = plan
    if config.normalize_combine_weights:
      gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    weights = jnp.where(kept, gates, 0.0)
    groups, tokens, d = grouped.shape
    parts = ragged.split_for_shards(groups, tokens)   # as many token sets as shards, or more
    cut = lambda x: x.reshape((groups * parts, tokens // parts) + x.shape[2:])
    rows, group_sizes, order, inverse = ragged.sort_by_expert(
        cut(grouped), cut(expert_index), cut(kept), config.num_experts)
    build = lambda sizes: experts.grouped_experts(
        expert, num_experts=config.num_experts, grouped_kernel=self.kernel, group_sizes=sizes)
    if exchange.expert_axes():   # expert parallelism: rows to their experts' devices and back
      received, local_sizes, sent = exchange.to_experts(rows, group_sizes)
      out = exchange.from_experts(build(local_sizes)(received, deterministic), sent)
    else:
      out = build(group_sizes)(rows, deterministic)
    out = ragged.unsort_and_combine(out, inverse, order, cut(weights), cut(kept))
    return out.reshape(groups, tokens, d)
