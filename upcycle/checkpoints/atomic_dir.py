"""A directory that appears whole or not at all, written by one writer at a time, local or on
gs://. T5X checkpoints (`t5x_writer`), HuggingFace exports (`hf_writer`) and conversions
(`upcycle.convert`) are written through `create`.

A writer of `final` picks a stem beside it (`<final>.tmp`, T5X's own convention, for T5X steps
and exports; `.NAME.converting` for a conversion's output), holds the lock `<stem>.lock` for
the whole write, so a second writer is refused at once, naming the first, and writes into the
work directory `<stem>-<time>-<pid>`. Holding the lock, it first deletes every
`<stem>-<time>-<pid>` it finds (only a holder writes one, so they are killed writers') and says
so; other names that begin with the stem are left alone (`.moe.converting-x.converting-1-2` is
the output `moe.converting-x`'s). An existing non-empty `final` is refused unless the writer
overwrites it (an empty directory is replaced). The work directory is made as `os.makedirs`
makes one, so the output has the mode a plain mkdir gives (0755 under umask 022).

Locally the lock is a `FileLock` (released by the kernel however its holder exits; its file
names the holder, so the next writer says whose leftovers it removed) and the complete work
directory is renamed to `final`: readers never see a partial one. An old output being
overwritten is moved aside into `<work>.old` first and deleted last. A write that fails (a full
disk) removes its work directory; one that was killed leaves it for the next writer. The lock
file is removed when the writer is done.

GCS has no rename and no OS locks, so on gs:// the lock is a `GcsLock` object (created only if
absent, with a heartbeat; a dead holder's is taken over, at once on its own host, elsewhere
after 5 minutes), and the complete work directory is copied object by object into `final` (an
old output deleted just before) with the files that mark a step complete last (orbax's
`<step>/commit_success.txt`, T5X's `checkpoint_<step>/checkpoint`; `gcs.copy_tree`), then
deleted. Readers (ours, orbax's, T5X's) see no step until its marker exists, so a killed writer
leaves nothing that looks valid; one killed while copying leaves a `final` without markers
(refused as non-empty: write it again, overwriting).
"""

import contextlib
import dataclasses
import glob
import logging
import os
import re
import shutil
import time
from typing import Iterator, List, Optional

from upcycle.checkpoints import gcs, paths
from upcycle.locks import file_lock
from upcycle.locks.gcs_lock import STALE_SECONDS, GcsLock

log = logging.getLogger(__name__)

_WORK = re.compile(r'\d+-\d+(\.old)?')   # what follows '<stem>-' in a writer's own names


@dataclasses.dataclass(frozen=True)
class Writer:
  """How the messages of one write name it.

  running: who would be writing `final`: 'another conversion into gs://b/moe' ('<running> is
    running: <the lock's holder> Fix: wait for it to finish, or <fix>.').
  killed: a killed writer: 'a killed conversion' ('Removed <dir>, left by <killed> (<holder>).').
  fix: what to do instead of waiting: 'choose another --output_dir'.
  taken: the error when `final` exists and is not empty and is not overwritten.
  """
  running: str
  killed: str
  fix: str
  taken: str


def write_of(final: str, fix: str, taken: str) -> Writer:
  """The `Writer` of a plain write of `final` (a T5X step, an export)."""
  return Writer(running=f'Another write of {final}',
                killed=f'a write of {os.path.basename(final)} that was killed', fix=fix,
                taken=taken)


def is_taken(path: str) -> bool:
  """Whether local `path` holds something a write would replace: anything but an empty
  directory."""
  return os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path))


@contextlib.contextmanager
def create(final: str, writer: Writer, stem: Optional[str] = None,
           overwrite: bool = False) -> Iterator[str]:
  """`with create(final, writer) as work:` the block fills the new directory `work` (a path, or
  a gs:// URL when `final` is one), which then becomes `final`.

  Args:
    final: the directory to write, local or gs://BUCKET/PATH.
    writer: how the messages name this write.
    stem: the prefix of the lock and work directories beside `final` (default `<final>.tmp`).
    overwrite: replace a non-empty `final` (else refused).

  Raises:
    FileExistsError: `final` is taken, or another write of it is running (nothing written), or
      on gs:// another writer took the lock over while this one wrote (`final` left as it was).
  """
  stem = stem or f'{final}.tmp'
  write = _create_in_gcs if paths.is_url(final) else _create_locally
  with write(final, writer, stem, overwrite) as work:
    yield work


def _refused(held: file_lock.LockHeld, writer: Writer) -> FileExistsError:
  return FileExistsError(f'{writer.running} is running: {held} Fix: wait for it to finish, or '
                         f'{writer.fix}.')


def _leftovers(stem: str, names: List[str]) -> List[str]:
  """The killed writers' work directories among `names` (paths or URLs beginning with
  '<stem>-')."""
  rests = {name[len(stem) + 1:].split('/', 1)[0] for name in names}
  return sorted(f'{stem}-{rest}' for rest in rests if _WORK.fullmatch(rest))


@contextlib.contextmanager
def _create_locally(final: str, writer: Writer, stem: str, overwrite: bool) -> Iterator[str]:
  lock_path = f'{stem}.lock'
  last = f' ({file_lock.describe_holder(lock_path)})' if os.path.exists(lock_path) else ''
  try:
    lock = file_lock.FileLock(lock_path, purpose=f'writing {final}').acquire()
  except file_lock.LockHeld as held:
    raise _refused(held, writer) from None
  with file_lock.writing(lock, f'{stem}-{int(time.time())}-{os.getpid()}') as work:
    if not overwrite and is_taken(final):
      raise FileExistsError(writer.taken)
    for killed in _leftovers(stem, glob.glob(glob.escape(stem) + '-*')):
      shutil.rmtree(killed)
      log.info('Removed %s, left by %s%s.', killed, writer.killed, last)
    os.makedirs(work)
    yield work
    _replace(work, final)


def _replace(work: str, final: str) -> None:
  """Renames `work` to `final`; an old output is moved aside first, deleted last."""
  aside = f'{work}.old'
  if is_taken(final):
    os.makedirs(aside)
    os.rename(final, os.path.join(aside, 'output'))
  os.rename(work, final)   # an empty directory there is replaced
  shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _create_in_gcs(final: str, writer: Writer, stem: str, overwrite: bool) -> Iterator[str]:
  try:
    lock = GcsLock(f'{stem}.lock').acquire()
  except file_lock.LockHeld as held:
    raise _refused(held, writer) from None
  try:
    if not overwrite and gcs.has_content(final):
      raise FileExistsError(writer.taken)
    for killed in _leftovers(stem, gcs.names_starting_with(f'{stem}-')):
      gcs.delete_tree(killed)
      log.info('Removed %s, left by %s.', killed, writer.killed)
    work = f'{stem}-{int(time.time())}-{os.getpid()}'
    try:
      yield work
      _copy_into_place(work, final, lock, writer)
    except BaseException:
      _delete_quietly(work)
      raise
  finally:
    lock.release()


def _copy_into_place(work: str, final: str, lock: GcsLock, writer: Writer) -> None:
  """Copies `work` to `final` (markers last), an old output deleted first, then `work`."""
  if not lock.still_held():
    raise FileExistsError(
        f'{lock.url} was taken over by {writer.running} while this one wrote {work} (its '
        f'heartbeat had been silent for over {STALE_SECONDS:.0f}s); {final} was left as it '
        f'was. Fix: write it again once the other one has finished.')
  if gcs.names(final) or gcs.is_object(final):
    gcs.delete_tree(final)
  gcs.copy_tree(work, final)
  gcs.delete_tree(work)


def _delete_quietly(work: str) -> None:
  try:
    gcs.delete_tree(work)
  except Exception as e:  # pylint: disable=broad-except  (the error being raised matters more)
    log.warning('Could not delete %s (%s); the next write of the same output deletes it.',
                work, e)
