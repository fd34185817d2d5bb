"""SIGTERM stops training at a step with that step saved, so a restart loses nothing.

A Cloud TPU VM that is preempted (spot / preemptible), `launch/tpu_vm.py stop` and `kill`
send SIGTERM. With several processes, JAX's preemption service (on after
`jax.distributed.initialize()`) notices it on any host and names one step at which every host
stops (`multihost_utils.reached_preemption_sync_point`, asked after every step); a single
process notes the signal itself.
"""

import signal
import threading
from typing import Any, Optional

import jax
from jax.experimental import multihost_utils


class Stopped(Exception):
  """Training stopped at `step` on SIGTERM, with that step saved."""

  def __init__(self, step: int, directory: str):
    super().__init__(f'Stopped at step {step} on SIGTERM, with step {step} saved in '
                     f'{directory}; run the same command again to resume from it.')
    self.step = step


class Watch:
  """`with Watch() as watch:` ... `watch.reached(step)` after each step."""

  def __init__(self):
    self.received: Optional[int] = None
    self._previous: Any = None

  def __enter__(self) -> 'Watch':
    # Several processes: JAX's service has the signal (a handler here would replace its own).
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._note)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _note(self, signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
    self.received = signum

  def reached(self, step: int) -> bool:
    """Whether to save `step` and stop (every process gets the same answer for a step)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None
