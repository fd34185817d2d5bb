"""Adafactor second moments of one parameter: layouts, rebuilding, refactoring.

optax (`scale_by_factored_rms`) and T5X (heuristic rule) store the second
moment of a parameter either in full (`v`, the param's shape) or factored
over its two largest axes: d0 the largest, d1 the second largest (from
`np.argsort(shape)`), with

  v_row = EMA of mean(g^2, axis=d0)     (shape without d0)
  v_col = EMA of mean(g^2, axis=d1)     (shape without d1)

and `[1]` placeholders in the unused slots. Both precondition the gradient
with the rank-one estimate v_row x v_col / mean(v_row, over d1), which is
what a factored slot pair is rebuilt into when layouts differ.

For experts `[E, *dense]` whose factored axes are the dense ones shifted by
one (the usual case: E smaller than d_model and d_ff), each expert's v_row,
v_col are exactly the dense ones, tiled. Otherwise (e.g. E is among the two
largest axes, or the dense moment was not factored) the dense estimate is
rebuilt, tiled and refactored for the expert shape.
"""

from typing import Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

Slots = Tuple[object, object, object]  # (v_row, v_col, v)


def factored_dims(shape: Sequence[int]) -> Tuple[int, int]:
  """(d1, d0): the second-largest and largest axes, as optax and T5X pick them."""
  order = np.argsort(shape)
  return int(order[-2]), int(order[-1])


def layout(slots: Slots, shape: Tuple[int, ...], where: str = ''):
  """'full', or (d1, d0) for a factored moment of a parameter of `shape`."""
  v_row, v_col, v = (tuple(np.shape(s)) for s in slots)
  if v == tuple(shape):
    return 'full'
  if len(shape) >= 2:
    d1, d0 = factored_dims(shape)
    if v_row == tuple(np.delete(shape, d0)) and v_col == tuple(np.delete(shape, d1)):
      return d1, d0
  raise ValueError(
      f'Adafactor slots of {where or "a parameter"} {tuple(shape)}: v_row {v_row}, v_col {v_col}, '
      f'v {v} fit neither a full second moment nor the heuristic factored layout (v_row without '
      f'the largest axis, v_col without the second largest).')


def full_moment(slots: Slots, shape: Tuple[int, ...], where: str = ''):
  """The second-moment estimate `[*shape]` the slots precondition with."""
  kind = layout(slots, shape, where)
  v_row, v_col, v = (jnp.asarray(s, jnp.float32) for s in slots)
  if kind == 'full':
    return v
  d1, d0 = kind
  reduced_d1 = d1 - 1 if d1 > d0 else d1
  row_mean = jnp.mean(v_row, axis=reduced_d1, keepdims=True)
  return (jnp.expand_dims(v_row / row_mean, d0) * jnp.expand_dims(v_col, d1))


def factor(full, fresh: Slots, shape: Tuple[int, ...], where: str = '') -> Slots:
  """`[*shape]` estimate -> slots in the layout of `fresh` (whose placeholders are kept)."""
  kind = layout(fresh, shape, where)
  v_row, v_col, v = fresh
  if kind == 'full':
    return v_row, v_col, full.astype(v.dtype)
  d1, d0 = kind
  return (jnp.mean(full, axis=d0).astype(v_row.dtype), jnp.mean(full, axis=d1).astype(v_col.dtype), v)


def upcycle_slots(source: Slots, fresh: Slots, shape: Tuple[int, ...], experts: Optional[int],
                  where: str = '') -> Slots:
  """Slots for a parameter of `shape` from the slots of its dense source.

  Args:
    source: (v_row, v_col, v) of the dense parameter.
    fresh: (v_row, v_col, v) as `optimizer.init` made them for `shape`.
    shape: the target parameter's shape.
    experts: E if the parameter is `[E, *dense]` experts, None for a copy.
    where: the parameter path, for errors.
  """
  dense_shape = tuple(shape[1:]) if experts else tuple(shape)
  src, dst = layout(source, dense_shape, where), layout(fresh, shape, where)

  def place(x, like):
    x = jnp.asarray(x, like.dtype)
    return jnp.broadcast_to(x[None], (experts,) + x.shape) if experts else x

  if src == 'full' and dst == 'full':
    return fresh[0], fresh[1], place(source[2], fresh[2])
  if src != 'full' and dst != 'full':
    shift = 1 if experts else 0
    if dst == (src[0] + shift, src[1] + shift):
      return place(source[0], fresh[0]), place(source[1], fresh[1]), fresh[2]
  full = full_moment(source, dense_shape, where)
  if experts:
    full = jnp.broadcast_to(full[None], (experts,) + full.shape)
  return factor(full, fresh, shape, where)
