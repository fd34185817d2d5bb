"""Optimizer-state slots and their parameters: one walk (`fill`), one map (`slot_map`), from
which every slot's sharding follows.

Every leaf of an optax state either belongs to a parameter, along some of its axes, or to none:

  full    the parameter's shape: Adam mu / nu, momentum (optax `ema`, T5X `m`), an unfactored
          Adafactor second moment `v`
  row     a factored second moment without the axes it averages over (optax `FactoredState` and
  column  T5X `ParamSlots` `v_row` / `v_col`: `checkpoints/factored.py`, `adafactor_state.py`)
  scalar  no parameter's axes: counts, injected hyperparameters, `[1]` placeholders of unused
          Adafactor slots

A leaf belongs to the parameter whose path its key path ends in (optax slot trees mirror the
param tree); Adafactor states are read per parameter, with their layouts. So a slot is sharded
like its parameter along the axes it keeps (T5X's derive_logical_axes, big_vision's one rule
set for params and optimizer state): an `[E, d_model, d_ff]` expert kernel over
('expert', None, 'model') has mu / nu / m over the same, T5X v_row `[E, d_model]` over
('expert', None) and v_col `[E, d_ff]` over ('expert', 'model').
"""

import abc
import dataclasses
from typing import Any, Mapping, Optional, Tuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import tree
from upcycle.checkpoints import adafactor_state, factored

_MOMENTS = ('v_row', 'v_col', 'v')


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


def is_unit(x: Any) -> bool:
  """A state node that describes its parameters as a unit: Adafactor moments, T5X slots."""
  return isinstance(x, optax.FactoredState) or adafactor_state.is_slots(x)


def _without(shape: Tuple[int, ...], dropped: Tuple[int, ...]) -> Tuple[int, ...]:
  """The axes of a parameter of `shape` but `dropped`."""
  return tuple(a for a in range(len(shape)) if a not in dropped)


def _full(path: str, shape: Tuple[int, ...]) -> Slot:
  return Slot(path, 'full', _without(shape, ()))


def _fitted(leaf: Any, shape: Tuple[int, ...], slot: Slot) -> Slot:
  """`slot` if `leaf` has the shape of its kept axes of `shape`, else a placeholder."""
  kept = tuple(shape[a] for a in slot.kept_axes)
  return slot if tree.shape_of(leaf) == kept else SCALAR


def _factored_state(state: optax.FactoredState, shapes: Mapping[str, Tuple[int, ...]]
                    ) -> optax.FactoredState:
  """optax Adafactor: v_row without d0 (the largest axis), v_col without d1 (the second
  largest), or v full (`factored.layout`)."""
  flat = {k: tree.leaves_by_path(getattr(state, k)) for k in _MOMENTS}
  by_param = {}
  for path, v in flat['v'].items():
    shape = shapes[path]
    kind = factored.layout((flat['v_row'][path], flat['v_col'][path], v), shape, path)
    if kind == 'full':
      by_param[path] = {'v_row': SCALAR, 'v_col': SCALAR, 'v': _full(path, shape)}
    else:
      d1, d0 = kind
      by_param[path] = {'v_row': Slot(path, 'row', _without(shape, (d0,))),
                        'v_col': Slot(path, 'column', _without(shape, (d1,))), 'v': SCALAR}

  def moments(k):
    return jax.tree_util.tree_map_with_path(lambda kp, _: by_param[tree.key_path(kp)][k],
                                            getattr(state, k))

  return optax.FactoredState(count=SCALAR, **{k: moments(k) for k in _MOMENTS})


def _t5x_slots(node: adafactor_state.ParamSlots, path: str, shape: Tuple[int, ...]
               ) -> adafactor_state.ParamSlots:
  """T5X Adafactor: v_row without the column axes, v_col without the row axes, or v full;
  m full with momentum."""
  full = _full(path, shape)
  if node.rows:
    v_row = _fitted(node.v_row, shape, Slot(path, 'row', _without(shape, node.cols)))
    v_col = _fitted(node.v_col, shape, Slot(path, 'column', _without(shape, node.rows)))
    v = SCALAR
  else:
    v_row, v_col, v = SCALAR, SCALAR, _fitted(node.v, shape, full)
  return node.replace(v_row=v_row, v_col=v_col, v=v, m=_fitted(node.m, shape, full))


class Filler(abc.ABC):
  """What `fill` makes of each kind of optimizer-state node.

  `names` are a node's key names (`tree.key_names`); `prefix` the names before the parameter
  path `path` that a slot's key path ends in.
  """

  @abc.abstractmethod
  def factored(self, names: Tuple[str, ...], node: optax.FactoredState) -> Any:
    """optax Adafactor's moments of every parameter, as one node."""

  @abc.abstractmethod
  def t5x(self, prefix: Tuple[str, ...], path: str, node: adafactor_state.ParamSlots) -> Any:
    """T5X Adafactor's slots of one parameter, as one node."""

  @abc.abstractmethod
  def slot(self, prefix: Tuple[str, ...], path: str, leaf: Any) -> Any:
    """A leaf under the parameter's path: Adam mu / nu, momentum, EMA, ..."""

  @abc.abstractmethod
  def other(self, names: Tuple[str, ...], leaf: Any) -> Any:
    """A leaf of no parameter: counts, injected hyperparameters."""


def fill(state: Any, param_paths: Any, filler: Filler) -> Any:
  """`state` with every node replaced by what `filler` makes of it: the one walk over an
  optimizer state, shared by the slot map, the T5X reader, upcycling and growth.

  A node is an Adafactor unit (`is_unit`), taken whole, or a leaf; a leaf belongs to the
  parameter its key path ends in (`tree.split_param_path`; the longest wins).

  Args:
    state: an optax state (arrays, abstract or not arrays at all).
    param_paths: the parameters' '/'-joined paths (a set or a dict keyed by them).
    filler: what to make of each node.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_unit)
  out = []
  for keypath, node in leaves:
    if isinstance(node, optax.FactoredState):
      out.append(filler.factored(tree.key_names(keypath), node))
      continue
    split = tree.split_param_path(keypath, param_paths)
    if adafactor_state.is_slots(node):
      out.append(filler.t5x(split[0], split[1], node))
    elif split is None:
      out.append(filler.other(tree.key_names(keypath), node))
    else:
      out.append(filler.slot(split[0], split[1], node))
  return jax.tree_util.tree_unflatten(treedef, out)


class FromState(Filler):
  """A filler that reads another optimizer state's nodes by key names (upcycling, growth)."""

  def __init__(self, state: Any):
    leaves, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_unit)
    self.stored = {tree.key_names(keypath): node for keypath, node in leaves}

  @abc.abstractmethod
  def missing(self, names: Tuple[str, ...], what: str) -> str:
    """The one-line error for a node `what` needs that the stored state lacks."""

  def lookup(self, names: Tuple[str, ...], what: str) -> Any:
    """The stored node at `names`, which `what` (e.g. 'slot mu/encoder/...') is made from."""
    if names not in self.stored:
      raise ValueError(self.missing(names, what))
    return self.stored[names]


class _Describe(Filler):
  """Each node as its `Slot`s."""

  def __init__(self, shapes: Mapping[str, Tuple[int, ...]]):
    self.shapes = shapes

  def factored(self, names, node):
    return _factored_state(node, self.shapes)

  def t5x(self, prefix, path, node):
    return _t5x_slots(node, path, self.shapes[path])

  def slot(self, prefix, path, leaf):
    return _fitted(leaf, self.shapes[path], _full(path, self.shapes[path]))

  def other(self, names, leaf):
    return SCALAR


def slot_map(opt_state: Any, params: Any) -> Any:
  """Each leaf of `opt_state` as a `Slot`: a tree of the structure of `opt_state`.

  Args:
    opt_state: an optax state of `params` (arrays or `jax.ShapeDtypeStruct`s, e.g.
      `jax.eval_shape(optimizer.init, params)`).
    params: the params (arrays or abstract; flax boxes are opened).
  """
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  return fill(opt_state, shapes, _Describe(shapes))


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
