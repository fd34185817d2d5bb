"""A trained optimizer state through a growth plan: every slot taken like its parameter.

The new state is `optimizer.init(new params)` with every leaf filled by path from the
checkpoint's state (the same optimizer's, for the checkpoint's params):

  param-shaped slots of P (Adam mu / nu, momentum, T5X m, unfactored v)
      <- the slot of P's source, taken like P: a new expert gets its source's moments,
         a new layer its source layer's
  factored second moments of P (optax `FactoredState`, T5X `v_row` / `v_col`)
      <- the source's factors, taken along the expert axis, where both layouts factor the same
         axes and the expert axis is not one of them; otherwise the source's estimate
         (v_row x v_col / mean v_row) taken like P and refactored into the new layout, which
         is exact when the taken estimate is rank one there (e.g. a router [d, E] -> [d, E']
         factored over both axes)
  other leaves (step counts, injected hyperparameters)
      <- as they are: the step and the schedule continue
"""

from typing import Any, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np
import optax

from upcycle import tree
from upcycle.checkpoints import adafactor_state, factored, slots
from upcycle.upcycling.plan import Leaf, Plan

_V = ('v_row', 'v_col', 'v')


def _along(take: Leaf, x, axis: Optional[int]):
  """`x` taken at `take.index` along `axis` (None: as it is)."""
  return x if axis is None else jnp.take(jnp.asarray(x), jnp.asarray(take.index), axis=axis)


def _position(axis: Optional[int], dropped: Tuple[int, ...]) -> Optional[int]:
  """Where `axis` of a parameter lands in a factor that drops the axes `dropped`."""
  return None if axis is None else axis - sum(d < axis for d in dropped)


def _t5x_slots(take: Leaf, old, fresh, where: str):
  without = lambda x: np.shape(x) == (1,)
  m = fresh.m if without(old.m) or without(fresh.m) else _along(take, old.m, take.axis)
  if np.shape(m) != np.shape(fresh.m):
    raise ValueError(f'T5X Adafactor slots of {where}: the momentum m {np.shape(old.m)} of '
                     f'{take.source} cannot fill {np.shape(fresh.m)}.')
  m = jnp.asarray(m, fresh.m.dtype)
  factored_axes = old.rows + old.cols
  if (old.rows, old.cols) == (fresh.rows, fresh.cols) and take.axis not in factored_axes:
    if not fresh.rows:
      return fresh.replace(v=jnp.asarray(_along(take, old.v, take.axis), fresh.v.dtype), m=m)
    return fresh.replace(
        v_row=jnp.asarray(_along(take, old.v_row, _position(take.axis, old.cols)),
                          fresh.v_row.dtype),
        v_col=jnp.asarray(_along(take, old.v_col, _position(take.axis, old.rows)),
                          fresh.v_col.dtype), m=m)
  return adafactor_state.refactor(take.take(adafactor_state.estimate(old)), fresh.replace(m=m))


def _optax_slots(take: Leaf, old, fresh, where: str):
  src = factored.layout(old, take.source_shape, where)
  dst = factored.layout(fresh, take.shape, where)
  cast = lambda x, like: jnp.asarray(x, like.dtype)
  if src == dst == 'full':
    return fresh[0], fresh[1], cast(take.take(old[2]), fresh[2])
  if src == dst and take.axis not in src:
    d1, d0 = src
    return (cast(_along(take, old[0], _position(take.axis, (d0,))), fresh[0]),
            cast(_along(take, old[1], _position(take.axis, (d1,))), fresh[1]), fresh[2])
  full = take.take(factored.full_moment(old, take.source_shape, where))
  return factored.factor(full, fresh, take.shape, where)


class _Filler(slots.FromState):
  """Fills the new state's nodes from the checkpoint's state."""

  def __init__(self, state, takes: Mapping[str, Leaf]):
    super().__init__(state)
    self.takes = takes

  def missing(self, names, what):
    return (f'{what} needs the checkpoint\'s optimizer-state leaf {tree.render(names)}, which it '
            f'does not have. Fix: the checkpoint\'s optimizer must be this run\'s (the same '
            f'optax chain and options), or start with a fresh optimizer state.')

  def source(self, prefix, path: str, what: str):
    return self.lookup(prefix + tuple(self.takes[path].source.split('/')), what)

  def slot(self, prefix, path: str, fresh):
    take = self.takes[path]
    where = f'slot {tree.render(prefix + tuple(path.split("/")))} {tuple(fresh.shape)}'
    old = self.source(prefix, path, where)
    if tree.shape_of(old) != take.source_shape:
      raise ValueError(f'{where} is taken like its parameter from the slot of {take.source}, '
                       f'which is {tree.shape_of(old)}, not the parameter\'s '
                       f'{take.source_shape}.')
    return jnp.asarray(take.take(old), fresh.dtype)

  def t5x(self, prefix, path: str, fresh):
    where = f'T5X Adafactor slots of {path}'
    old = self.source(prefix, path, where)
    if not adafactor_state.is_slots(old):
      raise ValueError(f'{where} need T5X Adafactor slots of {self.takes[path].source}; the '
                       f'checkpoint\'s state has {type(old).__name__}. Fix: the same optimizer '
                       f'(T5XAdafactor) as the run that wrote the checkpoint.')
    return _t5x_slots(self.takes[path], old, fresh, path)

  def factored(self, names, fresh: optax.FactoredState):
    old = self.lookup(names, f'the Adafactor state {tree.render(names)}')
    old_slots = {k: tree.flatten(getattr(old, k)) for k in _V}
    fresh_slots = {k: tree.flatten(getattr(fresh, k)) for k in _V}
    out = {k: {} for k in _V}
    for path, take in self.takes.items():
      if any(take.source not in old_slots[k] for k in _V):
        raise ValueError(f'The Adafactor state {tree.render(names)} of the checkpoint has no '
                         f'second moments for {take.source}.')
      made = _optax_slots(take, tuple(old_slots[k][take.source] for k in _V),
                          tuple(fresh_slots[k][path] for k in _V), path)
      for k, value in zip(_V, made):
        out[k][path] = value
    return optax.FactoredState(count=jnp.asarray(old.count, fresh.count.dtype),
                               **{k: tree.unflatten(v) for k, v in out.items()})

  def other(self, names, fresh):
    old = self.lookup(names, f'leaf {tree.render(names)}')
    if tree.shape_of(old) != tree.shape_of(fresh):
      raise ValueError(f'Optimizer-state leaf {tree.render(names)} is {tree.shape_of(old)} in '
                       f'the checkpoint but {tree.shape_of(fresh)} for the new params.')
    return jnp.asarray(old, jnp.result_type(fresh))


def grown_optimizer_state(state: Any, plan: Plan, params: Mapping[str, Any],
                          optimizer: optax.GradientTransformation) -> Any:
  """The new params' optimizer state, every slot taken from `state` like its parameter.

  Args:
    state: the checkpoint's optax state, for the checkpoint's params (e.g.
      `checkpoints.optimizer_state.as_optax` of a stored one). Never modified.
    plan: the growth plan that made `params` (`expert_growth.plan`, `depth_growth.plan`).
    params: the new params or their abstract shapes; flax boxes are opened.
    optimizer: the run's optax optimizer, the one that made `state`.

  Returns:
    A state of the structure `optimizer.init(params)` returns, with the checkpoint's counts.
  """
  params = tree.zeros_for(params)
  fresh = optimizer.init(params)
  if plan.blocks:
    raise ValueError('grown_optimizer_state takes a growth plan (every leaf taken from one '
                     'checkpoint leaf); an upcycling plan\'s state is upcycle_optimizer_state\'s.')
  takes = {leaf.path: leaf for leaf in plan.copies}
  return slots.fill(fresh, takes, _Filler(state, takes))
