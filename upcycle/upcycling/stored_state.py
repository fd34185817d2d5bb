"""A checkpoint's stored optimizer state as an optax state, and the step counts in it.

Checkpoints keep the optimizer state in their own structure:
  t5x, t5x_orbax   T5X Adafactor `{'step', 'param_states': {<param path>: {v_row, v_col, v, m}}}`
  orbax (ours)     the optax state as orbax stores it: named tuples become dicts by field
                   name, tuples become lists, empty states None
`as_optax` turns either into the state `optimizer.init(params)` builds. It only
indexes and reshapes, so it traces under `jax.jit` with the stored leaves as
inputs (the restore hook converts on device).

Step counts: optax keeps one per stateful transformation. The learning rate
follows the count of `scale_by_schedule` (`ScaleByScheduleState`, also inside
`inject_hyperparams`); moment estimators keep their own for bias correction
(Adam) and decay (Adafactor), which belong with their moments.
"""

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.upcycling.optimizer import from_t5x_adafactor

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


def _is_counted(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, '_fields') and 'count' in x._fields


def set_counts(state: Any, step: Any, schedule_only: bool) -> Any:
  """`state` with step counts set to `step`: all of them, or those of LR schedules only."""

  def fix(x):
    if not _is_counted(x):
      return x
    if isinstance(x, optax.InjectHyperparamsState):
      return x._replace(count=jnp.full_like(x.count, step),
                        inner_state=set_counts(x.inner_state, step, schedule_only))
    if schedule_only and not isinstance(x, optax.ScaleByScheduleState):
      return x
    return x._replace(count=jnp.full_like(x.count, step))

  return jax.tree.map(fix, state, is_leaf=_is_counted)
