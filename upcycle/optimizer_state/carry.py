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
