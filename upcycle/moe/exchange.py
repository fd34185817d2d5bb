"""Expert parallelism for the dropless dispatch: rows sent to the devices that hold their
experts, and the experts' outputs sent back.

On a mesh whose 'expert' axis has n > 1 devices (`MoeConfig` experts split over the mesh
axes the logical 'expert' axis maps to, which the batch is split over too), each device
holds E / n experts' kernels. After `upcycle.moe.ragged.sort_by_expert` each device's rows
are sorted by expert, so the rows for destination j (experts j E/n ... (j + 1) E/n - 1) are
one block. `to_experts` sends block j to device j into slot i (the sender's index) of a
`[n, R, d]` buffer (R: the sender's rows, the most that any one destination can get from it,
so nothing is dropped), after one `jax.lax.all_to_all` of the per-expert row counts, and sorts
what arrived by local expert (senders' padding last); the grouped matmuls then run each
device's own experts over its received rows (`upcycle.moe.experts.grouped_matmul` with
`[shards, E / n]` group sizes). `from_experts` undoes each step: the local unsort, the
exchange back, and the slots back onto the sorted rows.

On TPU the blocks travel alone, by `jax.lax.ragged_all_to_all` (as MaxText's sparse matmul
sends them); elsewhere (XLA:CPU does not implement it) each block is copied into its slot of a
`[n, R, d]` buffer (`_to_slots`) and the buffers are exchanged by `jax.lax.all_to_all`: n
times the rows a balanced routing sends. Both give the same buffer (`ragged_arguments` is
checked against `ragged_all_to_all`'s documented semantics). Copying rows into the slots and
back are each other's adjoints (`_to_slots`, `_from_slots`), so neither direction has a
scatter-add; the local sort is a permutation (`ragged.permute`).
"""

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from upcycle import layers
from upcycle.moe import ragged

Array = jax.Array


def expert_axes() -> Tuple[str, ...]:
  """The mesh axes (size > 1) the experts are split over, where the batch is split over them
  too; () outside a mesh, without expert partitions, or where the tokens are not split over
  the experts' axes (then every device multiplies its rows by all experts' kernels)."""
  experts = layers.mesh_axes('expert')
  return experts if experts and set(experts) <= set(layers.mesh_axes('batch')) else ()


class Exchange(NamedTuple):
  """What `from_experts` needs to send a device's outputs back, per device (leading axes
  split over the batch's shards like the rows): where each destination's block starts in
  the sorted rows, how many rows it has, how many rows each sender sent here (`[shards * n]`
  each), and the permutation that sorted the received rows by local expert with its inverse
  (`[shards * n * R]`)."""
  starts: Array
  counts: Array
  received_counts: Array
  order: Array
  inverse: Array


def _slot_index(starts: Array, counts: Array, rows: int) -> Tuple[Array, Array]:
  """For slot (j, r) of `[n, rows]`: the sorted row it holds (`starts[j] + r`) and whether it
  holds one (`r < counts[j]`), each `[n, rows]`."""
  offset = jnp.arange(rows)[None, :]
  return starts[:, None] + offset, offset < counts[:, None]


def _row_slot(starts: Array, counts: Array, rows: int) -> Tuple[Array, Array, Array]:
  """For each sorted row q `[rows]`: its destination j, its offset in slot j, and whether it
  goes anywhere (q below the rows of all destinations)."""
  q = jnp.arange(rows)
  destination = jnp.searchsorted(starts + counts, q, side='right', method='compare_all')
  sent = destination < counts.shape[0]
  destination = jnp.minimum(destination, counts.shape[0] - 1)
  return destination, q - starts[destination], sent


@jax.custom_vjp
def _to_slots(rows: Array, starts: Array, counts: Array) -> Array:
  """rows `[R, d]` -> slots `[n, R, d]`: slot j's first counts[j] rows are rows
  starts[j]..., the rest 0."""
  source, filled = _slot_index(starts, counts, rows.shape[0])
  taken = rows[jnp.minimum(source, rows.shape[0] - 1)]
  return jnp.where(filled[..., None], taken, 0).astype(rows.dtype)


@jax.custom_vjp
def _from_slots(slots: Array, starts: Array, counts: Array) -> Array:
  """slots `[n, R, d]` -> rows `[R, d]`: row q from its destination's slot, 0 for a row sent
  nowhere (padding). The adjoint of `_to_slots`."""
  destination, offset, sent = _row_slot(starts, counts, slots.shape[1])
  taken = slots[destination, jnp.clip(offset, 0, slots.shape[1] - 1)]
  return jnp.where(sent[:, None], taken, 0).astype(slots.dtype)


_to_slots.defvjp(lambda rows, starts, counts: (_to_slots(rows, starts, counts), (starts, counts)),
                 lambda res, grad: (_from_slots(grad, *res), None, None))
_from_slots.defvjp(
    lambda slots, starts, counts: (_from_slots(slots, starts, counts), (starts, counts)),
    lambda res, grad: (_to_slots(grad, *res), None, None))


def _local_sort(received_sizes: Array, rows: int) -> Tuple[Array, Array, Array]:
  """The order that sorts received rows `[n * rows]` (sender-major, each sender's rows sorted
  by local expert, `received_sizes[i]` `[E / n]` of each) by local expert, senders' padding
  last; its inverse and the group sizes `[E / n]`."""
  ends = jnp.cumsum(received_sizes, axis=1)                           # [n, E/n]
  offset = jnp.arange(rows)
  key = jax.vmap(lambda e: jnp.searchsorted(e, offset, side='right', method='compare_all'))(ends)
  order, inverse = ragged.sorting_permutation(key.reshape(-1))
  return order, inverse, jnp.sum(received_sizes, axis=0).astype(jnp.int32)


def _ragged_exchange(operand: Array, offsets: Array, sizes: Array, received_sizes: Array,
                     slot_rows: int, axes: Tuple[str, ...]) -> Array:
  """Block j of `operand` (`sizes[j]` rows from `offsets[j]`) to device j of `axes`, by
  `jax.lax.ragged_all_to_all` -> this device's `[n, slot_rows, d]`: slot i holds the
  `received_sizes[i]` rows from device i, the rest 0."""
  n, d = sizes.shape[0], operand.shape[-1]
  arguments = ragged_arguments(jax.lax.axis_index(axes), slot_rows, offsets, sizes,
                               received_sizes)
  empty = jnp.zeros((n * slot_rows, d), operand.dtype)
  return jax.lax.ragged_all_to_all(operand, empty, *arguments,
                                   axis_name=axes).reshape(n, slot_rows, d)


def _send(rows: Array, starts: Array, counts: Array, received_counts: Array,
          axes: Tuple[str, ...]) -> Array:
  """Block j of the sorted rows `[R, d]` (`counts[j]` rows from `starts[j]`) to device j of
  `axes` -> this device's `[n, R, d]` buffer: slot i holds the `received_counts[i]` rows from
  device i, the rest 0. An all-to-all of the slots off TPU; on TPU, of the blocks alone."""

  def dense(rows, starts, counts, received_counts):
    return jax.lax.all_to_all(_to_slots(rows, starts, counts), axes, 0, 0, tiled=False)

  def ragged(rows, starts, counts, received_counts):
    return _ragged_exchange(rows, starts, counts, received_counts, rows.shape[0], axes)

  return jax.lax.platform_dependent(rows, starts, counts, received_counts, tpu=ragged,
                                    default=dense)


def _send_back(slots: Array, received_counts: Array, counts: Array,
               axes: Tuple[str, ...]) -> Array:
  """Slot i of `[n, R, d]` (its first `received_counts[i]` rows) back to device i -> this
  device's `[n, R, d]`: slot j holds `counts[j]` rows from device j."""
  n, count, d = slots.shape

  def dense(slots, received_counts, counts):
    return jax.lax.all_to_all(slots, axes, 0, 0, tiled=False)

  def ragged(slots, received_counts, counts):
    starts = jnp.arange(n, dtype=jnp.int32) * count
    return _ragged_exchange(slots.reshape(n * count, d), starts, received_counts, counts,
                            count, axes)

  return jax.lax.platform_dependent(slots, received_counts, counts, tpu=ragged, default=dense)


def ragged_arguments(index: Array, slot_rows: int, offsets: Array, sizes: Array,
                     received_sizes: Array) -> Tuple[Array, Array, Array, Array]:
  """`jax.lax.ragged_all_to_all`'s (input_offsets, send_sizes, output_offsets, recv_sizes)
  that send block j (`sizes[j]` rows from `offsets[j]`) to device j, into slot `index` (this
  device's index on the axes) of its `[n * slot_rows]` output; `received_sizes[i]`: the rows
  device i sends here."""
  at = jnp.full(sizes.shape, index * slot_rows, jnp.int32)
  return (offsets.astype(jnp.int32), sizes.astype(jnp.int32), at,
          received_sizes.astype(jnp.int32))


def to_experts(rows: Array, group_sizes: Array) -> Tuple[Array, Array, Exchange]:
  """Each device's sorted rows to the devices of their experts.

  Args:
    rows: `[shards * R, d]` sorted by expert per batch shard (`ragged.sort_by_expert`).
    group_sizes: `[shards, E]` each shard's rows per expert.

  Returns:
    received rows `[shards * n * R, d]`, sorted by local expert per device; their group sizes
    `[shards, E / n]`; the `Exchange` that sends outputs back.
  """
  axes = expert_axes()
  n = layers.mesh_size(axes)

  def local(rows, group_sizes):
    count, d = rows.shape
    per_destination = group_sizes[0].reshape(n, -1)                   # [n, E/n]
    counts = jnp.sum(per_destination, axis=1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    received_sizes = jax.lax.all_to_all(per_destination, axes, 0, 0, tiled=False)
    received_counts = jnp.sum(received_sizes, axis=1).astype(jnp.int32)
    received = _send(rows, starts, counts, received_counts, axes)      # [n senders, R, d]
    order, inverse, sizes = _local_sort(received_sizes, count)
    sorted_rows = ragged.permute(received.reshape(n * count, d), order, inverse)
    return sorted_rows, sizes[None], starts, counts, received_counts, order, inverse

  out = layers.per_batch_shard(local, (True,) * 2, (True,) * 7)(rows, group_sizes)
  return out[0], out[1], Exchange(*out[2:])


def from_experts(out: Array, exchange: Exchange) -> Array:
  """The experts' outputs `[shards * n * R, d_out]` (in `to_experts`' received order) back
  on the sending devices' sorted rows: `[shards * R, d_out]`, rows sent nowhere 0."""
  axes = expert_axes()
  n = layers.mesh_size(axes)

  def local(out, starts, counts, received_counts, order, inverse):
    d = out.shape[-1]
    per_sender = ragged.permute(out, inverse, order).reshape(n, -1, d)
    returned = _send_back(per_sender, received_counts, counts, axes)  # [n destinations]
    return (_from_slots(returned, starts, counts),)

  return layers.per_batch_shard(local, (True,) * 6, (True,))(out, *exchange)[0]
