"""A local directory that appears whole or not at all, written by one writer at a time.

It is written as `<final>.tmp-<time>-<pid>` and renamed to `final` when complete, so readers
never see a partial one. Writers of `final` hold `<final>.tmp.lock` (a `FileLock`) throughout,
so a second writer is refused, naming the first, rather than removing its directory. A write
that fails (a full disk) removes its temporary directory; one that was killed leaves it, and
the next writer of `final` removes it first (it holds the lock: nobody else is writing it) and
says so. T5X checkpoints (`t5x_writer`) and HuggingFace exports (`hf_writer`) are written so.
"""

import contextlib
import glob
import logging
import os
import shutil
import time
from typing import Iterator

from upcycle.locks import file_lock

log = logging.getLogger(__name__)


def is_taken(path: str) -> bool:
  """Whether `path` holds something a write would replace: anything but an empty directory."""
  return os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path))


@contextlib.contextmanager
def create(final: str, taken: str, elsewhere: str) -> Iterator[str]:
  """`with create(final, ...) as tmp:` the block fills the new directory `tmp`, which then
  becomes `final` (an empty directory there is replaced).

  Args:
    final: the local directory to write.
    taken: the FileExistsError's message when `final` exists and is not empty.
    elsewhere: where else to write, said when another write of `final` is running
      ('into another model directory').

  Raises:
    FileExistsError: `final` is taken, or another write of it is running (nothing written).
  """
  try:
    lock = file_lock.FileLock(f'{final}.tmp.lock', purpose=f'writing {final}').acquire()
  except file_lock.LockHeld as held:
    raise FileExistsError(f'Another write of {final} is running: {held} Fix: wait for it to '
                          f'finish, or write {elsewhere}.') from None
  with file_lock.writing(lock, f'{final}.tmp-{int(time.time())}-{os.getpid()}') as tmp:
    if is_taken(final):
      raise FileExistsError(taken)
    for killed in glob.glob(glob.escape(final) + '.tmp-*'):
      shutil.rmtree(killed)
      log.info('Removed %s, left by a write of %s that was killed.', killed,
               os.path.basename(final))
    os.makedirs(tmp)
    yield tmp
    os.rename(tmp, final)
