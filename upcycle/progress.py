"""Progress of long command-line work as log lines: how much is done (of how much), the rate
and, when the total is known, the time left."""

import logging
import time
from typing import Callable, Optional, Tuple

log = logging.getLogger(__name__)


def eta(seconds: float) -> str:
  """Time left as H:MM:SS (training's log lines show it the same way)."""
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


class Progress:
  """Counts `unit`s done and logs `line()` at most every `every` seconds, and at `finish()`
  unless that line was just logged. The rate (and so the time left) is measured from the first
  `update`, so the start-up before the first unit (compiling, opening files) does not count."""

  def __init__(self, what: str, unit: str, total: Optional[int] = None, every: float = 10.0,
               clock: Callable[[], float] = time.monotonic):
    self.what, self.unit, self.total, self.every, self._clock = what, unit, total, every, clock
    self.done = 0
    self._start = self._last = clock()
    self._first: Optional[Tuple[float, int]] = None   # (time, done) at the first update
    self._logged: Optional[int] = None                # `done` of the last line logged

  def update(self, n: int) -> None:
    self.done += n
    if self._first is None:
      self._first = (self._clock(), self.done)
    if self._clock() - self._last >= self.every:
      self._last = self._clock()
      self._log()

  def finish(self) -> None:
    if self._logged != self.done:
      self._log()

  def _log(self) -> None:
    self._logged = self.done
    log.info(self.line())

  def _rate(self) -> float:
    """Units per second since the first update; over the whole time until a second one."""
    now = self._clock()
    if self._first is not None and self.done > self._first[1] and now > self._first[0]:
      return (self.done - self._first[1]) / (now - self._first[0])
    return self.done / max(now - self._start, 1e-9)

  def line(self) -> str:
    """'infer: 96/320 examples (30%), 12.0 examples/s, ETA 0:00:19'."""
    rate = self._rate()
    done = (f'{self.done}/{self.total} {self.unit} ({self.done / self.total:.0%})' if self.total
            else f'{self.done} {self.unit}')
    parts = [f'{self.what}: {done}', f'{rate:.1f} {self.unit}/s']
    if self.total and rate > 0:
      parts.append(f'ETA {eta((self.total - self.done) / rate)}')
    return ', '.join(parts)
