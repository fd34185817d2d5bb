"""`every`: when a periodic action of the training loop runs (big_vision's `itstime`)."""

from typing import Callable, Iterable


def every(period: int, *, last: int, also: Iterable[int] = ()) -> Callable[[int], bool]:
  """`(step) -> bool`: True at every multiple of `period` (0: never), at `last` (the run's
  final step) and at the steps of `also`.

  Steps count steps done: the action after step s's update runs at s + 1.
  """
  extra = frozenset(also) | {last}
  return lambda step: bool(period and step % period == 0) or step in extra
