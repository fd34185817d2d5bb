"""Routers: router probabilities -> `RoutingDecision` (who goes where, with what weight).

Both routers describe their decision the same way, per group and expert slot:
`token_index [groups, experts, capacity]` (which token fills the slot),
`combine_weight [groups, experts, capacity]` and `valid [groups, experts, capacity]`
(False for a slot no token filled). Dispatch implementations (layer.py) only read this.
"""

from typing import Optional, Tuple

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class RoutingDecision:
  token_index: Array     # [groups, experts, capacity] int32 in [0, tokens)
  combine_weight: Array  # [groups, experts, capacity] float32, 0 where not valid
  valid: Array           # [groups, experts, capacity] bool


@flax.struct.dataclass
class SlotUse:
  """What a routing fills, as the layer's metrics read it."""
  slots_per_token: Array   # [groups, tokens] int32: expert slots each token fills
  per_expert: Array        # [groups, experts] float32: filled slots per expert
  weight: Array            # [] float32: the filled slots' combine weights, summed
  num_slots: int = flax.struct.field(pytree_node=False)   # all slots, filled or not


def slot_use(decision: RoutingDecision, num_tokens: int) -> SlotUse:
  """The slots of a capacity-bound `decision` over groups of `num_tokens`."""
  return SlotUse(slots_per_token=token_slot_counts(decision, num_tokens),
                 per_expert=jnp.sum(decision.valid, axis=2, dtype=jnp.float32),
                 weight=jnp.sum(jnp.where(decision.valid, decision.combine_weight, 0.0)),
                 num_slots=decision.valid.size)


def dropless_use(gates: Array, expert_index: Array, routed: Array, num_experts: int) -> SlotUse:
  """The rows of a dropless routing, as slots of a capacity of the whole group: gates,
  expert_index and routed (False: padding) `[groups, tokens, k]`."""
  groups, tokens, _ = gates.shape
  chosen = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32) * routed[..., None]
  return SlotUse(slots_per_token=jnp.sum(routed, axis=-1, dtype=jnp.int32),
                 per_expert=jnp.sum(chosen, axis=(1, 2)),
                 weight=jnp.sum(jnp.where(routed, gates, 0.0)),
                 num_slots=groups * num_experts * tokens)


def _slot_holds_token(decision: RoutingDecision, num_tokens: int) -> Array:
  """`[groups, experts, capacity, tokens]`: True where the slot holds the token (a
  comparison XLA fuses into the reduction that reads it: neither scatters nor is stored)."""
  return decision.valid[..., None] & (decision.token_index[..., None] == jnp.arange(num_tokens))


def token_weight_sums(decision: RoutingDecision, num_tokens: int) -> Array:
  """Sum of each token's combine weights over the slots it fills: `[groups, tokens]`."""
  hits = _slot_holds_token(decision, num_tokens)
  return jnp.sum(jnp.where(hits, decision.combine_weight[..., None], 0.0), axis=(1, 2))


def token_slot_counts(decision: RoutingDecision, num_tokens: int) -> Array:
  """How many expert slots each token fills: `[groups, tokens]`."""
  return jnp.sum(_slot_holds_token(decision, num_tokens), axis=(1, 2), dtype=jnp.int32)


def normalize_combine_weights(decision: RoutingDecision, num_tokens: int) -> RoutingDecision:
  """Rescale so each token's weights over the experts that took it sum to 1.

  A token no expert took has no weights and keeps output 0 (residual only).
  """
  sums = token_weight_sums(decision, num_tokens)                      # [G, S]
  hits = _slot_holds_token(decision, num_tokens)                      # [G, E, C, S]
  per_slot = jnp.sum(jnp.where(hits, sums[:, None, None, :], 0.0), axis=-1)  # [G, E, C]
  safe = jnp.where(per_slot > 0, per_slot, 1.0)
  weights = jnp.where(decision.valid & (per_slot > 0), decision.combine_weight / safe, 0.0)
  return decision.replace(combine_weight=weights)


def experts_choose(probs: Array, capacity: int,
                   token_mask: Optional[Array] = None) -> RoutingDecision:
  """Expert Choice: every expert takes its `capacity` most probable tokens.

  Args:
    probs: `[groups, tokens, experts]` router probabilities (softmax over experts).
    capacity: slots per expert, at most `tokens`.
    token_mask: `[groups, tokens]`, False for padding, which is then taken last.

  Each expert looks at every token of the group, future ones included: never
  use this in a causal decoder.
  """
  if token_mask is not None:
    probs = probs * token_mask[..., None]
  weights, index = jax.lax.top_k(jnp.swapaxes(probs, 1, 2), capacity)  # [G, E, C]
  valid = jnp.ones(index.shape, bool)
  if token_mask is not None:
    valid = jnp.take_along_axis(token_mask, index.reshape(index.shape[0], -1), axis=1
                                ).reshape(index.shape)
  return RoutingDecision(index.astype(jnp.int32), jnp.where(valid, weights, 0.0), valid)


def tokens_choose(probs: Array, expert_index: Array, capacity: int,
                  batch_priority: bool = False,
                  token_mask: Optional[Array] = None) -> RoutingDecision:
  """Top-K: every token takes its K chosen experts' slots, in priority order.

  Args:
    probs: `[groups, tokens, experts]` router probabilities.
    expert_index: `[groups, tokens, k]` each token's K most probable experts, the most
      probable first (`jax.lax.top_k(probs, k)[1]`).
    capacity: slots per expert; choices past it are dropped (the token then
      passes on the residual only for that choice).
    batch_priority: rank tokens by their top-1 probability (Batch Priority
      Routing) instead of by position in the group.
    token_mask: `[groups, tokens]`, False for padding, which claims no slot.

  Every first choice of every token outranks every second choice, and so on. Formed as
  Flaxformer's masked router forms it, with no scatter forward or backward: a token's slot in
  an expert is a cumulative sum over one-hot choices, and each slot's token and weight are
  read off by comparing slots with positions (the weight is the router probability itself,
  so its gradient reaches `probs` without top-k's).
  """
  groups, tokens, experts = probs.shape
  k = expert_index.shape[-1]
  if batch_priority:
    order = jnp.argsort(-jnp.max(probs, axis=-1), axis=1, stable=True)  # [G, S]
    expert_index = jnp.take_along_axis(expert_index, order[..., None], axis=1)
    if token_mask is not None:
      token_mask = jnp.take_along_axis(token_mask, order, axis=1)
  chosen = jax.nn.one_hot(expert_index, experts, dtype=jnp.int32)     # [G, S, K, E]
  if token_mask is not None:
    chosen = chosen * token_mask[:, :, None, None].astype(jnp.int32)
  # Candidates k-major: all first choices, then all second choices, ...
  chosen = jnp.swapaxes(chosen, 1, 2).reshape(groups, k * tokens, experts)
  position = jnp.cumsum(chosen, axis=1) * chosen - 1                  # slot, -1: not chosen
  # A token chooses an expert at most once: its slot there, over its K choices.
  position = jnp.max(position.reshape(groups, k, tokens, experts), axis=1)  # [G, S, E]
  if batch_priority:
    position = jnp.take_along_axis(position, jnp.argsort(order, axis=1)[..., None], axis=1)
  holds = position[..., None] == jnp.arange(capacity)                # [G, S, E, C]
  token = jnp.arange(tokens, dtype=jnp.int32)[None, :, None, None]
  return RoutingDecision(
      token_index=jnp.sum(jnp.where(holds, token, 0), axis=1),
      combine_weight=jnp.sum(jnp.where(holds, probs[..., None], 0.0), axis=1),
      valid=jnp.any(holds, axis=1))


def load_balancing_statistics(probs: Array, expert_index: Array, scope: str = 'group',
                              token_mask: Optional[Array] = None) -> Tuple[Array, Array]:
  """Per-expert statistics of the Switch load-balancing loss: (f, p), `[groups, experts]`.

  Args:
    probs: `[groups, tokens, experts]`.
    expert_index: `[groups, tokens, k]` the experts each token chose.
    scope: 'group': f_ge is the fraction of group g's tokens that chose e (among
      their K; it sums to K over e), p_ge the mean probability of e in group g.
      'batch': the same over all tokens of all groups, as one group (`[1, experts]`).
    token_mask: `[groups, tokens]`, the tokens routing considers (False: padding). f and p
      are means over them; a group with none has f = p = 0. None: every token.
  """
  experts = probs.shape[-1]
  chosen = jnp.max(jax.nn.one_hot(expert_index, experts, dtype=jnp.float32), axis=-2)
  if scope == 'batch':
    chosen, probs = chosen.reshape(1, -1, experts), probs.reshape(1, -1, experts)
    token_mask = None if token_mask is None else token_mask.reshape(1, -1)
  if token_mask is None:
    return jnp.mean(chosen, axis=1), jnp.mean(probs, axis=1)
  weight = token_mask.astype(jnp.float32)[..., None]                 # [G, S, 1]
  count = jnp.maximum(jnp.sum(weight, axis=1), 1.0)                   # [G, 1]
  return jnp.sum(chosen * weight, axis=1) / count, jnp.sum(probs * weight, axis=1) / count


def load_balancing_loss(fraction: Array, mean_prob: Array) -> Array:
  """Switch Transformer auxiliary loss, E * mean_g sum_e f_ge p_ge (K when routing is uniform).

  fraction, mean_prob: `[groups, experts]` (`load_balancing_statistics`). The mean is over the
  groups with a routed token (f summing to K, not 0): an all-padding group counts in neither
  sum nor count. With every group present this is E^2 * mean_{g,e}(f_ge * p_ge), Flaxformer's
  `_load_balancing_loss`.
  """
  experts = fraction.shape[-1]
  present = jnp.sum(fraction, axis=-1, keepdims=True) > 0             # [G, 1]
  total = jnp.sum(jnp.where(present, fraction * mean_prob, 0.0))
  return total / (jnp.maximum(jnp.sum(present), 1) * experts) * experts ** 2


def effective_experts(tokens_per_expert: Array) -> Array:
  """exp(entropy) of the experts' shares of the routed tokens, `[E]` -> scalar: the number of
  equally loaded experts that would spread tokens as evenly (1 to E; 2.0 when two experts take
  them all, as a collapsed router does). 1.0 when nothing is routed."""
  share = tokens_per_expert / jnp.maximum(jnp.sum(tokens_per_expert), 1e-9)
  entropy = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)),
                               0.0))
  return jnp.exp(entropy)


def router_z_loss(logits: Array, token_mask: Optional[Array] = None) -> Array:
  """ST-MoE z-loss: mean of logsumexp(logits)^2 over the tokens of `token_mask`.

  logits `[G, S, E]`; token_mask `[G, S]` (False: padding, not counted), None: every token.
  """
  z = jnp.square(jax.nn.logsumexp(logits, axis=-1))
  if token_mask is None:
    return jnp.mean(z)
  weight = token_mask.astype(jnp.float32)
  return jnp.sum(z * weight) / jnp.maximum(jnp.sum(weight), 1.0)
