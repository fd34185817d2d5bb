"""T5X Adafactor's optimizer state: per-parameter slots `v_row`, `v_col`, `v`, `m` and a step.

The state of `upcycle.train.t5x_adafactor` and the layout T5X checkpoints store
(`{'step', 'param_states': {<param path>: {v_row, v_col, v, m}}}`, unused slots `[1]` zeros).
A parameter `[*shape]` factored over row axes R and column axes C (the other axes are
batch-like, e.g. the expert axis of `[E, d_model, d_ff]` kernels, or absent) keeps

  v_row = EMA of mean(g^2 + eps1, axis=C)    shape without C
  v_col = EMA of mean(g^2 + eps1, axis=R)    shape without R

and preconditions with v_row / mean(v_row, over R) x v_col, so every batch index (expert)
has its own rank-one estimate. Unfactored: `v = EMA of g^2 + eps1`, the param's shape.

Each `ParamSlots` carries its layout (R, C) as static data, so the state describes itself:
optimizer-state upcycling (`upcycle.upcycling.optimizer`) and checkpoint conversion
(`optimizer_state.from_t5x_adafactor`) tile, rebuild and refactor slots without knowing the
factor rules that made them.
"""

from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from upcycle.checkpoints import factored

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


def placeholder() -> jax.Array:
  """T5X's unused-slot value."""
  return jnp.zeros((1,), jnp.float32)


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


def _same_layout(source: ParamSlots, fresh: ParamSlots, shift: int) -> bool:
  if bool(source.rows) != bool(fresh.rows):
    return False
  return (tuple(d + shift for d in source.rows) == fresh.rows and
          tuple(d + shift for d in source.cols) == fresh.cols)


def upcycle(source: ParamSlots, fresh: ParamSlots, experts: Optional[int],
            where: str = '') -> ParamSlots:
  """Slots of a parameter from those of its dense source: tiled E times for `[E, *dense]`
  experts (`experts` = E), as they are for a copy (None).

  Where the expert layout is the dense one shifted past the expert axis (e.g. dense
  (rows, cols) = ((0,), (1,)) and experts (BATCH, ROW, COLUMN)), each expert gets exactly the
  dense slots. Otherwise (the dense moment unfactored, or factored along other axes) the
  dense estimate is rebuilt, tiled and refactored; the factors of an expert of an unfactored
  dense moment are then exact means of it.
  """
  def place(x, like):
    x = jnp.asarray(x, like.dtype)
    return jnp.broadcast_to(x[None], (experts,) + x.shape) if experts else x

  without = lambda x: np.shape(x) == (1,)
  m = fresh.m if without(source.m) or without(fresh.m) else place(source.m, fresh.m)
  if np.shape(m) != np.shape(fresh.m):
    raise ValueError(f'T5X Adafactor slots of {where}: the source momentum m '
                     f'{np.shape(source.m)} cannot fill {np.shape(fresh.m)}.')
  if _same_layout(source, fresh, 1 if experts else 0):
    if fresh.rows:
      return fresh.replace(v_row=place(source.v_row, fresh.v_row),
                           v_col=place(source.v_col, fresh.v_col), m=m)
    return fresh.replace(v=place(source.v, fresh.v), m=m)
  full = estimate(source)
  if experts:
    full = jnp.broadcast_to(full[None], (experts,) + full.shape)
  return refactor(full, fresh.replace(m=m))


def from_stored(stored: Mapping[str, Any], fresh: ParamSlots, shape: Sequence[int],
                where: str = '') -> ParamSlots:
  """A T5X-written slot dict `{v_row, v_col, v, m}` of a parameter -> slots like `fresh`.

  Slots whose shapes are `fresh`'s are taken as they are (T5X wrote them with the same
  factor rules); others are read in T5X's heuristic layout (`factored.layout`), rebuilt and
  refactored.
  """
  values = {k: stored.get(k, np.zeros((1,), np.float32)) for k in SLOTS}
  fits = all(tuple(np.shape(values[k])) == tuple(np.shape(getattr(fresh, k)))
             for k in ('v_row', 'v_col', 'v'))
  if fits:
    source = fresh.replace(**{k: values[k] for k in ('v_row', 'v_col', 'v')}, m=values['m'])
  else:
    kind = factored.layout((values['v_row'], values['v_col'], values['v']), tuple(shape), where)
    rows, cols = ((), ()) if kind == 'full' else ((kind[0],), (kind[1],))
    source = ParamSlots(values['v_row'], values['v_col'], values['v'], values['m'], rows, cols)
  return upcycle(source, fresh, None, where)
