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


def token_weight_sums(decision: RoutingDecision, num_tokens: int) -> Array:
  """Sum of each token's combine weights over the slots it fills: `[groups, tokens]`."""
  groups = decision.token_index.shape[0]
  weights = jnp.where(decision.valid, decision.combine_weight, 0.0)
  sums = jnp.zeros((groups, num_tokens), jnp.float32)
  g = jnp.arange(groups)[:, None, None]
  return sums.at[g, decision.token_index].add(weights)


def token_slot_counts(decision: RoutingDecision, num_tokens: int) -> Array:
  """How many expert slots each token fills: `[groups, tokens]`."""
  groups = decision.token_index.shape[0]
  counts = jnp.zeros((groups, num_tokens), jnp.int32)
  g = jnp.arange(groups)[:, None, None]
  return counts.at[g, decision.token_index].add(decision.valid.astype(jnp.int32))


def normalize_combine_weights(decision: RoutingDecision, num_tokens: int) -> RoutingDecision:
  """Rescale so each token's weights over the experts that took it sum to 1.

  A token no expert took has no weights and keeps output 0 (residual only).
  """
  sums = token_weight_sums(decision, num_tokens)                      # [G, S]
  per_slot = jnp.take_along_axis(
      sums, decision.token_index.reshape(sums.shape[0], -1), axis=1
  ).reshape(decision.token_index.shape)                               # [G, E, C]
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


def tokens_choose(probs: Array, k: int, capacity: int, batch_priority: bool = False,
                  token_mask: Optional[Array] = None) -> RoutingDecision:
  """Top-K: every token picks its `k` most probable experts, in priority order.

  Args:
    probs: `[groups, tokens, experts]` router probabilities.
    k: experts per token.
    capacity: slots per expert; choices past it are dropped (the token then
      passes on the residual only for that choice).
    batch_priority: rank tokens by their top-1 probability (Batch Priority
      Routing) instead of by position in the group.
    token_mask: `[groups, tokens]`, False for padding, which claims no slot.

  Every first choice of every token outranks every second choice, and so on.
  """
  groups, tokens, experts = probs.shape
  gates, expert_index = jax.lax.top_k(probs, k)                       # [G, S, K]
  if batch_priority:
    order = jnp.argsort(-gates[..., 0], axis=1, stable=True)          # [G, S]
  else:
    order = jnp.broadcast_to(jnp.arange(tokens), (groups, tokens))
  take = lambda x: jnp.take_along_axis(x, order[..., None], axis=1)
  gates, expert_index = take(gates), take(expert_index)              # priority order
  chosen = jax.nn.one_hot(expert_index, experts, dtype=jnp.int32)     # [G, S, K, E]
  if token_mask is not None:
    mask = jnp.take_along_axis(token_mask, order, axis=1)
    chosen = chosen * mask[:, :, None, None].astype(jnp.int32)
  # Candidates k-major: all first choices, then all second choices, ...
  chosen = jnp.swapaxes(chosen, 1, 2).reshape(groups, k * tokens, experts)
  position = jnp.cumsum(chosen, axis=1) - 1                           # slot in the expert
  keep = (chosen > 0) & (position < capacity)
  candidate_token = jnp.tile(order, (1, k))                           # [G, K*S]
  candidate_gate = jnp.swapaxes(gates, 1, 2).reshape(groups, k * tokens)
  slot = jnp.where(keep, position, capacity)                          # out of range: dropped
  g = jnp.arange(groups)[:, None, None]
  e = jnp.arange(experts)[None, None, :]
  shape = (groups, experts, capacity)
  scatter = lambda init, values: init.at[g, e, slot].set(
      jnp.broadcast_to(values[..., None], slot.shape), mode='drop')
  token_index = scatter(jnp.zeros(shape, jnp.int32), candidate_token.astype(jnp.int32))
  combine_weight = scatter(jnp.zeros(shape, jnp.float32), candidate_gate.astype(jnp.float32))
  valid = scatter(jnp.zeros(shape, bool), jnp.ones_like(candidate_token, bool))
  return RoutingDecision(token_index, combine_weight, valid)


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


def router_z_loss(logits: Array, token_mask: Optional[Array] = None) -> Array:
  """ST-MoE z-loss: mean of logsumexp(logits)^2 over the tokens of `token_mask`.

  logits `[G, S, E]`; token_mask `[G, S]` (False: padding, not counted), None: every token.
  """
  z = jnp.square(jax.nn.logsumexp(logits, axis=-1))
  if token_mask is None:
    return jnp.mean(z)
  weight = token_mask.astype(jnp.float32)
  return jnp.sum(z * weight) / jnp.maximum(jnp.sum(weight), 1.0)
