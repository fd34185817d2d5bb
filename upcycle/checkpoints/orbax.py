"""This project's training checkpoints: an orbax CheckpointManager over four items.

  MODEL_DIR/checkpoints/<step>/params/            parameters (orbax PyTree, OCDBT)
  MODEL_DIR/checkpoints/<step>/optimizer_state/   optimizer state (optional)
  MODEL_DIR/checkpoints/<step>/dataset/           dataset-iterator state, JSON (optional)
  MODEL_DIR/checkpoints/<step>/digests/           a CRC-32 per array shard, one JSON per process
  MODEL_DIR/checkpoints/<step>/_CHECKPOINT_METADATA   (lists the items the step was saved with)

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it when every item
is on disk, so a save killed midway leaves the previous steps intact and the
unfinished one invisible. Saves run in the background (`async_save`); only the
last `keep` steps stay. MODEL_DIR may be a local path or gs:// (orbax writes through
`etils.epath` and tensorstore's GCS driver).
"""

import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from upcycle.checkpoints import digests, orbax_tree, paths
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import FULL_DISK, CheckpointError, checkpoint_error
from upcycle.checkpoints.lazy import materialize

log = logging.getLogger(__name__)

MIB = 2 ** 20


class _QuietFullDisk(logging.Filter):
  """Drops orbax's per-thread error records of a write that found the disk full: the manager
  reports the failed save itself, in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += str(record.exc_info[1])
    return not any(marker in text for marker in FULL_DISK)


logging.getLogger('absl').addFilter(_QuietFullDisk())

PARAMS, OPTIMIZER, DATASET = 'params', 'optimizer_state', 'dataset'
DIGESTS = digests.DIGESTS
RUN_CHECKPOINTS = 'checkpoints'   # a training run's steps: MODEL_DIR/checkpoints/<step>/
_MARKER = '_CHECKPOINT_METADATA'
# On GCS (no atomic rename) orbax writes a step in place and marks it finished with this file.
_COMMITTED = 'commit_success.txt'


class TrainingCheckpoint(NamedTuple):
  step: int
  params: Any
  optimizer_state: Optional[Any]
  dataset_state: Optional[dict]


def _after_a_failed_save(error: BaseException) -> bool:
  """Whether `error` is the echo of a background save that already failed: tensorstore's
  callbacks scheduling onto orbax's event loop, which the failure closed. The failure itself
  is reported once, as a CheckpointError (`CheckpointManager._failed`)."""
  if not (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'):
    return False
  return any(frame.name == 'call_soon_threadsafe'
             for frame in traceback.extract_tb(error.__traceback__))


_ORPHANS = ('Task exception was never retrieved', 'Future exception was never retrieved')


class _OrbaxTaskEchoes(logging.Filter):
  """Drops asyncio's 'Task / Future exception was never retrieved' for orbax's serialization
  tasks and file writes of a failed save (reported once, as a CheckpointError): the task or
  future named in the message, or the exception's traceback, is orbax's."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if not message.startswith(_ORPHANS):
      return True
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return not ('orbax' in message or any('/orbax/' in f.filename for f in frames))


_SAVES_FAILED = []   # the failed saves' CheckpointErrors: after one, orbax's threads echo


def _orbax_thread_echo(exception: BaseException) -> bool:
  """Whether a thread's uncaught `exception` is orbax's, after a save failed: the failed
  save's other writers, still running when the run stops on the failure (the interpreter,
  shutting down, refuses their new work)."""
  frames = traceback.extract_tb(exception.__traceback__)
  return bool(_SAVES_FAILED) and any('/orbax/' in f.filename for f in frames)


class _OrbaxThreadLogEchoes(logging.Filter):
  """Drops orbax's own log of a writer thread's exception after a save failed (its
  `_SignalingThread` catches what its target raises and logs it with the traceback, instead
  of reaching `threading.excepthook`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return error is None or not _orbax_thread_echo(error)


def _quiet_failed_save_echoes() -> None:
  """Installs, once, the filters that keep a failed background save's echoes off the console:
  tensorstore reports its callbacks' errors (raised in its own threads) as unraisable,
  asyncio logs the orphaned tasks and futures when they are collected, and orbax's other
  writer threads fail as the interpreter shuts down (raised, or logged through absl by
  orbax's signalling threads)."""
  if getattr(sys.unraisablehook, 'upcycle_quiet', False):
    return
  original, original_thread = sys.unraisablehook, threading.excepthook

  def hook(unraisable):
    if not _after_a_failed_save(unraisable.exc_value):
      original(unraisable)

  def thread_hook(args):
    if args.exc_value is None or not _orbax_thread_echo(args.exc_value):
      original_thread(args)

  hook.upcycle_quiet = True
  sys.unraisablehook = hook
  threading.excepthook = thread_hook
  logging.getLogger('asyncio').addFilter(_OrbaxTaskEchoes())
  logging.getLogger('absl').addFilter(_OrbaxThreadLogEchoes())


class CheckpointManager:
  """Saves and restores (params, optimizer state, step, dataset-iterator state).

  Restoring with targets (trees of jax.ShapeDtypeStruct whose `.sharding` says where
  each array goes) returns jax.Arrays placed by those shardings; without a target an
  item comes back as numpy arrays on the host.
  """

  def __init__(self, directory: str, *, keep: Optional[int] = 3, save_interval_steps: int = 1,
               async_save: bool = True):
    self.directory = paths.absolute(directory)
    _quiet_failed_save_echoes()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_interval_steps, create=True,
        cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
    # Every process writes its own digest file (orbax's JSON items are process 0's).
    own_digests = ocp.JsonCheckpointHandler(
        filename=digests.filename(jax.process_index()),
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=(PARAMS, OPTIMIZER, DATASET, DIGESTS),
                                          item_handlers={DIGESTS: own_digests})
    self._pending = None   # the step saved, not yet said to be committed

  def save(self, step: int, params: Any, optimizer_state: Any = None,
           dataset_state: Optional[dict] = None, *, force: bool = False) -> bool:
    """Starts saving `step` (returns at once when async); False when the interval skips it.

    The CRC-32 of each array shard this process holds (and of the data position) is computed
    first, from the arrays as they are now (the caller may donate them once this returns),
    into the step's `digests/`.
    Raises CheckpointError (one line: the step, the directory, the space needed and free)
    before writing when a local disk has less free space than the last step took (or the
    state's bytes), and when this or an earlier background save failed.
    """
    self.wait()   # the previous save (orbax waits for it too): its failure is its own
    self._check_space(step, [params, optimizer_state])
    arrays = {PARAMS: params}
    if optimizer_state is not None:
      arrays[OPTIMIZER] = optimizer_state
    items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
    if dataset_state is not None:
      items[DATASET] = ocp.args.JsonSave(dataset_state)
    items[DIGESTS] = ocp.args.JsonSave(digests.record(arrays, dataset_state))
    self._saving = int(step)
    try:
      saved = self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # pylint: disable=broad-except  (orbax raises many kinds)
      raise self._failed(e) from e
    if saved:
      self._pending = int(step)
      self._say_saved()
    return saved

  def check(self) -> None:
    """Raises CheckpointError if a background save has failed (does not wait); says so when
    it has been committed."""
    try:
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from e
    self._say_saved()

  def wait(self) -> None:
    """Blocks until the background save, if any, is committed (CheckpointError if it failed)."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(e) from e
    self._say_saved()

  def _say_saved(self) -> None:
    """Once the last save is committed (seen by `check`, `wait` or `save`), process 0 logs
    one line: its step, its directory and the seconds the save took (`save_seconds`)."""
    if self._pending is None or self._manager.is_saving_in_progress():
      return
    step_dir = os.path.join(self.directory, str(self._pending))
    step, self._pending = self._pending, None
    if jax.process_index() == 0:
      seconds = save_seconds(step_dir)
      took = '' if seconds is None else f' in {seconds:.1f} s'
      log.info('Saved step %d to %s%s.', step, step_dir, took)

  def _check_space(self, step: int, state: Sequence[Any]) -> None:
    if paths.is_url(self.directory) or not os.path.isdir(self.directory):
      return
    latest = self.latest_step()
    if latest is not None:
      needed = _disk_bytes(os.path.join(self.directory, str(latest)))
      basis = f'the size of step {latest}'
    else:
      needed = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(state))
      basis = 'the bytes of the parameters and optimizer state'
    free = shutil.disk_usage(self.directory).free
    if free < needed:
      kept = (f'the last good checkpoint, step {latest}, is kept' if latest is not None else
              'no checkpoint has been written yet')
      raise CheckpointError(
          f'Not enough space to save step {step} in {self.directory}: it needs about '
          f'{needed / MIB:.1f} MiB ({basis}), {free / MIB:.1f} MiB are free; stopped before '
          f'writing, {kept}. Fix: free space there, or resume from a copy of MODEL_DIR on a '
          f'larger disk.')

  def _failed(self, error: BaseException) -> CheckpointError:
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[-1][:300] if lines else type(error).__name__
    if any(marker in text for marker in FULL_DISK):
      where = re.search(r'(?:local file|Failed writing:) "([^"]+)"', text)
      cause = 'no space left on device' + (f' writing {where.group(1)}' if where else '')
    latest = self.latest_step()
    kept = (f'the last good checkpoint, step {latest}, is kept as it is' if latest is not None
            else 'no checkpoint was written')
    failure = CheckpointError(
        f'Saving step {getattr(self, "_saving", "?")} to {self.directory} failed: '
        f'{cause}; {kept}. Fix: free space there (or the cause above) and restart: the '
        f'run resumes from its last checkpoint.')
    _SAVES_FAILED.append(failure)
    return failure

  def all_steps(self) -> List[int]:
    return sorted(self._manager.all_steps())

  def reload(self) -> None:
    """Re-reads the step list after the directory was changed from outside."""
    self._manager.reload()

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def restore(self, step: Optional[int] = None, *, params: Any = None,
              optimizer_state: Any = None, skip: Sequence[str] = ()) -> TrainingCheckpoint:
    """Restores `step` (default: the latest). `params`/`optimizer_state`: abstract targets;
    items named in `skip` (e.g. OPTIMIZER) are not read and come back None."""
    self.wait()
    step = self.latest_step() if step is None else int(step)
    if step is None or step not in self.all_steps():
      raise checkpoint_error(self.directory, f'no checkpoint for step {step}',
                             expected=f'one of {self.all_steps()}', found=step,
                             fix='Pass an existing step, or save one first')
    step_dir = os.path.join(self.directory, str(step))
    targets = {PARAMS: params, OPTIMIZER: optimizer_state}
    present = {name for name in (PARAMS, OPTIMIZER, DATASET)
               if name not in skip and paths.isdir(os.path.join(step_dir, name))}
    args = {name: ocp.args.StandardRestore(target) for name, target in targets.items()
            if target is not None and name in present}
    if DATASET in present:
      args[DATASET] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
    values = {}
    for name in (PARAMS, OPTIMIZER):
      if name in args:
        values[name] = restored[name]
      elif name in present:
        values[name] = materialize(orbax_tree.read(os.path.join(step_dir, name)))
      else:
        values[name] = None
    return TrainingCheckpoint(step, values[PARAMS], values[OPTIMIZER],
                              restored[DATASET] if DATASET in args else None)

  def close(self) -> None:
    """Waits for the pending save and for the thread that clears a killed run's unfinished
    tmp directories (orbax's close() does not wait for that one: a MODEL_DIR removed after a
    failed start would otherwise end the process with its traceback)."""
    self._manager._maybe_await_cleanup_tmp_directory()  # pylint: disable=protected-access
    self._manager.close()

  def __enter__(self) -> 'CheckpointManager':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _disk_bytes(directory: str) -> int:
  """Bytes of the files under a local directory."""
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(directory) for name in names)


def step_of(path: str) -> Optional[int]:
  """The step a step directory's name gives: '<step>', or '<step>-<suffix>' (a step that
  resume set aside in MODEL_DIR/corrupt_checkpoints/); None for any other name."""
  match = re.fullmatch(r'(\d+)(-.+)?', os.path.basename(path.rstrip('/')))
  return int(match.group(1)) if match else None


def is_step_dir(path: str) -> bool:
  """Whether `path` holds one finished step (whatever the directory is called)."""
  if paths.is_url(path) and not paths.isfile(os.path.join(path, _COMMITTED)):
    return False
  return (paths.isfile(os.path.join(path, _MARKER))
          and orbax_tree.is_item_dir(os.path.join(path, PARAMS)))


def saved_items(step_dir: str) -> List[str]:
  """The items the step was saved with, as orbax listed them in its `_CHECKPOINT_METADATA`
  ([] if that does not say)."""
  try:
    listed = json.loads(epath.Path(step_dir, _MARKER).read_text()).get('item_handlers')
  except (OSError, ValueError):
    return []
  return sorted(listed) if isinstance(listed, dict) else []


def save_seconds(step_dir: str) -> Optional[float]:
  """From the start of the step's save to its commit, as orbax timed them in its
  `_CHECKPOINT_METADATA` (None if that does not say)."""
  try:
    marker = json.loads(epath.Path(step_dir, _MARKER).read_text())
    return (marker['commit_timestamp_nsecs'] - marker['init_timestamp_nsecs']) / 1e9
  except (OSError, ValueError, KeyError, TypeError):
    return None


def missing_items(step_dir: str, required: Sequence[str] = ()) -> List[str]:
  """The items of the step that are gone: those it was saved with, and `required`."""
  expected = sorted(set(saved_items(step_dir)) | set(required))
  return [item for item in expected if not paths.isdir(os.path.join(step_dir, item))]


def finished_steps(directory: str) -> dict:
  """step -> step directory, for committed steps (temporary directories are skipped)."""
  return {int(name): os.path.join(directory, name) for name in paths.listdir(directory)
          if re.fullmatch(r'\d+', name) and is_step_dir(os.path.join(directory, name))}


def run_steps(path: str) -> dict:
  """step -> step directory of `path`: a directory of steps, or a training run's MODEL_DIR,
  whose steps the trainer writes to its checkpoints/ (`RUN_CHECKPOINTS`)."""
  return finished_steps(path) or finished_steps(os.path.join(path, RUN_CHECKPOINTS))


def dataset_state(step_dir: str) -> Optional[dict]:
  """The data-iterator positions a training step saved (`host_states.gather`'s form), or None
  when the step has no dataset item (a checkpoint not written by a training run)."""
  directory = os.path.join(step_dir, DATASET)
  if not paths.isdir(directory):
    return None
  return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(directory)


def load(path: str, with_optimizer_state: bool = True) -> Checkpoint:
  """A step directory, or a run's MODEL_DIR or its checkpoints/ (the latest step) ->
  Checkpoint with lazy leaves (the optimizer state None unless `with_optimizer_state` and
  saved)."""
  path = latest(path)
  optimizer_dir = os.path.join(path, OPTIMIZER)
  return Checkpoint(
      params=orbax_tree.read(os.path.join(path, PARAMS)),
      step=step_of(path),
      optimizer_state=(orbax_tree.read(optimizer_dir)
                       if with_optimizer_state and paths.isdir(optimizer_dir) else None),
      format='orbax', path=path)


def latest(path: str) -> str:
  """`path` if it is a step directory, else its latest finished step's directory (`run_steps`:
  of a directory of steps or a run's MODEL_DIR)."""
  path = paths.absolute(path)
  if is_step_dir(path):
    return path
  steps = run_steps(path)
  if not steps:
    raise checkpoint_error(path, 'no finished orbax checkpoint here',
                           expected=f'<step>/{_MARKER} and <step>/{PARAMS}/, here or in '
                           f'{RUN_CHECKPOINTS}/', found=paths.listdir(path)[:10]
                           if paths.isdir(path) else 'no such directory',
                           fix=f'Pass a run\'s MODEL_DIR, its {RUN_CHECKPOINTS}/ or one '
                           f'{RUN_CHECKPOINTS}/<step>/')
  return steps[max(steps)]


def read_live(path: str, read: Callable[[str], Any], attempts: int = 3) -> Any:
  """`read(step directory)` of `path`'s step (its latest, for a MODEL_DIR). A live run's
  retention may delete that step while it is read: then the newer latest step is read
  instead (`attempts` in all), said on the console with the step read in the end; an error of
  a step that stays is raised. A run whose every step read is deleted before the read ends
  (each lives shorter than a read takes) is a CheckpointError that says so.
  """
  for attempt in range(attempts):
    step_dir = latest(path)
    try:
      value = read(step_dir)
    except (CheckpointError, OSError, ValueError) as e:
      if step_dir == paths.absolute(path) or not vanishing(step_dir):
        raise
      if attempt == attempts - 1:
        raise checkpoint_error(
            path, f'retention deleted each of the {attempts} latest steps read, the last '
            f'{step_dir}, before its read ended: a running trainer keeps its last '
            'TrainConfig.keep_checkpoints steps, and each lived shorter than a read',
            fix='Read a copy of a step, or a run that saves less often or keeps more '
            'steps') from e
      log.warning('%s was deleted by retention while being read (a running trainer keeps its '
                  'last TrainConfig.keep_checkpoints steps); reading the latest step again.',
                  step_dir)
      continue
    if attempt:
      log.warning('Read step %d (%s), the latest step now.', step_of(step_dir), step_dir)
    return value
  raise AssertionError('unreachable')


def vanishing(path: str, settle_seconds: float = 1.0) -> bool:
  """Whether `path`, which existed when reading began, is gone or going: orbax's retention
  unlinks a step's files, then removes its directory. A local `path` that keeps all its files
  for `settle_seconds` is not being deleted (its data is damaged)."""
  before = _file_count(path)
  deadline = time.time() + settle_seconds
  while True:
    if not paths.exists(path):
      return True
    if time.time() > deadline:
      return False
    time.sleep(0.1)
    if _file_count(path) < before:
      return True


def _file_count(path: str) -> int:
  """Files under a local `path` (0 on gs://, where only a vanished step counts)."""
  if paths.is_url(path):
    return 0
  return sum(len(names) for _, _, names in os.walk(path))
