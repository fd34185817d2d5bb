"""Every optimizer-state leaf's relation to its parameter (`slot_map`), from which its sharding
follows (`state_shardings`).

A leaf of an optax state (`units.py`) either belongs to a parameter, along some of its axes,
or to none:

  full    the parameter's shape: Adam mu / nu, momentum (optax `ema`, T5X `m`), an unfactored
          Adafactor second moment `v`
  row     a factored second moment without the axes it averages over (optax `FactoredState` and
  column  T5X `ParamSlots` `v_row` / `v_col`: `adafactor.py`)
  scalar  no parameter's axes: counts, injected hyperparameters, `[1]` placeholders of unused
          Adafactor slots

So a slot is sharded like its parameter along the axes it keeps (T5X's derive_logical_axes,
big_vision's one rule set for params and optimizer state): an `[E, d_model, d_ff]` expert
kernel over ('expert', None, 'model') has mu / nu / m over the same, T5X v_row `[E, d_model]`
over ('expert', None) and v_col `[E, d_ff]` over ('expert', 'model').

A state as a checkpoint stores it (`stored.py`) is read where the run's optimizer puts the
leaf of its key path and shape (`stored_shardings`); a stored leaf the optimizer has not (T5X
slots read into optax Adafactor, or in another layout) belongs to the parameter its key path
ends in (optax) or ends in before the slot's name (T5X `param_states/<param path>/m`), and is
placed like it when it has its shape, else replicated.
"""

import dataclasses
from typing import Any, Optional, Tuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import tree
from upcycle.optimizer_state import adafactor, units


@dataclasses.dataclass(frozen=True)
class Slot:
  """One optimizer-state leaf's relation to its parameter.

  Attributes:
    param: the parameter's '/'-joined path; None: the leaf belongs to no parameter.
    kind: 'full', 'row', 'column' or 'scalar' (module docstring); 'scalar' iff param is None.
    kept_axes: the parameter's axes the leaf keeps, in order (full: all; scalar: none).
  """

  param: Optional[str]
  kind: str
  kept_axes: Tuple[int, ...]


SCALAR = Slot(None, 'scalar', ())


def _slot(leaf: Any, path: str, kind: str, shape: Tuple[int, ...],
          dropped: Tuple[int, ...] = ()) -> Slot:
  """The slot of `path` keeping all axes but `dropped`, or SCALAR for a placeholder."""
  kept = tuple(a for a in range(len(shape)) if a not in dropped)
  fits = tree.shape_of(leaf) == tuple(shape[a] for a in kept)
  return Slot(path, kind, kept) if fits else SCALAR


def _describe(unit: Any, path: Optional[str], shape: Tuple[int, ...]) -> Any:
  if path is None or isinstance(unit, optax.MaskedNode):
    return SCALAR if path is None else unit
  if not adafactor.is_slots(unit):
    return _slot(unit, path, 'full', shape)
  slots = dict(m=_slot(unit.m, path, 'full', shape), v=_slot(unit.v, path, 'full', shape))
  if unit.rows:
    slots.update(v_row=_slot(unit.v_row, path, 'row', shape, unit.cols),
                 v_col=_slot(unit.v_col, path, 'column', shape, unit.rows), v=SCALAR)
  else:
    slots.update(v_row=SCALAR, v_col=SCALAR)
  return unit.replace(**slots)


def slot_map(opt_state: Any, params: Any) -> Any:
  """Each leaf of `opt_state` as a `Slot`: a tree of the structure of `opt_state`.

  Args:
    opt_state: an optax state of `params` (arrays or `jax.ShapeDtypeStruct`s, e.g.
      `jax.eval_shape(optimizer.init, params)`).
    params: the params (arrays or abstract; flax boxes are opened).
  """
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  described = {key: _describe(unit, key[1], shapes.get(key[1]))
               for key, unit in units.flatten(opt_state, shapes).items()}
  return units.unflatten(opt_state, described)


def _sharding(slot: Slot, param_sharding: Optional[NamedSharding],
              replicated: NamedSharding) -> NamedSharding:
  """The parameter's sharding along the slot's kept axes; `replicated` for a scalar."""
  if slot.param is None:
    return replicated
  if slot.kind == 'full':
    return param_sharding
  spec = tuple(param_sharding.spec)
  spec += (None,) * (max(slot.kept_axes, default=-1) + 1 - len(spec))
  return NamedSharding(param_sharding.mesh, PartitionSpec(*[spec[a] for a in slot.kept_axes]))


def stored_shardings(saved: Any, params: Any, param_shardings: Any,
                     optimizer: optax.GradientTransformation) -> Any:
  """Where each leaf of a stored optimizer state is read, a tree like `saved` (module
  docstring).

  Args:
    saved: the stored optimizer state (lazy or abstract leaves).
    params: the params it belongs to (abstract).
    param_shardings: a NamedSharding per parameter, a tree like `params`.
    optimizer: the run's optax transformation.
  """
  like = jax.eval_shape(optimizer.init, params)
  by_key = {tree.key_path(kp): (tree.shape_of(x), s) for (kp, x), s in zip(
      jax.tree_util.tree_leaves_with_path(like),
      jax.tree.leaves(state_shardings(like, params, param_shardings)))}
  flat = tree.flatten(param_shardings)
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  replicated = NamedSharding(next(iter(flat.values())).mesh, PartitionSpec())

  def where(keypath, leaf) -> NamedSharding:
    key, shape = tree.key_path(keypath), tree.shape_of(leaf)
    if key in by_key and by_key[key][0] == shape:
      return by_key[key][1]
    owner = (tree.split_param_path(keypath, shapes)
             or tree.split_param_path(keypath[:-1], shapes))
    return flat[owner[1]] if owner and shapes[owner[1]] == shape else replicated

  return jax.tree_util.tree_map_with_path(where, saved)


def state_shardings(opt_state: Any, params: Any, param_shardings: Any) -> Any:
  """A NamedSharding for every leaf of `opt_state`, derived from its parameter's.

  Args:
    opt_state: an optax state of `params` (arrays or abstract).
    params: the params (arrays or abstract).
    param_shardings: a NamedSharding per parameter, a tree like `params`.

  Returns:
    A tree of the structure of `opt_state`: each slot sharded like its parameter along the
    axes it keeps (a full slot exactly like it), everything else replicated.
  """
  flat = tree.flatten(param_shardings)
  mesh = next(iter(flat.values())).mesh
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda s: _sharding(s, flat.get(s.param), replicated),
                      slot_map(opt_state, params))
