"""Validation curves of finished runs, against steps and training FLOPs, gathered over seeds.

A run's training FLOPs are counted from its `train_flops_per_step` (logged with every training
row; `upcycle.models.flops`): `extra_flops` since the run's own first step, `total_flops`
with the FLOPs of the run it started from (the dense pretraining up to the upcycling point).
"""

import dataclasses
import json
import os
from typing import Dict, List, Optional

import numpy as np


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

  def at(self, name: str, flops: float, axis: str = 'total_flops') -> float:
    """`name` interpolated linearly at `flops`; NaN outside the curve."""
    x = getattr(self, axis)
    if flops < x[0] - 1e-6 * abs(x[0]) or flops > x[-1] * (1 + 1e-6):
      return float('nan')
    return float(np.interp(flops, x, self.metric(name)))


def read_rows(run_dir: str) -> List[dict]:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


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
  """`curve(family, arm, seed)` of every finished run under a study's runs directory."""

  def __init__(self, runs_dir: str, seeds):
    self.runs_dir, self.seeds = runs_dir, tuple(seeds)
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
      if source:
        start_flops = source[1] * self.curve(family, source[0], seed).flops_per_step
      self._cache[key] = read_curve(run_dir, start_flops)
    return self._cache[key]

  def curves(self, family: str, arm: str) -> List[Curve]:
    return [self.curve(family, arm, s) for s in self.seeds]

  def final(self, family: str, arm: str, metric: str) -> np.ndarray:
    """`[seeds]` the last evaluation of each seed's run."""
    return np.array([c.metric(metric)[-1] for c in self.curves(family, arm)])

  def start(self, family: str, arm: str, metric: str) -> np.ndarray:
    """`[seeds]` the evaluation at each run's starting point (before its first step)."""
    return np.array([c.metric(metric)[0] for c in self.curves(family, arm)])

  def at_common_flops(self, family: str, a: str, b: str, metric: str,
                      axis: str = 'total_flops') -> tuple:
    """(`[seeds]`, `[seeds]`) both arms' metric at the FLOPs where the cheaper one ended."""
    out_a, out_b = [], []
    for s in self.seeds:
      ca, cb = self.curve(family, a, s), self.curve(family, b, s)
      flops = min(getattr(ca, axis)[-1], getattr(cb, axis)[-1])
      out_a.append(ca.at(metric, flops, axis))
      out_b.append(cb.at(metric, flops, axis))
    return np.array(out_a), np.array(out_b)
