"""`GcsLock`: one holder of a gs:// object at a time, with a heartbeat (MODEL_DIR/run.lock, and
`.OUTPUT.converting.lock` beside a conversion's gs:// output).

GCS has no OS locks. The lock is an object created with the precondition "only if absent"
(`ifGenerationMatch=0`, what tensorstore's conditional write sends for a missing key), so of two
trainers starting together exactly one creates it. The object (one JSON line) names the holder
(host, pid, since) and its last heartbeat, rewritten every HEARTBEAT_SECONDS by a background
thread. A starting trainer takes the lock over, again conditionally on the generation it read,
when the holder is dead: the heartbeat is older than STALE_SECONDS, or the holder is a process
of this same host that no longer exists (a killed run restarted on its machine, at once). The
take-over deletes the dead holder's object and creates its own, again only if absent: of
several trainers taking over at once one creates it, but one that deletes after another has
created would remove a live lock (a window of one request; a conditional delete on the read
generation would close it, but the emulator the tests use reports no generations). The holder
deletes the object when it releases the lock.
"""

import json
import logging
import os
import socket
import threading
import time
from typing import Optional

import tensorstore as ts

from upcycle.locks.file_lock import LockHeld, holder

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def is_stale(record: dict, now: float) -> Optional[str]:
  """Why the holder of `record` is dead (None if it may be alive)."""
  age = now - float(record.get('heartbeat', 0))
  if age > STALE_SECONDS:
    return f'its last heartbeat was {age:.0f}s ago (> {STALE_SECONDS:.0f}s)'
  if record.get('host') == socket.gethostname() and not _pid_alive(int(record.get('pid', -1))):
    return f"its process {record.get('pid')} no longer exists on this host"
  return None


_ABSENT = b'\x02'   # tensorstore's generation of a missing key: write only if absent


class GcsLock:
  """`with GcsLock('gs://bucket/run/run.lock'):`; raises LockHeld if a live holder has it."""

  def __init__(self, url: str):
    bucket, _, self.key = url[len('gs://'):].partition('/')
    self.url = url
    self._store = ts.KvStore.open({'driver': 'gcs', 'bucket': bucket}).result()
    self._generation = None
    self._record = None
    self._stop = threading.Event()
    self._thread = None

  def _write(self, if_equal: bytes) -> bool:
    self._record['heartbeat'] = time.time()
    try:
      stamp = self._store.write(self.key, json.dumps(self._record) + '\n',
                                if_equal=if_equal).result()
    except ValueError as e:  # tensorstore reports a failed precondition as ValueError.
      if 'FAILED_PRECONDITION' in str(e) or 'precondition' in str(e).lower():
        return False
      raise
    if stamp.generation == b'':  # The condition did not hold: nothing was written.
      return False
    self._generation = stamp.generation
    return True

  def acquire(self) -> 'GcsLock':
    current = self._store.read(self.key).result()
    self._record = holder()
    if current.state == 'value':
      record = json.loads(bytes(current.value).decode() or '{}')
      dead = is_stale(record, time.time())
      who = (f"pid {record.get('pid')} on host {record.get('host')}, since "
             f"{record.get('since')}")
      if dead is None:
        raise LockHeld(f'{self.url} is held by {who}, heartbeat '
                       f"{time.time() - float(record.get('heartbeat', 0)):.0f}s ago; it is taken "
                       f'over once the holder has been silent for {STALE_SECONDS:.0f}s.')
      log.warning('Taking over %s from %s: %s.', self.url, who, dead)
      self._store.write(self.key, None).result()
    if not self._write(_ABSENT):
      raise LockHeld(f'{self.url} was taken by another process at the same moment.')
    self._stop.clear()
    self._thread = threading.Thread(target=self._beat, daemon=True, name='gcs-lock-heartbeat')
    self._thread.start()
    return self

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      try:
        if not self._write(self._generation):
          log.error('%s was taken over by another process: this one no longer holds it; '
                    'stop it.', self.url)
          return
      except ValueError as e:
        log.warning('Heartbeat of %s failed (retrying): %s', self.url, e)

  def still_held(self) -> bool:
    """Whether the object still names this holder (False once another process took it over)."""
    current = self._store.read(self.key).result()
    if current.state != 'value':
      return False
    record = json.loads(bytes(current.value).decode() or '{}')
    return all(record.get(k) == self._record[k] for k in ('host', 'pid', 'since'))

  def release(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    try:
      self._store.write(self.key, None, if_equal=self._generation).result()
    except ValueError as e:
      log.warning('Could not delete %s (%s); the next run takes it over as stale.', self.url, e)

  @property
  def held(self) -> bool:
    return self._thread is not None

  def __enter__(self) -> 'GcsLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
