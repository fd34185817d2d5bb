"""One trainer per MODEL_DIR: an exclusive lock on MODEL_DIR/run.lock for the whole run.

Two trainers writing one run directory interleave their metrics and break each other's
checkpoint saves (orbax renames and deletes step directories), losing the last checkpoint.
The lock is an OS file lock (`upcycle.locks.file_lock`): the kernel drops it when the trainer
exits or is killed, so a dead run never blocks a restart, and a refused trainer is told
which host and pid holds the directory and since when.

Multi-host: MODEL_DIR is one shared directory (a mount every host sees, or gs://), and the
hosts of one job are one trainer, so process 0 alone takes the lock and tells the others
whether it got it (a broadcast), so that every host of a refused job stops before any work.
Whether a second job on other machines is refused depends on the shared filesystem
enforcing flock across clients: NFS and Filestore do; FUSE mounts (gcsfuse) do not.

On gs:// the lock is an object created only if absent, with a heartbeat (`gcs_lock.py`):
GCS makes the creation atomic, and a killed run's lock is taken over by its restart on the
same host at once, or anywhere once its heartbeat is older than `gcs_lock.STALE_SECONDS`.
"""

import contextlib
import os
from typing import Iterator, Optional

import jax
import numpy as np

from upcycle.locks.file_lock import FileLock, LockHeld
from upcycle.locks.gcs_lock import GcsLock

LOCK_FILE = 'run.lock'


class RunDirectoryInUse(RuntimeError):
  """Another trainer holds MODEL_DIR."""


def _refusal(model_dir: str, held: LockHeld) -> RunDirectoryInUse:
  return RunDirectoryInUse(
      f'MODEL_DIR {model_dir} is in use by another trainer: {held} Two trainers on one '
      f'MODEL_DIR corrupt each other\'s checkpoints and metrics, so this one stops before any '
      f'work. Wait for that run to end (or stop it), or give this run another MODEL_DIR.')


def _all_hosts_agree(ok: bool) -> bool:
  """Process 0's `ok`, on every host."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


@contextlib.contextmanager
def hold(model_dir: str) -> Iterator[None]:
  """Holds MODEL_DIR for the duration of the block; raises RunDirectoryInUse if taken.

  A local MODEL_DIR the block created is removed again when the block fails leaving nothing
  in it but the lock (a failed start)."""
  path = os.path.join(model_dir, LOCK_FILE)
  local = not str(model_dir).startswith('gs://')
  lock = FileLock(path) if local else GcsLock(path)
  error = None
  created = None
  if jax.process_index() == 0:
    created = _first_missing(model_dir) if local else None
    try:
      lock.acquire()
    except LockHeld as e:
      error = _refusal(model_dir, e)
  if not _all_hosts_agree(error is None):
    raise error or RunDirectoryInUse(
        f'MODEL_DIR {model_dir} is in use by another trainer (process 0 says why in its log).')
  try:
    yield
  except BaseException:
    if created:
      _remove_if_only(created, os.path.abspath(path))
    raise
  finally:
    lock.release()


def _first_missing(model_dir: str) -> Optional[str]:
  """The outermost folder of MODEL_DIR's path that does not exist yet (None: it exists)."""
  missing = None
  path = os.path.abspath(model_dir)
  while not os.path.exists(path):
    missing, path = path, os.path.dirname(path)
  return missing


def _remove_if_only(created: str, lock_file: str) -> None:
  """Removes the folders this run created when a failed start left nothing in them but the
  lock file (and empty folders), so a failed start leaves no run directory behind."""
  found = [os.path.join(root, name) for root, _, names in os.walk(created) for name in names]
  if found != [lock_file]:
    return
  os.remove(lock_file)
  for root, _, _ in sorted(os.walk(created), key=lambda walked: -len(walked[0])):
    try:
      os.rmdir(root)
    except OSError:   # another process wrote there meanwhile: keep what it wrote
      return
