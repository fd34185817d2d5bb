"""Validation curves of finished runs, against steps and training FLOPs, gathered over seeds.

A run's training FLOPs are counted from its `train_flops_per_step` (logged with every training
row; `upcycle.models.flops`): `extra_flops` since the run's own first step, `total_flops`
with the FLOPs of the run it started from (the dense pretraining up to the upcycling point).
"""

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from upcycle.train import routing_health


@dataclasses.dataclass(frozen=True)
class Curve:
  """The evaluations of one run, `[evals]` each.

  Attributes:
    steps: the step of each evaluation (the first is the run's starting point).
    extra_flops: training FLOPs spent by this run up to each evaluation.
    total_flops: the same plus the FLOPs of the run it started from.
    loss, accuracy: validation metrics.
    flops_per_step: this run's training FLOPs per step.
  """

  steps: np.ndarray
  extra_flops: np.ndarray
  total_flops: np.ndarray
  loss: np.ndarray
  accuracy: np.ndarray
  flops_per_step: float

  def metric(self, name: str) -> np.ndarray:
    return getattr(self, name)

  def total_flops_at_step(self, step: int) -> float:
    """Training FLOPs up to `step` of this run, the run it started from included."""
    return float(self.total_flops[0] + (step - self.steps[0]) * self.flops_per_step)

  def at(self, name: str, flops: float, axis: str = 'total_flops') -> float:
    """`name` interpolated linearly at `flops`; NaN outside the curve."""
    x = getattr(self, axis)
    if flops < x[0] - 1e-6 * abs(x[0]) or flops > x[-1] * (1 + 1e-6):
      return float('nan')
    return float(np.interp(flops, x, self.metric(name)))


def read_rows(run_dir: str) -> List[dict]:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def train_rows_at_end(run_dir: str, window: float = 0.1) -> List[dict]:
  """The training rows logged over the last `window` of the run's steps (of those from its
  first logged step to its last)."""
  return routing_health.rows_at_end([r for r in read_rows(run_dir) if r.get('split') == 'train'],
                                    window)


def read_curve(run_dir: str, start_flops: float = 0.0) -> Curve:
  """The curve of the run in `run_dir`; `start_flops` is what its starting point cost."""
  rows = read_rows(run_dir)
  evals = {r['step']: r for r in rows if r.get('split') == 'eval'}
  train = [r for r in rows if r.get('split') == 'train' and 'train_flops_per_step' in r]
  if not evals or not train:
    raise ValueError(f'{run_dir}/metrics.jsonl has no evaluation or training rows; was the run '
                     f'finished?')
  rate = float(train[-1]['train_flops_per_step'])
  steps = np.array(sorted(evals), dtype=np.int64)
  extra = (steps - steps[0]) * rate
  return Curve(steps=steps, extra_flops=extra, total_flops=extra + start_flops,
               loss=np.array([evals[s]['loss'] for s in steps]),
               accuracy=np.array([evals[s]['accuracy'] for s in steps]), flops_per_step=rate)


class Results:
  """`curve(family, arm, seed)` of every finished run under a study's runs directory.

  A run's final value is the mean of its last `final_window` evaluations: single evaluations
  of these small models move by several hundredths between neighbouring evaluations.
  """

  def __init__(self, runs_dir: str, seeds, final_window: int = 1):
    if final_window < 1:
      raise ValueError(f'final_window={final_window}: expected >= 1 evaluations.')
    self.runs_dir, self.seeds, self.final_window = runs_dir, tuple(seeds), final_window
    self._cache: Dict[tuple, Optional[Curve]] = {}

  def has(self, family: str, arm: str) -> bool:
    return all(os.path.exists(os.path.join(self.runs_dir, family, arm, f'seed{s}', 'study.done'))
               for s in self.seeds)

  def failed(self, family: str, arm: str) -> bool:
    return any(os.path.exists(os.path.join(self.runs_dir, family, arm, f'seed{s}',
                                           'study.failed')) for s in self.seeds)

  def curve(self, family: str, arm: str, seed: int) -> Curve:
    key = (family, arm, seed)
    if key not in self._cache:
      run_dir = os.path.join(self.runs_dir, family, arm, f'seed{seed}')
      with open(os.path.join(run_dir, 'study.json')) as f:
        source = json.load(f)['source']     # [arm, step] it started from, or None
      start_flops = 0.0
      if source:   # what the run it starts from spent up to that step, its own source too
        start_flops = self.curve(family, source[0], seed).total_flops_at_step(source[1])
      self._cache[key] = read_curve(run_dir, start_flops)
    return self._cache[key]

  def curves(self, family: str, arm: str) -> List[Curve]:
    return [self.curve(family, arm, s) for s in self.seeds]

  def routing_health(self, family: str, arm: str, seed: int,
                     until_step: Optional[float] = None) -> Optional[dict]:
    """The run's routing-health row (`upcycle.train.routing_health`); None for a dense run or
    one trained before runs wrote the row. With `until_step` before the run's end: the row the
    run would have written had it stopped there (over its training rows up to that step)."""
    rows = read_rows(os.path.join(self.runs_dir, family, arm, f'seed{seed}'))
    row = routing_health.of_run(rows)
    if row is None or until_step is None or until_step >= row['step']:
      return row
    return routing_health.health([r for r in rows if r.get('step', 0) <= until_step],
                                 {layer: h['num_experts'] for layer, h in row['layers'].items()})

  def unlearned_routers(self, family: str, arm: str) -> Dict[int, dict]:
    """{seed: its routing-health row} of the arm's runs whose routers did not learn."""
    rows = {s: self.routing_health(family, arm, s) for s in self.seeds}
    return {s: row for s, row in rows.items() if row is not None and not row['routers_learned']}

  def epochs(self, family: str, arm: str) -> float:
    """The most any seed's run of the arm read of its training data, in epochs
    (`upcycle.study.epochs`)."""
    from upcycle.study import epochs  # pylint: disable=g-import-not-at-top
    return max(epochs.read(os.path.join(self.runs_dir, family, arm, f'seed{s}'), self.runs_dir)
               for s in self.seeds)

  def final(self, family: str, arm: str, metric: str) -> np.ndarray:
    """`[seeds]` the mean of each seed's last `final_window` evaluations."""
    return self.until(family, arm, metric, np.inf)

  def until(self, family: str, arm: str, metric: str, step: float) -> np.ndarray:
    """`[seeds]` like `final` for the run stopped at `step`: the mean of its last
    `final_window` evaluations at or before `step`."""
    out = []
    for c in self.curves(family, arm):
      values = c.metric(metric)[c.steps <= step][-self.final_window:]
      out.append(values.mean() if len(values) else float('nan'))
    return np.array(out)

  def start(self, family: str, arm: str, metric: str) -> np.ndarray:
    """`[seeds]` the evaluation at each run's starting point (before its first step)."""
    return np.array([c.metric(metric)[0] for c in self.curves(family, arm)])

  def common_points(self, family: str, a: str, b: str, seed: int,
                    axis: str = 'total_flops') -> Tuple[np.ndarray, str]:
    """(`[final_window]` the FLOPs of the last evaluations of the run that ended cheaper, that
    run's arm): where both runs of `seed` are read at equal FLOPs; the last point is the
    largest FLOPs both reached."""
    ca, cb = self.curve(family, a, seed), self.curve(family, b, seed)
    cheaper, arm = (ca, a) if getattr(ca, axis)[-1] <= getattr(cb, axis)[-1] else (cb, b)
    return getattr(cheaper, axis)[-self.final_window:], arm

  def at_common_flops(self, family: str, a: str, b: str, metric: str,
                      axis: str = 'total_flops') -> tuple:
    """(`[seeds]`, `[seeds]`) both arms' metric where the cheaper one ended: the mean of both
    curves at the FLOPs of the cheaper run's last `final_window` evaluations."""
    out_a, out_b = [], []
    for s in self.seeds:
      points, _ = self.common_points(family, a, b, s, axis)
      ca, cb = self.curve(family, a, s), self.curve(family, b, s)
      out_a.append(np.mean([ca.at(metric, x, axis) for x in points]))
      out_b.append(np.mean([cb.at(metric, x, axis) for x in points]))
    return np.array(out_a), np.array(out_b)
