"""This project's training checkpoints: an orbax CheckpointManager over four items.

  MODEL_DIR/<step>/params/            parameters (orbax PyTree, OCDBT)
  MODEL_DIR/<step>/optimizer_state/   optimizer state (optional)
  MODEL_DIR/<step>/dataset/           dataset-iterator state, JSON (optional)
  MODEL_DIR/<step>/_CHECKPOINT_METADATA

Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it when every item
is on disk, so a save killed midway leaves the previous steps intact and the
unfinished one invisible. Saves run in the background (`async_save`); only the
last `keep` steps stay. MODEL_DIR may be a local path or gs:// (orbax writes through
`etils.epath` and tensorstore's GCS driver).
"""

import os
import re
from typing import Any, List, NamedTuple, Optional, Sequence

import orbax.checkpoint as ocp

from upcycle.checkpoints import orbax_tree, paths
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import materialize

PARAMS, OPTIMIZER, DATASET = 'params', 'optimizer_state', 'dataset'
RUN_CHECKPOINTS = 'checkpoints'   # a training run's steps: MODEL_DIR/checkpoints/<step>/
_MARKER = '_CHECKPOINT_METADATA'
# On GCS (no atomic rename) orbax writes a step in place and marks it finished with this file.
_COMMITTED = 'commit_success.txt'


class TrainingCheckpoint(NamedTuple):
  step: int
  params: Any
  optimizer_state: Optional[Any]
  dataset_state: Optional[dict]


class CheckpointManager:
  """Saves and restores (params, optimizer state, step, dataset-iterator state).

  Restoring with targets (trees of jax.ShapeDtypeStruct whose `.sharding` says where
  each array goes) returns jax.Arrays placed by those shardings; without a target an
  item comes back as numpy arrays on the host.
  """

  def __init__(self, directory: str, *, keep: Optional[int] = 3, save_interval_steps: int = 1,
               async_save: bool = True):
    self.directory = paths.absolute(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_interval_steps, create=True,
        cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=(PARAMS, OPTIMIZER, DATASET))

  def save(self, step: int, params: Any, optimizer_state: Any = None,
           dataset_state: Optional[dict] = None, *, force: bool = False) -> bool:
    """Starts saving `step` (returns at once when async); False when the interval skips it."""
    items = {PARAMS: ocp.args.StandardSave(params)}
    if optimizer_state is not None:
      items[OPTIMIZER] = ocp.args.StandardSave(optimizer_state)
    if dataset_state is not None:
      items[DATASET] = ocp.args.JsonSave(dataset_state)
    return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

  def wait(self) -> None:
    """Blocks until the background save, if any, is committed."""
    self._manager.wait_until_finished()

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
    self._manager.close()

  def __enter__(self) -> 'CheckpointManager':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def is_step_dir(path: str) -> bool:
  if paths.is_url(path) and not paths.isfile(os.path.join(path, _COMMITTED)):
    return False
  return (paths.isfile(os.path.join(path, _MARKER))
          and orbax_tree.is_item_dir(os.path.join(path, PARAMS)))


def finished_steps(directory: str) -> dict:
  """step -> step directory, for committed steps (temporary directories are skipped)."""
  return {int(name): os.path.join(directory, name) for name in paths.listdir(directory)
          if re.fullmatch(r'\d+', name) and is_step_dir(os.path.join(directory, name))}


def load(path: str) -> Checkpoint:
  """A step directory or a MODEL_DIR (latest step) -> Checkpoint with lazy leaves."""
  path = paths.absolute(path)
  if not is_step_dir(path):
    steps = finished_steps(path)
    if not steps:
      raise checkpoint_error(path, 'no finished orbax checkpoint here',
                             expected=f'<step>/{_MARKER} and <step>/{PARAMS}/',
                             found=paths.listdir(path)[:10] if paths.isdir(path) else
                             'no such directory', fix='Pass MODEL_DIR or MODEL_DIR/<step>')
    path = steps[max(steps)]
  optimizer_dir = os.path.join(path, OPTIMIZER)
  return Checkpoint(
      params=orbax_tree.read(os.path.join(path, PARAMS)),
      step=int(os.path.basename(path)),
      optimizer_state=orbax_tree.read(optimizer_dir) if paths.isdir(optimizer_dir) else None,
      format='orbax', path=path)
