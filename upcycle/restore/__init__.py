"""The restore hook: a run's first TrainState from a checkpoint, built on the mesh.

`hook.py` holds the one hook, `Restore(source, mode)` (its mode bound in gin, one file of
configs/upcycling/ per mode); `state_jit.py` its one jit, which `upcycle.aot` lowers for every
mode. gin files import the package (`from upcycle import restore`) and bind
`restore.Restore`.
"""

from typing import Any

from upcycle.gin_utils import FORMER, former
from upcycle.restore.hook import Restore

__all__ = ['Restore']


def __getattr__(name: str) -> Any:
  """A gin file or import naming a former hook class fails in one line saying what to write."""
  if name in FORMER:
    raise AttributeError(former(name))
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
