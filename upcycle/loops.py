"""Counting loops: whether the model's scan over layers and the step's scan over microbatches
are unrolled while a program is traced.

The TPU compiler's cost analysis counts a loop's body once, whatever its trip count, so a
scanned model's FLOPs and bytes per step come out as one layer's (one microbatch's).
`upcycle.aot` therefore compiles, next to the step it sizes, a copy traced under `unrolled()`,
in which every scan is unrolled (`unroll(length)` returns the whole length), and reads the
step's FLOPs and bytes from that copy. Outside `unrolled()` every scan is a loop, as trained.
"""

import contextlib
import contextvars
from typing import Iterator

_UNROLLED = contextvars.ContextVar('upcycle_scans_unrolled', default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
  """Within: every scan traced is unrolled (for counting, not for running)."""
  token = _UNROLLED.set(True)
  try:
    yield
  finally:
    _UNROLLED.reset(token)


def unroll(length: int) -> int:
  """The `unroll` of a scan of `length` iterations: all of them within `unrolled()`, else 1."""
  return length if _UNROLLED.get() else 1
