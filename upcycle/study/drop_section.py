"""The `drop` suite's section of RESULTS.md: Drop-Upcycling's claims on a Llama upcycled into a
Mixtral (`drop_runs`), its curves against training tokens, where Drop overtakes naive
upcycling, and the experts each layer uses.

Verdicts follow `claims` (paired by seed, 2 s.e.). Where the curves cross: at every
evaluation after the upcycling point, d = naive's loss - Drop's (> 0 when Drop is ahead),
paired by seed; Drop has overtaken from the first evaluation after which d > 2 s.e. holds to
the end. The experts a layer uses: `routing.effective_experts` (exp of the entropy of the
experts' shares of the routed tokens; 2 when two experts take every token), the mean of its
logged values over the last 10% of a run's steps.
"""

import os
from typing import Dict, List, Optional

import numpy as np

from upcycle.study import claims, epochs as epochs_lib, regime
from upcycle.study.claims import Claim
from upcycle.study.curves import Results, train_rows_at_end

FAMILY = 'llama'
LONG_RUN = ("the paper's gap opens over 100B+ tokens; these arms read 0.4M tokens after the "
            'upcycling point')

CLAIMS = [
    Claim(FAMILY, 'naive upcycling starts ahead of Drop r=0.5 (at the upcycling point)',
          'naive upcycling starts ahead; the curves cross later', 'moe', 'drop_0.5', 'loss',
          'better', where='start'),
    Claim(FAMILY, 'Drop r=0.5 ends ahead of naive upcycling',
          '8x152M: 19.7 vs 17.9; 8x1.5B: 40.3 vs 37.4 average score', 'drop_0.5', 'moe',
          'loss', 'better', if_not=LONG_RUN),
    Claim(FAMILY, 'Drop r=0.5 ends ahead of the MoE from scratch',
          '8x3.7B: 44.4 vs 40.1 average score', 'drop_0.5', 'scratch', 'loss', 'better'),
    Claim(FAMILY, 'Drop r=0.5 ends ahead of r=1.0', '8x152M: 19.7 vs 18.9', 'drop_0.5',
          'drop_1.0', 'loss', 'better', if_not=LONG_RUN),
    Claim(FAMILY, 'Drop r=0.5 ends ahead of r=0.75', '8x1.5B: 40.3 vs 38.9', 'drop_0.5',
          'drop_0.75', 'loss', 'better', if_not=LONG_RUN),
    Claim(FAMILY, 'random noise upcycling ends ahead of naive upcycling',
          'RNU between naive and Drop (8x152M)', 'noise', 'moe', 'loss', 'better',
          if_not=LONG_RUN),
    Claim(FAMILY, 'Drop r=0.5 ends ahead of random noise upcycling',
          'RNU between naive and Drop (8x152M)', 'drop_0.5', 'noise', 'loss', 'better',
          if_not=LONG_RUN),
    Claim(FAMILY, 'with a constant learning rate, Drop r=0.5 still ends ahead of naive',
          "the paper has no constant-learning-rate control (its limitations)",
          'drop_0.5_constant_lr', 'moe_constant_lr', 'loss', 'better', if_not=LONG_RUN),
    Claim(FAMILY, 'naive upcycling: the load-balancing loss per layer matches the pooled one',
          '8x1.5B, 40B tokens: no clear effect', 'moe_layerwise_balance', 'moe', 'loss',
          'same'),
    Claim(FAMILY, 'Drop r=0.5: the load-balancing loss per layer matches the pooled one',
          '8x1.5B, 40B tokens: no clear effect', 'drop_0.5_layerwise_balance', 'drop_0.5',
          'loss', 'same'),
    Claim(FAMILY, 'router U(-0.0346, 0.0346) matches N(0, 0.02)', '8x1.5B: 32.3 vs 32.1',
          'moe', 'router_normal', 'loss', 'same'),
    Claim(FAMILY, 'router U(-0.0346, 0.0346) ends ahead of N(0, 0.2887)',
          '8x1.5B: 32.3 vs 31.3', 'moe', 'router_normal_wide', 'loss', 'better'),
    Claim(FAMILY, "per-matrix indices (the official code) match the paper's shared ones",
          'not compared in the paper', 'drop_0.5_per_matrix', 'drop_0.5', 'loss', 'same'),
]

CURVE_ARMS = {'moe': 'naive upcycling', 'drop_0.25': 'Drop r=0.25', 'drop_0.5': 'Drop r=0.5',
              'drop_0.75': 'Drop r=0.75', 'drop_1.0': 'Drop r=1.0',
              'drop_0.5_per_matrix': 'Drop r=0.5, per-matrix indices',
              'noise': 'random noise upcycling', 'scratch': 'MoE from scratch',
              'dense': 'dense continued'}
CONTROL_ARMS = {'moe': 'naive, cosine', 'drop_0.5': 'Drop r=0.5, cosine',
                'moe_constant_lr': 'naive, constant', 'drop_0.5_constant_lr':
                'Drop r=0.5, constant'}
USAGE_ARMS = ('moe', 'drop_0.5', 'moe_layerwise_balance', 'drop_0.5_layerwise_balance',
              'noise', 'scratch', 'router_normal_wide')


def crossover(results: Results, a: str = 'drop_0.5', b: str = 'moe') -> Optional[Dict]:
  """d(step) = b's loss - a's at every evaluation both runs of every seed have, `[evals]`
  mean and s.e., and the first step from which d > 2 s.e. to the end (None: never)."""
  if not (results.has(FAMILY, a) and results.has(FAMILY, b)):
    return None
  ca, cb = results.curves(FAMILY, a), results.curves(FAMILY, b)
  n = min(len(c.steps) for c in ca + cb)
  d = np.array([y.loss[:n] - x.loss[:n] for x, y in zip(ca, cb)]).T   # [evals, seeds]
  mean, se = d.mean(1), claims.standard_error(d, axis=1)
  ahead = mean > 2 * se
  first = None
  for i in range(n - 1, -1, -1):
    if not ahead[i]:
      break
    first = int(ca[0].steps[i])
  return {'steps': ca[0].steps[:n], 'mean': mean, 'se': se, 'ahead_from': first}


def layer_usage(run_dir: str, window: float = 0.1) -> Dict[str, float]:
  """{layer path: mean effective experts over the last `window` of the run's logged steps}."""
  kept = train_rows_at_end(run_dir, window)
  keys = sorted({k for r in kept for k in r if k.endswith('/effective_experts')},
                key=lambda k: int(k.split('layers_')[1].split('/')[0]) if 'layers_' in k else 0)
  return {k[len('moe/'):-len('/effective_experts')]: float(np.mean([r[k] for r in kept]))
          for k in keys}


def usage(results: Results) -> Dict[str, Dict[str, np.ndarray]]:
  """{arm: {layer: `[seeds]` effective experts at the run's end}} for the arms that ran."""
  out = {}
  for arm in USAGE_ARMS:
    if not results.has(FAMILY, arm):
      continue
    per_seed = [layer_usage(os.path.join(results.runs_dir, FAMILY, arm, f'seed{s}'))
                for s in results.seeds]
    out[arm] = {layer: np.array([u[layer] for u in per_seed]) for layer in per_seed[0]}
  return out


def tokens_per_expert(results: Results) -> Optional[Dict[str, float]]:
  """Naive upcycling's token slots per expert per step: the mean (batch x length x k / E) and
  the logged fewest and most of any expert in any layer over its last 10% of steps."""
  if not results.has(FAMILY, 'moe'):
    return None
  run_dir = os.path.join(results.runs_dir, FAMILY, 'moe', f'seed{results.seeds[0]}')
  kept = train_rows_at_end(run_dir)
  low = min(v for r in kept for k, v in r.items() if k.endswith('tokens_per_expert_min'))
  high = max(v for r in kept for k, v in r.items() if k.endswith('tokens_per_expert_max'))
  position = epochs_lib.data_position(run_dir)
  length = position['pipeline']['length']
  tokens = position['batch_size'] * length
  return {'tokens_per_step': tokens, 'sequence_length': length, 'mean': tokens * 2 / 8,
          'fewest': low, 'most': high}


COLLAPSED = 2.5   # effective experts at or under which a layer counts as collapsed onto two


def routing_rows(usage_by_arm: Dict[str, Dict[str, np.ndarray]]) -> List[claims.Row]:
  """The paper's routing claim as two verdicts from the experts each layer uses (`usage`):
  naive upcycling with pooled balancing collapses onto two experts in every layer (yes when
  every layer's mean over seeds is at most COLLAPSED), and Drop r=0.5 uses more experts than
  naive (the layers' mean, paired by seed, by the 2 s.e. rule)."""
  paper = ('naive upcycling with global balancing collapses onto two experts in all layers; '
           "Drop-Upcycling's routing specializes")
  if 'moe' not in usage_by_arm:
    return [claims.Row('naive upcycling collapses onto two experts in every layer', paper,
                       claims.NOT_FINISHED, '—')]
  naive = np.array(list(usage_by_arm['moe'].values()))          # [layers, seeds]
  layer_means = naive.mean(1)
  rows = [claims.Row(
      'naive upcycling collapses onto two experts in every layer (effective experts <= '
      f'{COLLAPSED})', paper, 'per layer ' + ', '.join(f'{m:.2f}' for m in layer_means),
      'yes' if (layer_means <= COLLAPSED).all() else 'no')]
  if 'drop_0.5' in usage_by_arm:
    drop = np.array(list(usage_by_arm['drop_0.5'].values())).mean(0)   # [seeds]
    d = drop - naive.mean(0)
    rows.append(claims.Row(
        'Drop r=0.5 routes over more experts than naive upcycling (mean over layers)', paper,
        claims.describe('drop_0.5', drop, 'moe', naive.mean(0), d),
        claims.verdict(d, 'better')))
  return rows


def summary(results: Results, scale) -> Optional[Dict[str, object]]:
  """Everything the section shows; None before the dense Llama finished."""
  if not results.has(FAMILY, 'pretrain'):
    return None
  used = usage(results)
  return {
      'plateau': regime.plateau(results, scale, family=FAMILY, arm='pretrain',
                                steps=scale.llama_pretrain_steps,
                                eval_every=scale.llama_eval_every),
      'claims': [c.row(results) for c in CLAIMS] + routing_rows(used),
      'crossover': crossover(results),
      'usage': used,
      'tokens_per_expert': tokens_per_expert(results),
  }
