"""A checkpoint's stored optimizer state as the optax state of the run that reuses it.

Checkpoints keep the optimizer state in their own structure:
  t5x, t5x_orbax   T5X Adafactor `{'step', 'param_states': {<param path>: {v_row, v_col, v, m}}}`
  orbax (ours)     the optax state as orbax stores it: named tuples become dicts by field
                   name, tuples become lists, empty states None
`as_optax` turns either into the state `optimizer.init(params)` builds. It only
indexes and reshapes, so it traces under `jax.jit` with the stored leaves as
inputs (the restore hook converts on device). A T5X state is an input adapter: its slots
become the units (`units.py`) of the run's state, carried in by `Copy` (`carry.py`).
"""

from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle import leaf_ops, tree
from upcycle.optimizer_state import adafactor, carry, counts, units

_TRACES = ('.ema', '.trace')   # optax's momentum: T5X's m


def reusable(ckpt: Any, binding: str) -> Any:
  """The optimizer state of `ckpt` (a `checkpoints.Checkpoint`, lazy leaves), or an error
  naming `binding` to switch off."""
  if ckpt.optimizer_state is None or (ckpt.optimizer_layout == 't5x' and
                                      'param_states' not in ckpt.optimizer_state):
    raise ValueError(
        f'{ckpt.path} ({ckpt.format}) holds no optimizer state to reuse. Fix: set '
        f'{binding} = False (fresh optimizer state), or point it at a T5X or orbax training '
        f'checkpoint that has one.')
  if ckpt.optimizer_layout is None:
    raise ValueError(f'{ckpt.path}: optimizer state of format {ckpt.format!r} cannot be '
                     f'reused. Fix: set {binding} = False.')
  return ckpt.optimizer_state


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return node[key.name] if isinstance(node, Mapping) else getattr(node, key.name)
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  raise KeyError(key)


def restructure(state: Any, like: Any, where: str = '') -> Any:
  """An optax state as orbax stored it -> the structure of `like` (leaves are not copied)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  out = []
  for keypath, leaf in leaves:
    node = state
    try:
      for key in keypath:
        node = _child(node, key)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
      raise ValueError(
          f'The optimizer state stored in {where or "the checkpoint"} has no leaf '
          f'{jax.tree_util.keystr(keypath)} that the optimizer has. Fix: train with the '
          f'optimizer that wrote the checkpoint (same optax chain and options), or do not '
          f'reuse its state.') from e
    if tuple(np.shape(node)) != tuple(leaf.shape):
      raise ValueError(
          f'The optimizer state stored in {where or "the checkpoint"} has '
          f'{jax.tree_util.keystr(keypath)} of shape {tuple(np.shape(node))}; the optimizer '
          f'makes {tuple(leaf.shape)}. Fix: the same optimizer options (e.g. Adafactor '
          f'factored / min_dim_size_to_factor) as the run that wrote the checkpoint.')
    out.append(jnp.asarray(node, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def as_optax(state: Any, layout: str, params: Mapping[str, Any],
             optimizer: optax.GradientTransformation,
             where: str = '') -> Any:
  """The stored state of `params`' optimizer as `optimizer.init(params)`'s structure.

  Args:
    state: `reusable(ckpt, ...)`, with lazy, numpy or traced leaves.
    layout: the checkpoint's `optimizer_layout`: 't5x' (T5X's Adafactor slots) or 'optax'.
    params: the params the state belongs to (shapes suffice).
    optimizer: the optax optimizer, the same chain as the run that wrote it.
    where: the checkpoint path, for errors.
  """
  if layout == 't5x':
    return from_t5x_adafactor(state, params, optimizer)
  return restructure(state, jax.eval_shape(optimizer.init, params), where)


def _t5x_unit(key: units.Key, fresh: Any, slots: Mapping[str, Any], shape) -> Any:
  """The unit at `key` of the run's state, read from T5X's slots of its parameter."""
  names, path = key
  if path is None:
    return fresh   # counts: the step (`counts.set_counts`), hyperparameters: the optimizer's
  if isinstance(fresh, optax.MaskedNode):
    return fresh
  if adafactor.is_slots(fresh):
    values = {k: slots.get(k, adafactor.UNUSED) for k in adafactor.SLOTS}
    if all(tree.shape_of(values[k]) == tree.shape_of(getattr(fresh, k))
           for k in ('v_row', 'v_col', 'v')):   # written with the same factor rules
      return fresh.replace(**values)
    return adafactor.heuristic(**values, shape=shape, where=path)
  if names and names[-1] in _TRACES:
    m = slots.get('m')
    return fresh if m is None or tree.shape_of(m) != tuple(shape) else m
  raise ValueError(
      f'T5X Adafactor has no slot for the optax state leaf '
      f'{tree.render(names + tuple(path.split("/")))}: T5X keeps v_row, v_col, v and m '
      f'only. Fix: train with optimizers.T5XAdafactor (or optax.adafactor), or do not reuse '
      f'the T5X optimizer state.')


def from_t5x_adafactor(t5x_state: Mapping[str, Any], params: Mapping[str, Any],
                       optimizer: optax.GradientTransformation) -> Any:
  """A T5X Adafactor state as the optax state of `optimizer` for the same params.

  Each parameter's slots are taken as stored where their shapes are the optimizer's (T5X
  wrote them with the same factor rules: the run's own T5X Adafactor,
  `upcycle.train.t5x_adafactor`); otherwise they are read in T5X's heuristic layout, which is
  `optax.adafactor`'s (v_row without the largest axis, v_col without the second largest), and
  where the layouts still differ (other `min_dim_size_to_factor`, `factored`) the second
  moment is rebuilt as v_row x v_col / mean(v_row), the estimate both precondition with, and
  refactored (`adafactor.carry`). T5X's momentum `m` (an EMA of the scaled update) is
  optax.adafactor's `ema`; the step fills every `count` (`counts.set_counts`).

  Args:
    t5x_state: the T5X optimizer `state` dict, as the T5X checkpoint reader returns it.
    params: the params (or their shapes), in contract names.
    optimizer: T5X's Adafactor (`optimizers.T5XAdafactor`), or `optax.adafactor(...)`, with
      the T5X run's hyperparameters.

  Returns:
    `optimizer.init(params)`'s structure filled from T5X.
  """
  if 'param_states' not in t5x_state:
    raise ValueError(f'T5X Adafactor state has keys {sorted(t5x_state)}; expected '
                     f"'param_states' and 'step' (the checkpoint's optimizer/state).")
  slots_of: Dict[str, Dict[str, Any]] = {}
  for path, leaf in tree.flatten(t5x_state['param_states']).items():
    param, _, slot = path.rpartition('/')
    slots_of.setdefault(param, {})[slot] = leaf
  params = tree.zeros_for(params)
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  missing = sorted(set(shapes) - set(slots_of))
  if missing:
    raise ValueError(f'T5X Adafactor state has no param_states for {missing[0]} '
                     f'({len(missing)} params missing). Fix: pass the params of the same '
                     f'checkpoint.')
  fresh = optimizer.init(params)
  counted = counts.set_counts(fresh, jnp.asarray(t5x_state.get('step', 0)), schedule_only=False)
  source = {key: _t5x_unit(key, unit, slots_of.get(key[1], {}), shapes.get(key[1]))
            for key, unit in units.flatten(counted, shapes).items()}
  return carry.carry_state(source, fresh, ops={p: (p, leaf_ops.COPY) for p in shapes},
                           source_shapes=shapes, shapes=shapes, source_name='the T5X',
                           fix='read the T5X state with the optimizer that wrote it.')
