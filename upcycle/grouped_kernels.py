"""Grouped matmuls: rows sorted by group (expert), each group's rows times its own kernel.

Every kernel here maps rows `[R, d_in]`, kernels `[E, d_in, d_out]` and group sizes `[E]`
(the first `sum(sizes)` rows, group after group) to `[R, d_out]`, rows past the groups 0, and
computes the same function; they differ in where they are fast (`MoeConfig.grouped_kernel`):

- 'ragged_dot': `jax.lax.ragged_dot`. Native on TPU, but XLA's TPU compiler counts its
  kernels' gradient over all groups; on CPU it lowers to a masked dense product over all
  groups, E times the work.
- 'blocked': the rows cut into blocks of `block_rows(R, E)` rows, each group padded to whole
  blocks, each block multiplied by its group's kernel in a `jax.lax.scan`: about R + E x block
  rows of work in both directions, on any platform, with no [blocks, d_in, d_out] gather.
- 'megablox': megablox's Pallas `gmm` on TPU (its backward is its own `gmm` and `tgmm`, each
  over the rows' groups only), 'blocked' elsewhere.
- 'megablox_interpret': megablox's kernels in Pallas' interpreter on any platform (slow; for
  tests).
"""

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.custom_vjp
def _gradient_where(x: Array, keep: Array) -> Array:
  """x, with its gradient zeroed where `keep` `[rows]` is False."""
  return x


def _gradient_where_fwd(x, keep):
  return x, keep


def _gradient_where_bwd(keep, grad):
  return jnp.where(keep[:, None], grad, 0).astype(grad.dtype), None


_gradient_where.defvjp(_gradient_where_fwd, _gradient_where_bwd)


def _megablox_gmm(rows: Array, kernel: Array, sizes: Array, interpret: bool) -> Array:
  """megablox's `gmm`; rows past the groups are masked (the kernel leaves them unwritten, and
  their gradients). `interpret`: Pallas' interpreter, on any platform."""
  from jax.experimental.pallas.ops.tpu.megablox import ops  # pylint: disable=g-import-not-at-top
  count, d_in = rows.shape
  # Tiles of 512 rows x 1024 x 1024 (the kernel's default: 128 x 128 x 128): each row tile
  # reads its experts' kernels once per output tile, so small tiles multiply the bytes read.
  tile = 512 if count >= 512 else -(-count // 8) * 8
  padded = -(-count // tile) * tile
  counted = jnp.arange(padded) < jnp.sum(sizes)
  rows = _gradient_where(jnp.pad(rows, ((0, padded - count), (0, 0))), counted)
  # Each product (the forward's, and the backward's with k and n swapped) tiles its own k
  # and n: a tile is the whole dimension up to 1024 (Mosaic takes a multiple of 128, or the
  # whole dimension), so d_model 64 against d_ff 256 tiles both ways.
  tiling = lambda m, k, n: (tile, min(1024, k), min(1024, n))
  out = ops.gmm(rows, kernel, sizes, rows.dtype, tiling, None, None, False, interpret)
  return jnp.where(counted[:, None], out, 0).astype(out.dtype)[:count]


def block_rows(rows: int, groups: int) -> int:
  """The blocked kernel's block: 128 rows, or fewer (a power of two, at least 8) where the
  groups average fewer rows, so that padding each group to whole blocks stays small."""
  block = 8
  while block < 128 and 2 * block <= rows // groups:
    block *= 2
  return block


def blocked(rows: Array, kernel: Array, sizes: Array) -> Array:
  """Each block of rows by one group's kernel, in a scan over the blocks.

  Group e's rows are padded to whole blocks of b = `block_rows(R, E)` rows: N = ceil((R +
  E (b - 1)) / b) blocks hold every group, each block's rows gathered from `rows` (zeros where
  padded), multiplied by its group's kernel `[d_in, d_out]` (read by `dynamic_slice` inside
  the scan: the backward accumulates each block's kernel gradient into its group's), and the
  blocks' rows gathered back to the rows' order."""
  count, d_in = rows.shape
  groups = sizes.shape[0]
  block = block_rows(count, groups)
  blocks = -(-(count + groups * (block - 1)) // block)
  padded_sizes = -(-sizes // block) * block
  padded_ends = jnp.cumsum(padded_sizes)
  padded_starts = padded_ends - padded_sizes
  ends = jnp.cumsum(sizes)
  starts = ends - sizes

  slots = jnp.arange(blocks * block)
  slot_group = jnp.searchsorted(padded_ends, slots, side='right', method='compare_all')
  slot_expert = jnp.minimum(slot_group, groups - 1)
  offset = slots - padded_starts[slot_expert]
  filled = (slot_group < groups) & (offset < sizes[slot_expert])
  source = jnp.where(filled, starts[slot_expert] + offset, count)      # row `count`: zeros
  with_zero = jnp.concatenate([rows, jnp.zeros((1, d_in), rows.dtype)])
  x = with_zero[source].reshape(blocks, block, d_in)
  block_group = slot_expert.reshape(blocks, block)[:, 0]

  # Rematerialized: the backward slices each block's kernel again instead of keeping
  # `[blocks, d_in, d_out]` of slices as residuals.
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_block(_, block_and_group):
    x_block, group = block_and_group
    return None, x_block @ kernel[group]

  _, y = jax.lax.scan(one_block, None, (x, block_group))
  y = y.reshape(blocks * block, -1)
  row = jnp.arange(count)
  row_group = jnp.searchsorted(ends, row, side='right', method='compare_all')
  counted = row_group < groups
  row_expert = jnp.minimum(row_group, groups - 1)
  slot = jnp.where(counted, padded_starts[row_expert] + row - starts[row_expert], 0)
  return jnp.where(counted[:, None], y[slot], 0).astype(y.dtype)


def _megablox_on_tpu(rows: Array, kernel: Array, sizes: Array) -> Array:
  """megablox's TPU kernel where the program is lowered for TPU, `blocked` elsewhere."""
  tpu = functools.partial(_megablox_gmm, interpret=False)
  return jax.lax.platform_dependent(rows, kernel, sizes, tpu=tpu, default=blocked)


# `MoeConfig.grouped_kernel`'s choices.
GROUPED_KERNELS = {'ragged_dot': jax.lax.ragged_dot, 'blocked': blocked,
                   'megablox': _megablox_on_tpu,
                   'megablox_interpret': functools.partial(_megablox_gmm, interpret=True)}
