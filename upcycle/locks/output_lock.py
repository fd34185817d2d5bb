"""One writer per output file: `<output>.lock` beside it while it is written.

Two processes writing one output (two `python -m upcycle.infer` runs into one MODEL_DIR) would
replace each other's file, so the second one is refused at once, naming the holder. The lock is
a `FileLock` locally (released by the kernel however the holder exits) and a `GcsLock` on
gs:// (taken over once its holder is dead); its file or object is removed when the writer is
done, so a finished output has nothing beside it.
"""

import contextlib
import os
from typing import Iterator

from upcycle.locks.file_lock import FileLock, LockHeld
from upcycle.locks.gcs_lock import GcsLock


class OutputInUse(RuntimeError):
  """Another process is writing the output."""


@contextlib.contextmanager
def hold(output: str, writer: str, fix: str) -> Iterator[None]:
  """Holds `output`'s lock for the block; raises OutputInUse ('Another <writer> ... Fix:
  <fix>') at once if another process holds it."""
  local = not output.startswith('gs://')
  lock = FileLock(f'{output}.lock') if local else GcsLock(f'{output}.lock')
  try:
    lock.acquire()
  except LockHeld as held:
    raise OutputInUse(f'Another {writer} is writing {output}: {held} Fix: {fix}') from None
  try:
    yield
  finally:
    if local:
      os.remove(lock.path)
    lock.release()
