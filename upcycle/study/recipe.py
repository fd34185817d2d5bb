"""The `recipe` suite: the tiny T5's learning rate chosen by a sweep, for seeds that agree.

Every seed pretrains the dense tiny T5 from scratch (`runs/pretrain.gin`, T5X's Adafactor and
rsqrt schedule) for the `regime` suite's P steps at each peak learning rate of
`Scale.recipe_peaks` (base rate = peak x sqrt(warmup), so the rate is the peak for the
warmup and falls as 1 / sqrt(step) after it), then its last checkpoint is evaluated on the
whole validation split (`Run.final_eval_batches`), the same sequences for every seed. A peak
gives seeds that agree when the standard deviation of those final losses over the seeds is at
most `Scale.recipe_seed_std`; the recipe is the agreeing peak with the lowest mean loss.
Beside them, each run's training instability: its largest logged gradient norm over the median
of its logged gradient norms after the warmup.
"""

import math
import os
from typing import Dict, List, Optional

import numpy as np

from upcycle.study import curves
from upcycle.study.runs import Run, final_eval
from upcycle.study.scale import Scale


def arm(peak: float) -> str:
  """The sweep arm of one peak learning rate: 'lr_0.032'."""
  return f'lr_{peak:g}'


def arms(scale: Scale) -> tuple:
  return tuple(arm(p) for p in scale.recipe_peaks)


def recipe_runs(scale: Scale, seed: int) -> List[Run]:
  """The sweep's runs of one seed: one dense pretraining per peak learning rate."""
  warmup = scale.recipe_warmup_steps
  return [Run('t5', arm(peak), seed, ('runs/pretrain.gin',),
              (f'WARMUP_STEPS={warmup}',
               f'optimizers.rsqrt_schedule.base_learning_rate={peak * math.sqrt(warmup):g}'),
              steps=scale.regime_pretrain_steps, final_eval_batches=scale.recipe_eval_batches)
          for peak in scale.recipe_peaks]


def descriptions(scale: Scale) -> Dict[str, str]:
  return {arm(p): f'dense pretraining for P steps at peak learning rate {p:g}, evaluated on '
                  f'the whole validation split' for p in scale.recipe_peaks}


def gradient_spike(run_dir: str, warmup: int) -> float:
  """The run's largest logged gradient norm after `warmup` steps over their median."""
  norms = np.array([r['grad_norm'] for r in curves.read_rows(run_dir)
                    if r.get('split') == 'train' and 'grad_norm' in r and r['step'] > warmup])
  return float(norms.max() / np.median(norms))


def summary(runs_dir: str, scale: Scale) -> Optional[Dict[str, object]]:
  """Per peak whose runs all finished: each seed's final whole-split loss (and its standard
  error over the evaluation batches) and gradient spike, the mean and std over seeds, whether
  the seeds agree; and the chosen peak (None when no peak's seeds agree). None before any peak
  finished. With one seed, agreement is not measured (`agree` None) and no peak is chosen."""
  rows, results = [], curves.Results(runs_dir, scale.seeds)
  for peak in scale.recipe_peaks:
    if not results.has('t5', arm(peak)):
      continue
    dirs = [os.path.join(runs_dir, 't5', arm(peak), f'seed{s}') for s in scale.seeds]
    evals = [final_eval(d) for d in dirs]
    loss = np.array([e['loss'] for e in evals])
    std = float(loss.std(ddof=1)) if len(loss) > 1 else float('nan')
    rows.append({'peak': peak, 'loss': loss,
                 'loss_stderr': np.array([e.get('loss_stderr', np.nan) for e in evals]),
                 'accuracy': np.array([e['accuracy'] for e in evals]),
                 'spike': np.array([gradient_spike(d, scale.recipe_warmup_steps) for d in dirs]),
                 'mean': float(loss.mean()), 'std': std,
                 'agree': None if len(loss) < 2 else bool(std <= scale.recipe_seed_std)})
  if not rows:
    return None
  agreeing = [r for r in rows if r['agree']]
  chosen = min(agreeing, key=lambda r: r['mean'])['peak'] if agreeing else None
  return {'rows': rows, 'chosen': chosen,
          'complete': len(rows) == len(scale.recipe_peaks)}
