"""Adafactor second moments in one form, T5X's: per-parameter slots that carry their layout.

T5X's Adafactor (`upcycle.train.t5x_adafactor`) keeps, for a parameter `[*shape]` factored
over row axes R and column axes C (other axes are batch-like, e.g. the expert axis of
`[E, d_model, d_ff]` kernels),

  v_row = EMA of mean(g^2 + eps1, axis=C)    shape without C
  v_col = EMA of mean(g^2 + eps1, axis=R)    shape without R

and preconditions with the estimate v_row / mean(v_row, over R) x v_col; unfactored, it keeps
`v` (the parameter's shape). Unused slots are `[1]` placeholders, `m` is the momentum. optax's
`scale_by_factored_rms` is the same with R = (d1,), C = (d0,): d0 the largest axis, d1 the
second largest (`heuristic`). Both states are read into `ParamSlots` at the boundary
(`units.py`), so one function carries slots through a plan's op (`carry`): where the op only
moves the axes the layouts factor over, it applies to the factors; otherwise the estimate is
rebuilt, the op applied to it, and the result refactored into the target layout.

The state of `t5x_adafactor` is `T5XAdafactorState`, the layout T5X checkpoints store
(`{'step', 'param_states': {<param path>: {v_row, v_col, v, m}}}`).
"""

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from upcycle import leaf_ops

Axes = Tuple[int, ...]
SLOTS = ('v_row', 'v_col', 'v', 'm')


@flax.struct.dataclass
class ParamSlots:
  """One parameter's Adafactor slots; `rows` / `cols` empty when `v` is kept in full."""

  v_row: jax.Array
  v_col: jax.Array
  v: jax.Array
  m: jax.Array
  rows: Axes = flax.struct.field(pytree_node=False, default=())
  cols: Axes = flax.struct.field(pytree_node=False, default=())


class T5XAdafactorState(NamedTuple):
  """`count`: [] int32, the step the decay rate and the learning rate run on (T5X's `step`).
  `param_states`: the params' tree with a `ParamSlots` per parameter."""

  count: jax.Array
  param_states: Any


def is_slots(x: Any) -> bool:
  return isinstance(x, ParamSlots)


# T5X's unused-slot value, in numpy: a state is also described on the host for a TPU topology
# that has no devices here (`upcycle.aot`), where a device array cannot be made.
UNUSED = np.zeros((1,), np.float32)


def placeholder() -> jax.Array:
  """T5X's unused-slot value as an array of the state."""
  return jnp.asarray(UNUSED)


def unused(x: Any) -> bool:
  return np.shape(x) == (1,)


def init_slots(shape: Sequence[int], rows: Axes, cols: Axes,
               momentum_dtype: Optional[Any]) -> ParamSlots:
  """Zero slots for a parameter of `shape` in layout (rows, cols); `m` only with momentum."""
  shape = tuple(shape)
  m = placeholder() if momentum_dtype is None else jnp.zeros(shape, momentum_dtype)
  if rows:
    return ParamSlots(jnp.zeros(np.delete(shape, cols), jnp.float32),
                      jnp.zeros(np.delete(shape, rows), jnp.float32), placeholder(), m,
                      tuple(rows), tuple(cols))
  return ParamSlots(placeholder(), placeholder(), jnp.zeros(shape, jnp.float32), m)


def factored_dims(shape: Sequence[int]) -> Tuple[int, int]:
  """(d1, d0): the second-largest and largest axes, as optax and T5X's heuristic pick them."""
  order = np.argsort(shape)
  return int(order[-2]), int(order[-1])


def heuristic(v_row: Any, v_col: Any, v: Any, m: Any, shape: Tuple[int, ...],
              where: str = '') -> ParamSlots:
  """Slots stored in the heuristic layout (optax's, T5X's default) of a parameter of `shape`:
  `v` in full, or v_row without d0 and v_col without d1 (`factored_dims`)."""
  shape = tuple(shape)
  if tuple(np.shape(v)) == shape:
    return ParamSlots(v_row, v_col, v, m)
  if len(shape) >= 2:
    d1, d0 = factored_dims(shape)
    if (tuple(np.shape(v_row)) == tuple(np.delete(shape, d0)) and
        tuple(np.shape(v_col)) == tuple(np.delete(shape, d1))):
      return ParamSlots(v_row, v_col, v, m, (d1,), (d0,))
  raise ValueError(
      f'Adafactor slots of {where or "a parameter"} {shape}: v_row {tuple(np.shape(v_row))}, '
      f'v_col {tuple(np.shape(v_col))}, v {tuple(np.shape(v))} fit neither a full second '
      f'moment nor the heuristic factored layout (v_row without the largest axis, v_col '
      f'without the second largest).')


def factors(slots: ParamSlots) -> Tuple[jax.Array, jax.Array]:
  """Factored slots' (row, column) factors, each broadcastable to `[*shape]`; their product
  is the second-moment estimate: row = v_row / mean(v_row), column = v_col."""
  v_row, v_col = jnp.asarray(slots.v_row, jnp.float32), jnp.asarray(slots.v_col, jnp.float32)
  reduced = tuple(d - sum(c < d for c in slots.cols) for d in slots.rows)
  row = v_row / jnp.mean(v_row, axis=reduced, keepdims=True)
  return jnp.expand_dims(row, slots.cols), jnp.expand_dims(v_col, slots.rows)


def estimate(slots: ParamSlots) -> jax.Array:
  """The second-moment estimate `[*shape]` the slots precondition with."""
  if not slots.rows:
    return jnp.asarray(slots.v, jnp.float32)
  row, col = factors(slots)
  return row * col


def refactor(full: jax.Array, like: ParamSlots) -> ParamSlots:
  """A `[*shape]` estimate in the layout of `like` (its `m` is kept)."""
  if not like.rows:
    return like.replace(v=full.astype(like.v.dtype))
  return like.replace(v_row=jnp.mean(full, axis=like.cols).astype(like.v_row.dtype),
                      v_col=jnp.mean(full, axis=like.rows).astype(like.v_col.dtype))


def _kept(ndim: int, dropped: Axes) -> Axes:
  return tuple(a for a in range(ndim) if a not in dropped)


def carry(source: ParamSlots, fresh: ParamSlots, op: leaf_ops.Op, ndim: int,
          where: str = '') -> ParamSlots:
  """The slots of a parameter made by `op` from a source parameter of rank `ndim`, in the
  layout of `fresh` (the target's, as `optimizer.init` made them; its unused slots stay).

  The momentum goes through the op as the parameter does. The second moment: where the
  layouts agree once the op has moved the source's axes (a dense kernel's R, C shifted past
  a new expert axis; experts taken along an axis that is not factored), the op applies to
  v (unfactored) or to each factor; otherwise to the estimate, which is refactored. The
  factors of a tiled or taken unfactored moment are then exact means of it.
  """
  m = fresh.m
  if not unused(source.m) and not unused(fresh.m):
    m = jnp.asarray(op.apply(source.m), fresh.m.dtype)
  if np.shape(m) != np.shape(fresh.m):
    raise ValueError(f'Adafactor slots of {where}: the source momentum m '
                     f'{np.shape(source.m)} cannot fill {np.shape(fresh.m)}.')
  fresh = fresh.replace(m=m)
  moved = lambda axes: tuple(op.moves(a) for a in axes)
  if (bool(source.rows) == bool(fresh.rows) and moved(source.rows) == fresh.rows
      and moved(source.cols) == fresh.cols):
    cast = lambda x, like: jnp.asarray(x, like.dtype)
    if not fresh.rows:
      return fresh.replace(v=cast(op.apply(source.v), fresh.v))
    return fresh.replace(
        v_row=cast(op.on_factor(source.v_row, _kept(ndim, source.cols)), fresh.v_row),
        v_col=cast(op.on_factor(source.v_col, _kept(ndim, source.rows)), fresh.v_col))
  return refactor(op.apply(estimate(source)), fresh)
