"""Resuming a run from its own checkpoints: check the model first, skip damaged steps.

`restore` is what the trainer does when MODEL_DIR already holds checkpoints. From the latest
step back, each step is checked in this order:

1. It must be whole: every item it was saved with (orbax lists them in the step's
   `_CHECKPOINT_METADATA`) and every item a step of this trainer always has (parameters,
   optimizer state, the data position when the run's data has one) is there, their metadata
   reads, and every data file the OCDBT index points into exists and holds the bytes it
   points to (the damage an interrupted copy leaves); the data position (JSON) reads and
   matches its digest. Reads the index only, no array data.
2. Its parameter metadata (names and shapes) is compared with the model's abstract
   parameters. A different model (another d_model, other layers) stops the run with one
   message naming the first differing parameter and both shapes: resuming needs the gin
   config the run was started with (MODEL_DIR/config.gin), or a new MODEL_DIR.
3. Its stored optimizer state is compared (leaf paths and shapes, no data) with the state
   the run's optimizer makes. A changed optimizer (T5X Adafactor -> AdamW, momentum switched
   on) stops the run before anything is changed, naming the first differing slot, unless
   `on_optimizer_mismatch='fresh'`: then parameters, step and data position are restored and
   the optimizer state starts fresh at that step (said loudly; a state that fits is always
   restored).
4. It is restored, and every shard each process restored is compared with the CRC-32 the
   save recorded (`checkpoints/digests.py`; of a step saved before digests were recorded,
   only that no parameter holds NaN or infinite values, which a run never saves).

A step that fails 1 or 4 (or whose restore fails and reading it leaf by leaf names the
parameter and the file) is damaged: its directory is moved to
MODEL_DIR/corrupt_checkpoints/<step>-<time> (kept for inspection, out of the manager's way)
and the previous step is tried, with a loud message. A restore that fails on intact files is
not damage: the run stops, the step stays where it is. With no readable step left the run
stops with the reasons; a MODEL_DIR whose checkpoints were all set aside is never started over
silently.
"""

import logging
import os
import time
from typing import Any, List, Optional, Sequence

import jax
import numpy as np

from etils import epath

from upcycle.checkpoints import (CheckpointError, digests, ocdbt_files, orbax_tree, paths,
                                 validate, verify)
from upcycle.optimizer_state import stored
from upcycle.checkpoints.orbax import (DATASET, OPTIMIZER, PARAMS, RUN_CHECKPOINTS as
                                      CHECKPOINT_DIR, CheckpointManager, TrainingCheckpoint,
                                      missing_items)

log = logging.getLogger(__name__)

CORRUPT_DIR = 'corrupt_checkpoints'


def check_model(step_dir: str, abstract_params: Any, model_dir: str) -> None:
  """Raises CheckpointError unless the checkpoint at `step_dir` has the model's parameters."""
  params_dir = os.path.join(step_dir, PARAMS)
  validate.check_params(
      orbax_tree.read(params_dir), abstract_params,
      f'Cannot resume from {params_dir} (found) with the model this config builds (expected)',
      fix=f'Resume with the gin config this run was started with ({model_dir}/config.gin), or '
      f'train this model in a new MODEL_DIR')


def optimizer_mismatch(step_dir: str, abstract_opt_state: Any) -> Optional[str]:
  """Why the step's stored optimizer state is not the one the run's optimizer makes (the
  first differing leaf: path, stored vs expected shape or structure); None if it fits."""
  opt_dir = os.path.join(step_dir, OPTIMIZER)
  if abstract_opt_state is None or not paths.isdir(opt_dir):
    return None
  try:
    stored.restructure(orbax_tree.read(opt_dir), abstract_opt_state, opt_dir)
  except ValueError as e:
    return str(e).split(' Fix:')[0]
  return None


def damage(step_dir: str) -> Optional[str]:
  """Which parameter and file of the step at `step_dir` cannot be read, reading every array;
  None if all can."""
  try:
    for item in (PARAMS, OPTIMIZER):
      if paths.isdir(os.path.join(step_dir, item)):
        verify.verify_tree(orbax_tree.read(os.path.join(step_dir, item)))
  except CheckpointError as e:
    return str(e)
  return None


def missing_data(step_dir: str) -> Optional[str]:
  """Why the local step at `step_dir` cannot be restored, if its OCDBT index points to data
  files that are missing or too short; None if they are whole (or the step is remote).

  Reads the index only. Finding this before orbax's restore matters: a restore that fails
  midway leaves its other reads running and prints their errors as the process goes on.
  """
  for item in (PARAMS, OPTIMIZER):
    item_dir = os.path.join(step_dir, item)
    if paths.is_url(item_dir) or not os.path.isfile(os.path.join(item_dir, 'manifest.ocdbt')):
      continue
    try:
      broken = ocdbt_files.incomplete_arrays(item_dir)
    except ValueError as e:
      return f'{item_dir}: the OCDBT index is unreadable ({str(e).split(" [")[0]})'
    if broken:
      return (f"{item_dir}: parameter '{broken[0].replace('.', '/')}'"
              f"{f' (and {len(broken) - 1} more)' if len(broken) > 1 else ''}: "
              f'{ocdbt_files.damage(item_dir, broken[0])}. The checkpoint copy is incomplete '
              f'or corrupt; copy {item_dir} again from the source')
  return None


def incomplete(step_dir: str, required: Sequence[str]) -> Optional[str]:
  """Why the step at `step_dir` is not whole without reading array data: an item it was saved
  with or one of `required` is gone, a data file is missing or short, an item's OCDBT index
  or metadata is unreadable, or its data position is unreadable or differs from its digest;
  None if none of these."""
  missing = missing_items(step_dir, required)
  if missing:
    return (f'{step_dir}: no {" or ".join(f"{item}/" for item in missing)} (every step the '
            f'trainer saves has {"it" if len(missing) == 1 else "them"}). The checkpoint copy is '
            f'incomplete; copy the step again from its source')
  reason = missing_data(step_dir)   # first: a damaged index fails here in one read
  if reason is not None:
    return reason
  for item in (PARAMS, OPTIMIZER):
    item_dir = os.path.join(step_dir, item)
    if paths.isdir(item_dir):
      try:
        orbax_tree.read(item_dir)
      except CheckpointError as e:
        cause = str(e.__cause__ or e).splitlines()[0].split(' [')[0]
        return f'{item_dir}: its metadata is unreadable ({cause})'
  try:
    return verify.dataset_damage(step_dir, digests.read(step_dir))
  except CheckpointError as e:
    return str(e)


def non_finite(step_dir: str, params: Any) -> Optional[str]:
  """The first parameter restored from `step_dir` whose shards on this process (first
  replicas) hold NaN or infinite values, which a run never saves (it stops first); None if
  all are finite."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
      continue
    shards = (shard.data for shard in leaf.addressable_shards if shard.replica_id == 0)
    if not all(np.isfinite(np.asarray(data)).all() for data in shards):
      name = '/'.join(str(getattr(k, 'key', k)) for k in path)
      return (f"{step_dir}/{PARAMS}: parameter '{name}' holds NaN or infinite values, which a "
              f'run never saves (it stops first); the data changed on disk')
  return None


def changed_bytes(step_dir: str, restored: TrainingCheckpoint) -> Optional[str]:
  """Why the arrays restored from `step_dir` are not the ones saved (the first shard this
  process holds whose CRC-32 differs from the digest of the save); None if they match. A step
  without digests (saved before they were recorded, said in the log) is checked for
  parameters holding NaN or infinite values instead (`non_finite`)."""
  try:
    recorded = digests.read(step_dir)
  except CheckpointError as e:
    return str(e)
  if recorded is None:
    log.info('%s has no digests (saved before they were recorded): its array data was only '
             'checked for non-finite values.', step_dir)
    return non_finite(step_dir, restored.params)
  for item, tree in ((PARAMS, restored.params), (OPTIMIZER, restored.optimizer_state)):
    if tree is not None:
      reason = digests.check_tree(recorded.get(item, {}), tree, os.path.join(step_dir, item))
      if reason:
        return reason
  return None


def _agreed(reason: Optional[str]) -> Optional[str]:
  """`reason`, or that another process found damage: each process checks the shards it
  holds, and all must set the step aside together."""
  if jax.process_count() == 1:
    return reason
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  found = np.asarray(multihost_utils.process_allgather(np.int32(reason is not None)))
  if reason is None and found.any():
    return (f'process {int(np.argmax(found))} found a shard whose bytes differ from their '
            f'digest (its log names it)')
  return reason


def _set_aside(manager: CheckpointManager, step: int, model_dir: str) -> str:
  """Moves the step's directory to MODEL_DIR/corrupt_checkpoints/ (process 0); all reload."""
  target = os.path.join(model_dir, CORRUPT_DIR, f'{step}-{time.strftime("%Y%m%d-%H%M%S")}')
  if jax.process_index() == 0:
    epath.Path(target).parent.mkdir(parents=True, exist_ok=True)
    epath.Path(manager.directory, str(step)).rename(target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f'set aside corrupt checkpoint {step}')
  manager.reload()
  return target


def _loud(message: str) -> None:
  bar = '!' * 100
  log.warning('%s\nWARNING: %s\n%s', bar, message, bar)


def _set_aside_only(model_dir: str) -> None:
  """Refuses a MODEL_DIR whose checkpoints were all set aside: starting over would be silent."""
  corrupt = epath.Path(model_dir, CORRUPT_DIR)
  if corrupt.is_dir() and any(corrupt.iterdir()):
    raise CheckpointError(
        f'{model_dir} has no checkpoint in {CHECKPOINT_DIR}/ but earlier ones set aside in '
        f'{corrupt} (damaged when a restart found them). Not starting this run over from '
        f'scratch. Fix: move a step you trust back into {model_dir}/{CHECKPOINT_DIR}/, or delete '
        f'{corrupt} to start the run over.')


class Damaged(CheckpointError):
  """The step's files are damaged (the message says where): set it aside, try the previous."""


def _restore(manager: CheckpointManager, step: int, abstract: Any, model_dir: str,
             on_optimizer_mismatch: str) -> TrainingCheckpoint:
  """The whole step `step` restored (checks 2-4 of the module docstring); CheckpointError for
  damage found while restoring (`Damaged`) or a mismatch that stops the run."""
  step_dir = os.path.join(manager.directory, str(step))
  check_model(step_dir, abstract.params, model_dir)
  mismatch = optimizer_mismatch(step_dir, abstract.opt_state)
  if mismatch is not None and on_optimizer_mismatch != 'fresh':
    raise CheckpointError(
        f'Cannot resume the optimizer state of {step_dir} with this config\'s optimizer: '
        f'{mismatch.rstrip(".")}. The checkpoint is intact and was left as it is. Fix: resume '
        f'with the optimizer config this run was started with ({model_dir}/config.gin), or '
        f'keep its parameters, step and data position and start the optimizer state fresh: '
        f"--gin.trainer.TrainConfig.on_optimizer_mismatch='fresh'")
  try:
    restored = manager.restore(step, params=abstract.params, optimizer_state=abstract.opt_state,
                               skip=(OPTIMIZER,) if mismatch is not None else ())
  except Exception as e:  # pylint: disable=broad-except  (orbax raises many kinds)
    reason = damage(step_dir)
    if reason is None:
      lines = [line for line in str(e).splitlines() if line.strip()]
      raise CheckpointError(
          f'Restoring {step_dir} failed although its files are intact ({type(e).__name__}: '
          f'{lines[-1] if lines else ""}); it was left as it is. Fix: resume with the gin '
          f'config this run was started with ({model_dir}/config.gin).') from e
    raise Damaged(reason) from e
  reason = _agreed(changed_bytes(step_dir, restored))
  if reason is not None:
    raise Damaged(reason)
  return restored


def restore(manager: CheckpointManager, abstract: Any, model_dir: str,
            on_optimizer_mismatch: str = 'stop', *,
            with_dataset: bool = False) -> Optional[TrainingCheckpoint]:
  """The latest whole checkpoint of the run (None if there is none), restored onto the
  shardings of `abstract` (a TrainState of jax.ShapeDtypeStruct). With
  `on_optimizer_mismatch='fresh'`, a stored optimizer state the run's optimizer does not make
  comes back None (the caller starts it fresh); 'stop' raises. `with_dataset`: the run's data
  has a position, so a step without its `dataset/` is damaged."""
  steps = manager.all_steps()
  if not steps:
    _set_aside_only(model_dir)
    return None
  required = ((PARAMS,) + ((OPTIMIZER,) if abstract.opt_state is not None else ()) +
              ((DATASET,) if with_dataset else ()))
  reasons: List[str] = []
  for step in reversed(steps):
    reason = incomplete(os.path.join(manager.directory, str(step)), required)
    if reason is None:
      try:
        return _restore(manager, step, abstract, model_dir, on_optimizer_mismatch)
      except Damaged as e:
        reason = str(e)
    moved = _set_aside(manager, step, model_dir)
    reasons.append(f'step {step}: {reason.rstrip(".")}.')
    earlier = [s for s in steps if s < step]
    _loud(f'Checkpoint step {step} is corrupt and was moved to {moved}. {reason.rstrip(".")}.' +
          (f' Falling back to the previous checkpoint, step {earlier[-1]}.' if earlier else ''))
  raise CheckpointError(
      f'No checkpoint in {manager.directory} can be restored (the unreadable ones were moved '
      f'to {os.path.join(model_dir, CORRUPT_DIR)}). ' + ' '.join(reasons) + ' Restore the '
      f'files from a copy, or delete {model_dir} to start the run over.')
