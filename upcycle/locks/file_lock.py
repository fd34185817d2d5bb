"""`FileLock`: an exclusive OS lock on a file that says who holds it (host, pid, since when).

The lock is `fcntl.flock` on an open file: the kernel releases it when the holder exits,
however it exits (SIGKILL included), so a lock is never left held by a dead process and
there is no stale-lock guessing. The file's content (one JSON line) only describes the
holder for error messages; it is rewritten by each new holder and may outlive it.

flock works on local filesystems and on NFS (Linux >= 2.6.12 emulates it with POSIX locks);
it is not enforced across hosts on FUSE mounts such as gcsfuse.
"""

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket
from typing import Dict, Iterator


class LockHeld(RuntimeError):
  """The lock is held by another process (described in the message)."""


def describe_holder(path: str) -> str:
  """'pid P on host H, since T' from the lock file at `path` (its last holder)."""
  try:
    with open(path) as f:
      holder = json.loads(f.read() or '{}')
  except (OSError, ValueError):
    holder = {}
  if not holder:
    return 'another process (it has not written its host and pid yet)'
  return (f"pid {holder.get('pid')} on host {holder.get('host')}, since "
          f"{holder.get('since')}")


class FileLock:
  """`with FileLock(path):` holds the lock; raises LockHeld at once if another process has it."""

  def __init__(self, path: str, purpose: str = ''):
    self.path = os.path.abspath(os.fspath(path))
    self.purpose = purpose
    self._file = None

  def acquire(self) -> 'FileLock':
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    f = open(self.path, 'a+')
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.close()
      raise LockHeld(f'{self.path} is locked by {describe_holder(self.path)}' +
                     (f' ({self.purpose})' if self.purpose else '') + '.') from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps(holder()) + '\n')
    f.flush()
    self._file = f
    return self

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  @property
  def held(self) -> bool:
    return self._file is not None

  def __enter__(self) -> 'FileLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def holder() -> Dict[str, object]:
  """This process, as a lock file records it."""
  return {'host': socket.gethostname(), 'pid': os.getpid(),
          'since': datetime.datetime.now().astimezone().isoformat(timespec='seconds')}


@contextlib.contextmanager
def writing(lock: FileLock, work_dir: str) -> Iterator[str]:
  """`with writing(lock, work_dir):` the block writes `work_dir` and moves it into place while
  holding `lock` (acquired, private to this output): `work_dir` is removed if the block fails,
  and the lock is released and its file removed however the block ends."""
  try:
    try:
      yield work_dir
    except BaseException:
      shutil.rmtree(work_dir, ignore_errors=True)
      raise
  finally:
    os.remove(lock.path)
    lock.release()
