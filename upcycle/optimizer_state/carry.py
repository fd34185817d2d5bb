"""An optimizer state carried through a plan: every slot made like its parameter.

The new state is `optimizer.init(new params)` (`fresh`), each unit (`units.py`) filled from
the source state's unit of its parameter's source, by the parameter's op (`leaf_ops`):

  param-shaped slots (Adam mu / nu, momentum)   the op applied to the source's slot
  Adafactor slots (optax, T5X)                  `adafactor.carry`: the op on the factors, or
                                                on the estimate, refactored
  a parameter whose op is `Fresh` (routers)     fresh
  leaves of no parameter (counts, injected      the source's (the step and the schedule
  hyperparameters)                              continue), or fresh (`keep_counts=False`)

Upcycling (`Tile` experts, `Copy` the rest), growth (`Take` experts and layers) and reading a
T5X-written state (`Copy`, `stored.py`) are this one function with different ops.

`carry_optimizer_state` carries a trained state through a plan (`upcycling.Plan.ops`):

  upcycling   experts' slots are the dense MLP's, tiled along the expert axis (whatever the
              expert initializer: Drop and Noise experts get the dense moments too); routers'
              slots are fresh; shared experts and every other leaf copy the dense slots (a
              narrower shared expert's, those of its first d_ff units)
  growth      new experts and layers take their sources' slots, as the params are taken

Step counts and injected hyperparameters are the source's, so the schedule continues
(`keep_step=False`: fresh). Any chain of optax transformations is handled without knowing it,
inside `optax.masked` and `optax.multi_transform` too (a parameter a branch does not update
keeps its `optax.MaskedNode` slots). A T5X-written state is first read into the run's optax
state (`optimizer_state.from_t5x_adafactor`).
"""

from typing import Any, Mapping, Tuple

import jax.numpy as jnp
import numpy as np
import optax

from upcycle import leaf_ops, tree
from upcycle.optimizer_state import adafactor, units as units_lib

# {target param path: (source param path, op)}
Ops = Mapping[str, Tuple[str, leaf_ops.Op]]


def _carry_unit(source: Any, fresh: Any, op: leaf_ops.Op, source_shape: Tuple[int, ...],
                where: str) -> Any:
  if adafactor.is_slots(fresh):
    if not adafactor.is_slots(source):
      raise ValueError(f'{where} are Adafactor slots; the source state has '
                       f'{type(source).__name__} there.')
    return adafactor.carry(source, fresh, op, len(source_shape), where)
  if tree.shape_of(source) != tuple(source_shape):
    raise ValueError(f'{where} is made from a slot of shape {tree.shape_of(source)}, not its '
                     f'parameter\'s {tuple(source_shape)}.')
  return jnp.asarray(op.apply(source), fresh.dtype)


def carry_state(source: Mapping[units_lib.Key, Any], fresh: Any, *, ops: Ops,
                source_shapes: Mapping[str, Tuple[int, ...]],
                shapes: Mapping[str, Tuple[int, ...]], keep_counts: bool = True,
                moments: bool = True, source_name: str, fix: str) -> Any:
  """`fresh` with every unit made from `source`'s.

  Args:
    source: the source state's units (`units.flatten`).
    fresh: `optimizer.init` of the new params (arrays).
    ops: how every new parameter is made from a source parameter.
    source_shapes, shapes: {path: shape} of the source and new params.
    keep_counts: take the leaves of no parameter from the source; False keeps them fresh.
    moments: carry the parameters' slots; False keeps them fresh.
    source_name: what the source state is, for errors ('the dense').
    fix: what to do about an error, for its 'Fix:'.

  Returns:
    A state of `fresh`'s structure.

  Raises:
    ValueError: naming the slot, for a missing source unit or shapes the op cannot make.
  """
  def missing(name: str, where: str) -> ValueError:
    return ValueError(f'{where} needs {source_name} slot {name}, which {source_name} '
                      f'optimizer state does not have. Fix: {fix}')

  out = {}
  for key, unit in units_lib.flatten(fresh, shapes).items():
    names, path = key
    if path is None:
      if not keep_counts:
        out[key] = unit
      elif key not in source:
        raise missing(tree.render(names), f'Optimizer-state leaf {tree.render(names)}')
      else:
        out[key] = _count(source[key], unit, tree.render(names))
      continue
    source_path, op = ops[path]
    if not moments or isinstance(op, leaf_ops.Fresh) or isinstance(unit, optax.MaskedNode):
      out[key] = unit
      continue
    rendered = tree.render(names + tuple(path.split('/')))
    where = (f'The Adafactor state {tree.render(names)} of {path}' if adafactor.is_slots(unit)
             else f'Optimizer-state slot {rendered} {tree.shape_of(unit)}')
    source_shape = tuple(source_shapes[source_path])
    if op.shape(source_shape) != tuple(shapes[path]):
      raise ValueError(f'{where} cannot be made from {source_name} slot of {source_path} '
                       f'{source_shape} ({op.note() or "copied"} gives '
                       f'{op.shape(source_shape)}). Fix: {fix}')
    if (names, source_path) not in source:
      raise missing(tree.render(names + tuple(source_path.split('/'))), where)
    out[key] = _carry_unit(source[(names, source_path)], unit, op, source_shape, where)
  return units_lib.unflatten(fresh, out)


def _count(value: Any, fresh: Any, name: str) -> Any:
  if tuple(np.shape(value)) != tuple(np.shape(fresh)):
    raise ValueError(f'Optimizer-state leaf {name} is {tuple(np.shape(value))} '
                     f'in the source state but {tuple(np.shape(fresh))} in the new one.')
  return jnp.asarray(value, jnp.result_type(fresh))


_UPCYCLE_FIX = ('the dense state must come from the same optax optimizer (same chain and '
                'options) as the MoE one; expert initializers that change shapes (Granular) '
                'need tile_moments=False.')
_GROWTH_FIX = ('the checkpoint\'s optimizer must be this run\'s (the same optax chain and '
               'options), or start with a fresh optimizer state.')


def carry_optimizer_state(state: Any, plan: Any, params: Mapping[str, Any],
                          optimizer: optax.GradientTransformation, *,
                          tile_moments: bool = True, keep_step: bool = True) -> Any:
  """The new params' optimizer state, made from `state` by the plan that made the params.

  Args:
    state: the source params' optax state (e.g. `optimizer_state.as_optax` of a stored one),
      from the same optimizer. Never modified.
    plan: the `upcycling.Plan` that made `params` (`plan.make`, `expert_growth.plan`,
      `depth_growth.plan`): its `ops()`, `copies` and `blocks`.
    params: the new params or their abstract shapes; flax boxes are opened.
    optimizer: the run's optax optimizer.
    tile_moments: reuse the source's moments; False starts every moment fresh.
    keep_step: carry over step counts and other leaves of no parameter, so the schedule
      continues from the source's step; False resets them.

  Returns:
    A state of the structure `optimizer.init(params)` returns.
  """
  params = tree.zeros_for(params)
  ops = plan.ops()
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  source_shapes = {source: tuple(leaf.source_shape) for leaf in _leaves(plan)
                   if (source := leaf.source)}
  upcycling = bool(plan.blocks)
  return carry_state(
      units_lib.flatten(state, source_shapes), optimizer.init(params), ops=ops,
      source_shapes=source_shapes, shapes=shapes, keep_counts=keep_step,
      moments=tile_moments, source_name='the dense' if upcycling else 'the checkpoint\'s',
      fix=_UPCYCLE_FIX if upcycling else _GROWTH_FIX)


def _leaves(plan: Any):
  return plan.copies + tuple(leaf for block in plan.blocks for leaf in block.leaves)
