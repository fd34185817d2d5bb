"""The capacity-slot dispatches: each expert's slots `[E, G, C, d]` filled from the routing's
`RoutingDecision`, the experts vmapped over them, the outputs combined back.

`Slots('masked')`: one-hot einsums (TPU friendly); `Slots('indices')`: gathers and
scatter-adds by token index (CPU/GPU friendly). The same function of the slots.
"""

import dataclasses
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import fields, tree
from upcycle.layers import constrain
from upcycle.moe import dispatch, routers, routing

Array = jax.Array

# Expert slots [E, G, C, d_model] in two layouts: where their groups' tokens are (groups split
# like the batch: dispatch and combine are local there) and where their experts are (experts
# over 'expert', groups over 'data'). The masked dispatch computes in the first and then moves
# to the second (one all-to-all); the experts' outputs move back before combining, as in
# Flaxformer. Asking the dispatch einsum for the experts' layout directly costs far more
# temporary memory and makes XLA's TPU SPMD partitioner crash in its windowed-einsum pass
# when 'expert' is 32 and the one-hot [G, E, C, S] is large (T5's groups of 4096 tokens;
# benchmarks/tpu_expert_axis_32.py). The indices dispatch gathers straight into the experts'
# layout (the two-step layout measured more temporary memory for it).
TOKEN_SLOT_AXES = (None, 'batch', None, 'embed')
EXPERT_AXES = ('expert', 'expert_group', 'unmodeled', 'embed')
EXPERT_SLOT_AXES = ('expert', 'expert_group', 'embed')           # [E, G*C, d_model]


def dispatch_masked(x: Array, decision: routing.RoutingDecision, experts_fn) -> Array:
  """One-hot einsum dispatch/combine (TPU friendly).

  x `[G, S, d]` -> expert inputs `[E, G, C, d]` -> outputs `[G, S, d]`.
  """
  tokens = x.shape[1]
  one_hot = jax.nn.one_hot(decision.token_index, tokens, dtype=x.dtype)
  one_hot = one_hot * decision.valid[..., None].astype(x.dtype)       # [G, E, C, S]
  expert_in = constrain(jnp.einsum('gecs,gsd->egcd', one_hot, x), TOKEN_SLOT_AXES)
  expert_out = _run_where_experts_are(experts_fn, expert_in)
  combine = one_hot * decision.combine_weight[..., None].astype(x.dtype)
  return jnp.einsum('gecs,egcd->gsd', combine, expert_out)


def _run_where_experts_are(experts_fn, expert_in: Array) -> Array:
  """`[E, G, C, d]` slots in the tokens' layout -> the experts' outputs, in that layout."""
  expert_in = constrain(expert_in, EXPERT_AXES)
  expert_out = constrain(experts_fn(expert_in), EXPERT_AXES)
  return constrain(expert_out, TOKEN_SLOT_AXES)


def dispatch_indices(x: Array, decision: routing.RoutingDecision, experts_fn) -> Array:
  """Gather/scatter dispatch/combine by token index (CPU/GPU friendly).

  Expert inputs are gathered straight into the `[E, G, C, d]` layout and the outputs are
  scatter-added from it, so no transposed copy of either is made.
  """
  groups = x.shape[0]
  index = jnp.swapaxes(decision.token_index, 0, 1)                    # [E, G, C]
  g = jnp.arange(groups)[None, :, None]
  valid = jnp.swapaxes(decision.valid, 0, 1)[..., None].astype(x.dtype)
  # The indices come from top-k, so they are in bounds: no bounds masks in either direction.
  expert_in = constrain(x.at[g, index].get(mode='promise_in_bounds') * valid, EXPERT_AXES)
  expert_out = constrain(experts_fn(expert_in), EXPERT_AXES)
  weight = jnp.swapaxes(decision.combine_weight, 0, 1)[..., None].astype(x.dtype)
  return jnp.zeros_like(x).at[g, index].add(expert_out * weight, mode='promise_in_bounds')


# How `Slots.by` fills and empties the slots: x `[G, S, d]`, the decision, the experts on
# their slots `[E, G, C, d] -> [E, G, C, d]` -> `[G, S, d]`.
SLOT_FUNCTIONS = {'masked': dispatch_masked, 'indices': dispatch_indices}


def vmapped_experts(expert: Callable[..., nn.Module],
                    deterministic: bool) -> Callable[[Array], Array]:
  """E copies of the dense MLP module factory `expert` on their capacity slots:
  `[E, G, C, d] -> [E, G, C, d]`; parameters `expert/...` with a leading 'expert' axis."""
  experts = nn.vmap(
      expert, in_axes=(0, None), out_axes=0,
      variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
      metadata_params={nn.PARTITION_NAME: 'expert'},  # the logical axis
  )(intermediate_axes=None, name=tree.EXPERT)

  def run(expert_in: Array) -> Array:
    # [E, G, C, d] -> [E, G*C, d]: each expert multiplies one matrix of its slots. Handing
    # the experts [E, G, C, d] instead costs ~25% more time on CPU (two free dimensions
    # in every dot of the backward pass).
    num_experts, groups, capacity, d = expert_in.shape
    slots = constrain(expert_in.reshape(num_experts, groups * capacity, d), EXPERT_SLOT_AXES)
    expert_out = constrain(experts(slots, deterministic), EXPERT_SLOT_AXES)
    return expert_out.reshape(num_experts, groups, capacity, -1)

  return run


@dataclasses.dataclass(frozen=True)
class Slots(dispatch.Dispatch):
  """Capacity slots (`MoeConfig.capacity`), filled by `by`: 'masked' or 'indices'
  (`SLOT_FUNCTIONS`); tokens past an expert's capacity are dropped."""

  by: str = 'masked'
  dropless = False

  def __post_init__(self):
    fields.choice(self, 'by', tuple(SLOT_FUNCTIONS))

  def plan(self, routed: routers.Routing, mask: Optional[Array], num_tokens: int,
           config) -> Tuple[routing.SlotUse, routing.RoutingDecision]:
    return routing.slot_use(routed.decision, num_tokens), routed.decision

  def __call__(self, grouped: Array, plan: routing.RoutingDecision, *, config,
               expert: Callable[..., nn.Module], deterministic: bool) -> Array:
    decision = plan
    if config.normalize_combine_weights:
      decision = routing.normalize_combine_weights(decision, grouped.shape[1])
    return SLOT_FUNCTIONS[self.by](grouped, decision, vmapped_experts(expert, deterministic))
