"""The largest batch that fits, from two more compiles of the train and eval steps.

Per device, the parameters, optimizer state and their gradients do not depend on the batch;
activations (the compiler's temporaries) and the batch itself grow with it, linearly with
scanned, rematerialized layers. So the total per device (the larger of the train and eval
steps', which both run at BATCH_SIZE: the eval step holds its whole batch at once, the train
step a microbatch) is close to a + b * batch: compiled at the run's batch and at a second
one (half of it, or double when half is not a whole multiple of the data-parallel split),
the line through the two totals predicts the largest batch, a multiple of that split,
within the usable HBM; one more compile checks the prediction when it is at most `REACH`
times the run's batch (further out the line is not trusted, and a compile at a huge batch
takes long: the prediction is reported uncompiled). When the line predicts that no batch
fits (0), that extra compile checks the smallest batch (`multiple`) instead, and
`larger_slice` names the devices its bytes would fit on. At most these two extra compiles of
each step (`upcycle.aot --find_batch`). Nothing is said not to fit unless it was compiled; a
prediction says it is one.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

GIB = 2 ** 30
REACH = 4   # the prediction is compiled when at most this many times the run's batch
Point = Tuple[int, int]   # (global batch, total bytes per device)


def largest_batch(a: Point, b: Point, *, usable: int, multiple: int) -> Optional[int]:
  """The largest multiple of `multiple` whose total, on the line through `a` and `b`, is at
  most `usable` bytes; 0 when not even `multiple` is; None when the totals do not grow with
  the batch (nothing to extrapolate)."""
  (b1, t1), (b2, t2) = sorted((a, b))
  if b1 == b2 or t2 <= t1:
    return None
  # batch = b1 + (usable - t1) * (b2 - b1) / (t2 - t1), in integers (floor division).
  batch = b1 + (usable - t1) * (b2 - b1) // (t2 - t1)
  return max(0, batch // multiple * multiple)


def second_batch(batch: int, multiple: int) -> int:
  """The batch to compile beside `batch`: half of it, or double when half is not a positive
  multiple of `multiple`."""
  half = batch // 2 // multiple * multiple
  return half if half >= multiple else 2 * batch


def line_total(a: Point, b: Point, batch: int) -> int:
  """The total per device at `batch` on the line through `a` and `b` (distinct batches)."""
  (b1, t1), (b2, t2) = a, b
  return t1 + (batch - b1) * (t2 - t1) // (b2 - b1)


def larger_slice(*, total: int, state: int, usable: int, devices: int) -> Optional[int]:
  """The fewest devices, `devices` times a power of two, on which a train step of `total`
  bytes per device at its smallest batch (one example per data x expert device and
  microbatch), `state` of them the parameters and optimizer state, fits in `usable`: the
  state split over k times the devices (as sharded state is: FSDP, expert partitions), the
  rest (one example's activations per device, the code) as it is. None when the rest alone
  does not fit: no slice holds it."""
  rest = total - state
  if rest >= usable:
    return None
  ways = 2
  while state / ways + rest > usable:
    ways *= 2
  return devices * ways


@dataclasses.dataclass(frozen=True)
class BatchSearch:
  """The total per device (the larger step's) at each batch compiled, the line's prediction, the
  run's batch and what batches must be a multiple of (`line`: the run's batch and the second
  compiled, the points the prediction is drawn through; None when the second did not
  compile)."""

  totals: Dict[int, int]
  predicted: Optional[int]
  usable: int
  batch: int
  multiple: int
  line: Optional[Tuple[Point, Point]] = None

  def largest_fitting(self) -> int:
    """The largest batch compiled that fits (0: none did)."""
    return max((b for b, t in self.totals.items() if t <= self.usable), default=0)

  def smallest(self) -> Optional[Tuple[int, bool]]:
    """(the total per device at the smallest batch, `multiple`; whether it was compiled,
    else the line's), None with no line and no compile there."""
    if self.multiple in self.totals:
      return self.totals[self.multiple], True
    if self.line is None:
      return None
    return line_total(*self.line, self.multiple), False

  def none_fits(self) -> bool:
    """Whether the line predicts that not even the smallest batch fits, and no compile
    found one that does."""
    return self.predicted == 0 and not self.largest_fitting()

  def lever(self) -> Optional[str]:
    """The BATCH_SIZE to advise (None: the run's is the largest that fits, or none fits,
    whose lever is a larger slice: `larger_slice`)."""
    found = self.largest_fitting()
    if found:
      return None if found == self.batch else (
          f'BATCH_SIZE = {found} (the largest that fits, from --find_batch)')
    if self.none_fits():
      return None
    if self.predicted and self.predicted not in self.totals:
      return f'BATCH_SIZE = {self.predicted} (predicted by --find_batch, not compiled)'
    return f'a BATCH_SIZE under {min(self.totals)} (none compiled fits)'

  def _prediction(self) -> str:
    if self.predicted is None:
      return 'the totals do not grow with the batch: no prediction'
    if self.predicted == 0:
      total, compiled = self.smallest()
      return (f'the line predicts that no BATCH_SIZE fits; the smallest, {self.multiple}, '
              f'needs {total / GIB:.2f} GiB of the {self.usable / GIB:.2f} usable '
              + ('(compiled)' if compiled else '(predicted, not compiled)'))
    said = f'the line predicts BATCH_SIZE = {self.predicted}'
    if self.predicted in self.totals:
      return said
    if self.predicted > REACH * self.batch:
      return f'{said} (over {REACH} x {self.batch}: not compiled)'
    return f'{said} (its compile failed: not compiled)'

  def lines(self) -> List[str]:
    """What was compiled and found, for the console."""
    compiled = ', '.join(f'{b}: {t / GIB:.2f} GiB' for b, t in sorted(self.totals.items()))
    found = self.largest_fitting()
    return [f'--find_batch: total per device (the larger of the train and eval steps\') at '
            f'batch {compiled} (compiled); '
            f'{self._prediction()}; '
            + (f'the largest compiled that fits: BATCH_SIZE = {found}' if found else
               'none compiled fits')]

  def as_json(self) -> Dict[str, object]:
    smallest = self.smallest() if self.predicted == 0 else None
    return {'total_bytes_by_batch': {str(b): t for b, t in sorted(self.totals.items())},
            'predicted': self.predicted, 'largest_fitting': self.largest_fitting(),
            'smallest_batch_bytes': None if smallest is None else smallest[0],
            'smallest_batch_compiled': None if smallest is None else smallest[1]}


def search(total_at: Callable[[int], int], *, batch: int, total: int, usable: int,
           multiple: int) -> BatchSearch:
  """Compiles (`total_at(batch)` -> bytes per device, None when it cannot be compiled) at a
  second batch and at the predicted one (when it is new and within `REACH` x `batch`; the
  smallest, `multiple`, when the prediction is that none fits) beside `batch`, whose `total`
  is known."""
  totals = {batch: total}
  second = second_batch(batch, multiple)
  second_total = total_at(second)
  if second_total is None:
    return BatchSearch(totals, None, usable, batch, multiple)
  totals[second] = second_total
  line = ((batch, total), (second, second_total))
  predicted = largest_batch(*line, usable=usable, multiple=multiple)
  check = multiple if predicted == 0 else predicted
  if check and check not in totals and check <= REACH * batch:
    checked_total = total_at(check)
    if checked_total is not None:
      totals[check] = checked_total
  return BatchSearch(totals, predicted, usable, batch, multiple, line)
