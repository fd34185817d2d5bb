"""Dropless dispatch: token copies sorted by expert, the experts as grouped matmuls.

Each token's K choices become K rows; the rows are sorted by expert, so expert e's rows are
one contiguous block and an expert MLP is one grouped matmul per kernel over all of them
(`upcycle.moe.experts.grouped_matmul`, with a kernel of `upcycle.grouped_kernels`); the outputs are
unsorted and summed with the combine weights. No capacity, no slot: every choice is computed,
and an expert computes only the rows that chose it (with 'megablox' or 'blocked'; on CPU
`jax.lax.ragged_dot` lowers to a masked dense product over all groups, E times the work).
MaxText's `sparse_matmul` path.

The sort is a permutation whose gradient is the inverse permutation (`permute`), so neither
direction has a scatter-add; each token's K copies are a broadcast, whose gradient is a sum.

On a mesh, the rows stay on the devices of their tokens: the sort, each grouped matmul and the
unsort run per batch shard (`jax.shard_map` over the mesh axes the logical 'batch' axis is
split over), each device sorting its own tokens. With expert partitions, the sorted rows go to
the devices that hold their experts and come back (`upcycle.moe.exchange`); without, the expert
kernels enter every shard whole (gathered like FSDP's parameters, the gradient reduced back).
Outside a mesh they run whole.
"""

from typing import Tuple

import jax
import jax.numpy as jnp

from upcycle import layers

Array = jax.Array


@jax.custom_vjp
def permute(x: Array, order: Array, inverse: Array) -> Array:
  """`x[order]` for a permutation `order` of x's rows, `inverse` its inverse."""
  return x[order]


def _permute_fwd(x, order, inverse):
  return x[order], inverse


def _permute_bwd(inverse, grad):
  return grad[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def sorting_permutation(key: Array) -> Tuple[Array, Array]:
  """(order, inverse) int32 `[N]`: the stable permutation that sorts `key` `[N]` (ties keep
  their order) and its inverse."""
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  return order, jnp.argsort(order).astype(jnp.int32)


def sort_by_expert(x: Array, expert_index: Array, routed: Array,
                   num_experts: int) -> Tuple[Array, Array, Array, Array]:
  """Token copies sorted by the expert they go to.

  Args:
    x: `[G, S, d]` grouped tokens, G a multiple of the batch's shards (`split_for_shards`).
    expert_index: `[G, S, K]` each token's K experts.
    routed: `[G, S, K]` bool, False for a copy no expert computes (padding): sorted last,
      outside every group.
    num_experts: E.

  Returns:
    rows `[G*S*K, d]` (on a mesh: each batch shard's own copies, sorted within the shard),
    group_sizes `[shards, E]` int32 (rows of each expert per shard), order and inverse
    `[G*S*K]` (the shard-local permutation that sorted the copies, and its inverse).
  """

  def local(x, expert_index, routed):
    g, s, d = x.shape
    k = expert_index.shape[-1]
    key = jnp.where(routed, expert_index, num_experts).reshape(-1)        # [g*s*k]
    order, inverse = sorting_permutation(key)
    copies = jnp.broadcast_to(x.reshape(g * s, 1, d), (g * s, k, d)).reshape(g * s * k, d)
    # E + 1 queries against all copies at once, not a binary search: no loop for the TPU
    # compiler to count once (`upcycle/fit/step_count.py`).
    starts = jnp.searchsorted(key[order], jnp.arange(num_experts + 1, dtype=key.dtype),
                              method='compare_all')
    group_sizes = jnp.diff(starts).astype(jnp.int32)[None]               # [1, E]
    return permute(copies, order, inverse), group_sizes, order, inverse

  return layers.per_batch_shard(local, (True,) * 3, (True,) * 4)(x, expert_index, routed)


def split_for_shards(groups: int, tokens: int) -> int:
  """m: how many parts to cut each group's tokens into so that the G * m parts split evenly
  over the batch's shards (1 when G does; the routing is per token, so dropless outputs do
  not depend on the cut)."""
  shards = layers.batch_shards()
  for parts in range(1, tokens + 1):
    if tokens % parts == 0 and groups * parts % shards == 0:
      return parts
  raise ValueError(f"dispatch='ragged': {groups} groups of {tokens} tokens cannot be split "
                   f'evenly over the {shards} devices the batch is split over; make batch * '
                   f'length a multiple of {shards}.')


def unsort_and_combine(rows: Array, inverse: Array, order: Array, weights: Array,
                       routed: Array) -> Array:
  """The experts' outputs back on their tokens, summed with the combine weights.

  rows `[G*S*K, d]` in `sort_by_expert`'s order (with its `order` and `inverse`); weights and
  routed `[G, S, K]` -> `[G, S, d]`. A copy not routed adds nothing (its row is past the
  groups, which the TPU kernels may leave unset).
  """

  def local(rows, inverse, order, weights, routed):
    g, s, k = weights.shape
    copies = permute(rows, inverse, order).reshape(g, s, k, -1)
    copies = jnp.where(routed[..., None], copies, 0)
    return (jnp.einsum('gskd,gsk->gsd', copies, weights.astype(copies.dtype)),)

  combine = layers.per_batch_shard(local, (True,) * 5, (True,))
  return combine(rows, inverse, order, weights, routed)[0]
