"""The largest batch that fits, from two compiles of the train step.

Per device, the parameters, optimizer state and their gradients do not depend on the batch;
activations (the compiler's temporaries) and the batch itself grow with it, linearly with
scanned, rematerialized layers. So the total per device is close to a + b * batch: compiled
at the run's batch and at a second one (half of it, or double when half is not a whole
multiple of the data-parallel split), the line through the two totals predicts the largest
batch, a multiple of that split, within the usable HBM; one more compile checks the
prediction when it is at most `REACH` times the run's batch (further out the line is not
trusted, and a compile at a huge batch takes long: the prediction is reported uncompiled). At
most these two extra compiles of the train step (`upcycle.aot --find_batch`).
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


@dataclasses.dataclass(frozen=True)
class BatchSearch:
  """The train step's total per device at each batch compiled, the line's prediction and the
  run's batch."""

  totals: Dict[int, int]
  predicted: Optional[int]
  usable: int
  batch: int

  def largest_fitting(self) -> int:
    """The largest batch compiled that fits (0: none did)."""
    return max((b for b, t in self.totals.items() if t <= self.usable), default=0)

  def lines(self) -> List[str]:
    """What was compiled and found, for the console."""
    compiled = ', '.join(f'{b}: {t / GIB:.2f} GiB' for b, t in sorted(self.totals.items()))
    predicted = ('the totals do not grow with the batch: no prediction'
                 if self.predicted is None else f'the line predicts BATCH_SIZE = '
                 f'{self.predicted}' + ('' if self.predicted in self.totals else
                                        f' (over {REACH} x {self.batch}: not compiled)'))
    found = self.largest_fitting()
    return [f'--find_batch: train step total per device at batch {compiled}; {predicted}; '
            + (f'the largest compiled that fits: BATCH_SIZE = {found}' if found else
               'none compiled fits')]

  def as_json(self) -> Dict[str, object]:
    return {'total_bytes_by_batch': {str(b): t for b, t in sorted(self.totals.items())},
            'predicted': self.predicted, 'largest_fitting': self.largest_fitting()}


def search(total_at: Callable[[int], int], *, batch: int, total: int, usable: int,
           multiple: int) -> BatchSearch:
  """Compiles (`total_at(batch)` -> bytes per device, None when it cannot be compiled) at a
  second batch and at the predicted one (when it is new, positive and within `REACH` x
  `batch`) beside `batch`, whose `total` is known."""
  totals = {batch: total}
  second = second_batch(batch, multiple)
  second_total = total_at(second)
  if second_total is None:
    return BatchSearch(totals, None, usable, batch)
  totals[second] = second_total
  predicted = largest_batch((batch, total), (second, second_total), usable=usable,
                            multiple=multiple)
  if predicted and predicted not in totals and predicted <= REACH * batch:
    predicted_total = total_at(predicted)
    if predicted_total is not None:
      totals[predicted] = predicted_total
  return BatchSearch(totals, predicted, usable, batch)
