"""The `regime` suite's measurements: the plateau, the comparison at fractions of the sunk cost,
and each arm's train-vs-validation gap and epochs.

The sunk cost is the dense pretraining's training FLOPs (`regime_pretrain`, P steps). A
continuation's point at fraction f is its validation loss at f x sunk extra FLOPs; the MoE from
scratch is read at the same total FLOPs, (1 + f) x sunk. Like a claim's final value, a point is
the mean over `final_window` evaluation spacings ending there (the curve interpolated every
`eval_every` dense steps' worth of FLOPs, the same window for every arm): one evaluation of
these small models moves by several hundredths.
"""

import dataclasses
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from upcycle.study import claims, epochs as epochs_lib
from upcycle.study.curves import Results, train_rows_at_end

PRETRAIN, DENSE, PAPER, BEST, SCRATCH = ('regime_pretrain', 'regime_dense', 'regime_moe_paper',
                                         'regime_moe_best', 'regime_scratch')
CONTINUATIONS = (DENSE, PAPER, BEST)


def _window(scale, end: float, spacing: float) -> np.ndarray:
  """`[final_window]` points `spacing` apart ending at `end`."""
  return end - spacing * np.arange(scale.final_window)


def plateau(results: Results, scale, *, family: str = 't5', arm: str = PRETRAIN,
            steps: Optional[int] = None, eval_every: Optional[int] = None
            ) -> List[Dict[str, float]]:
  """Per seed: a dense pretraining's validation loss at (1 - window) P and at P (each the
  mean of the `final_window` evaluations ending there), the relative drop between them and
  whether it is under the tolerance. Default: the `regime` suite's (P = its steps); the `drop`
  suite passes its Llama's."""
  p = scale.regime_pretrain_steps if steps is None else steps
  every = scale.eval_every if eval_every is None else eval_every
  start = p * (1 - scale.plateau_window)
  out = []
  for seed, c in zip(results.seeds, results.curves(family, arm)):
    before, after = (float(np.interp(_window(scale, s, every), c.steps, c.loss).mean())
                     for s in (start, p))
    drop = (before - after) / before
    out.append({'seed': seed, 'step_before': start, 'loss_before': before, 'loss_at_p': after,
                'relative_drop': drop, 'plateaued': bool(drop < scale.plateau_tolerance)})
  return out


def sunk_flops(results: Results, scale) -> np.ndarray:
  """`[seeds]` training FLOPs of the dense pretraining to P."""
  return np.array([c.total_flops_at_step(scale.regime_pretrain_steps)
                   for c in results.curves('t5', PRETRAIN)])


def at_fraction(results: Results, scale, arm: str, fraction: float) -> np.ndarray:
  """`[seeds]` the arm's validation loss after `fraction` x the sunk cost: a continuation at
  that many extra FLOPs, the scratch MoE at the same total FLOPs (module docstring: the mean
  over a window of `final_window` dense evaluation spacings)."""
  out = []
  dense = results.curves('t5', PRETRAIN)
  for sunk, d, c in zip(sunk_flops(results, scale), dense, results.curves('t5', arm)):
    spacing = scale.eval_every * d.flops_per_step
    if arm == SCRATCH:
      points, axis = _window(scale, (1 + fraction) * sunk, spacing), 'total_flops'
    else:
      points, axis = _window(scale, fraction * sunk, spacing), 'extra_flops'
    out.append(np.mean([c.at('loss', x, axis) for x in points]))
  return np.array(out)


@dataclasses.dataclass(frozen=True)
class Comparison:
  """A vs B at one fraction: values `[seeds]`, d > 0 when A is better, the verdict."""

  a: np.ndarray
  b: np.ndarray
  d: np.ndarray
  verdict: str

  def cell(self, shown: str = 'a') -> str:
    """'<mean ± std of arm a (or b)>; d = <mean> ± <s.e.>: <verdict>'."""
    return (f'{claims.mean_std(getattr(self, shown))}; d = {self.d.mean():+.4f} ± '
            f'{claims.standard_error(self.d):.4f}: {self.verdict}')


def compare(results: Results, scale, a: str, b: str, fraction: float) -> Comparison:
  va, vb = at_fraction(results, scale, a, fraction), at_fraction(results, scale, b, fraction)
  d = claims.paired(va, vb, 'loss')
  return Comparison(va, vb, d, claims.verdict(d, 'better'))


def train_loss_at_end(run_dir: str, window: float = 0.1) -> float:
  """Mean logged training loss over the last `window` of the run's steps (each batch is
  unseen when its loss is logged: no run here reads an example twice)."""
  return float(np.mean([r['loss'] for r in train_rows_at_end(run_dir, window)]))


def ends(results: Results, arms: Sequence[str]) -> List[Dict[str, object]]:
  """Per arm that finished: steps, epochs, training and validation loss at its end and the gap
  (validation - training), each over seeds."""
  out = []
  for arm in arms:
    if not results.has('t5', arm):
      continue
    dirs = [os.path.join(results.runs_dir, 't5', arm, f'seed{s}') for s in results.seeds]
    train = np.array([train_loss_at_end(d) for d in dirs])
    valid = np.array([c.loss[-1] for c in results.curves('t5', arm)])
    out.append({'arm': arm, 'steps': int(results.curves('t5', arm)[0].steps[-1]),
                'epochs': results.epochs('t5', arm),
                'train': train, 'validation': valid, 'gap': valid - train})
  return out


def finished(results: Results) -> bool:
  return results.has('t5', PRETRAIN)


def summary(results: Results, scale) -> Optional[Dict[str, object]]:
  """Everything the RESULTS.md section shows (arrays and `Comparison`s, which the renderer
  writes to study.json); None before the pretraining ran."""
  if not finished(results):
    return None
  rows = []
  for f in scale.regime_fractions:
    row = {'fraction': f}
    for arm in (PAPER, BEST):
      if results.has('t5', arm) and results.has('t5', DENSE):
        row[arm] = compare(results, scale, arm, DENSE, f)
    if results.has('t5', BEST) and results.has('t5', SCRATCH):
      row[SCRATCH] = compare(results, scale, BEST, SCRATCH, f)
    if results.has('t5', DENSE):
      row[DENSE] = at_fraction(results, scale, DENSE, f)
    rows.append(row)
  first = os.path.join(results.runs_dir, 't5', PRETRAIN, f'seed{results.seeds[0]}')
  return {'plateau': plateau(results, scale), 'rows': rows,
          'ends': ends(results, (PRETRAIN, *CONTINUATIONS, SCRATCH)),
          'feature_lengths': epochs_lib.data_position(first)['pipeline']['feature_lengths']}
