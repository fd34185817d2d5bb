"""A checkpoint's stored optimizer state as the optax state of the run that reuses it.

Checkpoints keep the optimizer state in their own structure:
  t5x, t5x_orbax   T5X Adafactor `{'step', 'param_states': {<param path>: {v_row, v_col, v, m}}}`
  orbax (ours)     the optax state as orbax stores it: named tuples become dicts by field
                   name, tuples become lists, empty states None
`as_optax` turns either into the state `optimizer.init(params)` builds. It only
indexes and reshapes, so it traces under `jax.jit` with the stored leaves as
inputs (the restore hook converts on device).
"""

from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle import tree
from upcycle.checkpoints import adafactor_state, factored, slots
from upcycle.checkpoints.checkpoint import Checkpoint

T5X_FORMATS = ('t5x', 't5x_orbax')


def stored(ckpt: Checkpoint, binding: str) -> Any:
  """The checkpoint's optimizer state (lazy leaves), or an error naming `binding` to switch off."""
  if ckpt.optimizer_state is None or (ckpt.format in T5X_FORMATS and
                                      'param_states' not in ckpt.optimizer_state):
    raise ValueError(
        f'{ckpt.path} ({ckpt.format}) holds no optimizer state to reuse. Fix: set '
        f'{binding} = False (fresh optimizer state), or point it at a T5X or orbax training '
        f'checkpoint that has one.')
  if ckpt.format not in T5X_FORMATS + ('orbax',):
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


def as_optax(state: Any, format: str,  # pylint: disable=redefined-builtin
             params: Mapping[str, Any], optimizer: optax.GradientTransformation,
             where: str = '') -> Any:
  """The stored state of `params`' optimizer as `optimizer.init(params)`'s structure.

  Args:
    state: `stored(ckpt, ...)`, with lazy, numpy or traced leaves.
    format: the checkpoint format.
    params: the params the state belongs to (shapes suffice).
    optimizer: the optax optimizer, the same chain as the run that wrote it.
    where: the checkpoint path, for errors.
  """
  if format in T5X_FORMATS:
    return from_t5x_adafactor(state, params, optimizer)
  return restructure(state, jax.eval_shape(optimizer.init, params), where)


class _FromT5X(slots.Filler):
  """Each node of the optax state from T5X's slots of its parameter."""

  def __init__(self, stored: Mapping[str, Dict[str, Any]], params: Mapping[str, Any], step):
    self.stored, self.params, self.step = stored, params, step

  def t5x(self, prefix, path, node):
    return adafactor_state.from_stored(self.stored[path], node,
                                       tree.shape_of(self.params[path]), path)

  def factored(self, names, node):
    new = {'v_row': {}, 'v_col': {}, 'v': {}}
    fresh_slots = {k: tree.flatten(getattr(node, k)) for k in new}
    for path, x in self.params.items():
      source = tuple(self.stored[path].get(k, np.zeros((1,), np.float32)) for k in new)
      target = tuple(fresh_slots[k][path] for k in new)
      made = factored.upcycle_slots(source, target, tree.shape_of(x), None, where=path)
      for k, value in zip(new, made):
        new[k][path] = value
    return optax.FactoredState(count=jnp.asarray(self.step, node.count.dtype),
                               **{k: tree.unflatten(v) for k, v in new.items()})

  def other(self, names, leaf):
    return jnp.asarray(self.step, leaf.dtype) if names[-1] == '.count' else leaf

  def slot(self, prefix, path, leaf):
    if prefix and prefix[-1] in ('.ema', '.trace'):
      m = self.stored[path].get('m')
      shape = tree.shape_of(self.params[path])
      return leaf if m is None or tuple(np.shape(m)) != shape else jnp.asarray(m, leaf.dtype)
    raise ValueError(
        f'T5X Adafactor has no slot for the optax state leaf '
        f'{tree.render(prefix + tuple(path.split("/")))}: T5X keeps v_row, v_col, v and m '
        f'only. Fix: train with optimizers.T5XAdafactor (or optax.adafactor), or do not reuse '
        f'the T5X optimizer state.')


def from_t5x_adafactor(t5x_state: Mapping[str, Any], params: Mapping[str, Any],
                       optimizer: optax.GradientTransformation) -> Any:
  """A T5X Adafactor state as the optax state of `optimizer` for the same params.

  For the run's own T5X Adafactor (`upcycle.train.t5x_adafactor`, state
  `adafactor_state.T5XAdafactorState`) the layout is T5X's: each parameter's slots are taken
  as stored where their shapes are the optimizer's, else rebuilt from T5X's heuristic layout
  and refactored (`adafactor_state.from_stored`); the step is the count. For `optax.adafactor`:

  T5X stores `{'step': [], 'param_states': {<param path>: {'v_row', 'v_col',
  'v', 'm'}}}` with `[1]` placeholders in unused slots. Its default
  (heuristic) factoring is optax's: for a parameter whose two largest axes
  are d1 (second) and d0 (largest), v_row drops d0 and v_col drops d1, so the
  factors are taken as they are. Where the layouts differ (other
  `min_dim_size_to_factor`, `factored`), the second moment is rebuilt as
  v_row x v_col / mean(v_row), the estimate both implementations precondition
  with, and refactored (see `factored.py`). T5X's momentum `m` (an EMA of the
  scaled update) is optax.adafactor's `ema`; the step fills every `count`.

  Args:
    t5x_state: the T5X optimizer `state` dict, as the T5X checkpoint reader
      returns it.
    params: the dense params (or their shapes), in contract names.
    optimizer: T5X's Adafactor (`optimizers.T5XAdafactor`), or `optax.adafactor(...)`, with
      the T5X run's hyperparameters.

  Returns:
    `optimizer.init(params)`'s structure filled from T5X; upcycle it with
    `upcycle.upcycling.upcycle_optimizer_state`.
  """
  if 'param_states' not in t5x_state:
    raise ValueError(f'T5X Adafactor state has keys {sorted(t5x_state)}; expected '
                     f"'param_states' and 'step' (the checkpoint's optimizer/state).")
  step = t5x_state.get('step', 0)
  flat = tree.flatten(t5x_state['param_states'])
  slots_of: Dict[str, Dict[str, Any]] = {}
  for path, leaf in flat.items():
    param, _, slot = path.rpartition('/')
    slots_of.setdefault(param, {})[slot] = leaf
  params = tree.zeros_for(params)
  flat_params = tree.flatten(params)
  missing = sorted(set(flat_params) - set(slots_of))
  if missing:
    raise ValueError(f'T5X Adafactor state has no param_states for {missing[0]} '
                     f'({len(missing)} params missing). Fix: pass the params of the same checkpoint.')
  return slots.fill(optimizer.init(params), flat_params, _FromT5X(slots_of, flat_params, step))

