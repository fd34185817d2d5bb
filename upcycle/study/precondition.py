"""The precondition of every upcycling claim: the MoE from scratch against the dense model from
scratch at equal training FLOPs (the `precondition` suite).

Upcycling bets that the MoE architecture is worth its FLOPs; where an MoE trained from scratch
does not beat a dense model trained from scratch for the same compute, no upcycling recipe can
make that bet pay. Per family, two runs from scratch, each with one learning-rate schedule over
its own length:

  T5     dense: `regime_pretrain` continued by `regime_dense` to 2P steps (the same step
         counter, rsqrt schedule and optimizer state, the data read on: one dense run from
         scratch, whose curve from P on is `regime_dense`'s); MoE: `regime_scratch`, the
         upcycling claims' architecture for the FLOPs of 2P dense steps (`runs.regime_runs`).
  Llama  dense: `pretrain` (P steps, warmup and cosine over P); MoE: `precondition_scratch`,
         the Mixtral for the FLOPs of those P steps (`drop_runs`, which says why).

Each seed's pair is read where both reached the same training FLOPs, at the largest FLOPs both
reached (the run that ended first ends there): like the claims at equal total FLOPs
(`Results.at_common_flops`), the mean of both curves, interpolated on the total-FLOPs axis, at
that run's last `final_window` evaluations. d = dense's loss - the MoE's (> 0 when the MoE is
better), paired by seed; the verdict that the MoE is better by the 2 s.e. rule
(`claims.verdict`). Beside it, each MoE run's routing health (its `routing_health` row).

T5 is read a second time at half the budget, where `regime_pretrain` ended (`EARLY`): its rsqrt
schedule does not depend on a run's length, so every point of both runs' curves is a run of
that length, and at half the budget no seed's loss has begun the late drop that makes the
seeds part by 3,000 steps (docs/study.md).
"""

from typing import Dict, Optional

import numpy as np

from upcycle.study import claims, drop_runs
from upcycle.study.curves import Results

# {family: (dense arm read, MoE arm)}; the dense T5's curve from P on is `regime_dense`'s.
PAIRS = {'t5': ('regime_dense', 'regime_scratch'),
         'llama': ('pretrain', drop_runs.PRECONDITION_SCRATCH)}
# {family: a dense arm that ends earlier, read against the same MoE run where it ended}: only
# schedules that do not depend on a run's length (T5's rsqrt) make such a point a run of its own.
EARLY = {'t5': 'regime_pretrain'}
# {family: the suite's arms}: the runs it trains.
ARMS = {'t5': ('regime_pretrain', 'regime_dense', 'regime_scratch'),
        'llama': ('pretrain', drop_runs.PRECONDITION_SCRATCH)}


def compare(results: Results, family: str, dense: Optional[str] = None
            ) -> Optional[Dict[str, object]]:
  """The family's pair at equal FLOPs (`dense`: the dense arm read, by default `PAIRS`'s);
  None before both arms finished for every seed.

  Returns {'dense', 'moe': the arms; 'dense_loss', 'moe_loss', 'd': `[seeds]` (d > 0 when the
  MoE is better); 'flops': `[seeds]` the largest training FLOPs both runs reached; 'ended':
  per seed the arm that ended there; 'verdict'; 'routing': per seed the MoE run's
  routing-health row as of the step read (`Results.routing_health`), or None}.
  """
  dense, moe = dense or PAIRS[family][0], PAIRS[family][1]
  if not (results.has(family, dense) and results.has(family, moe)):
    return None
  dense_loss, moe_loss = results.at_common_flops(family, dense, moe, 'loss')
  points = [results.common_points(family, dense, moe, s) for s in results.seeds]
  d = claims.paired(moe_loss, dense_loss, 'loss')
  return {'dense': dense, 'moe': moe, 'dense_loss': dense_loss, 'moe_loss': moe_loss, 'd': d,
          'flops': np.array([float(x[-1]) for x, _ in points]), 'ended': [arm for _, arm in points],
          'verdict': claims.verdict(d, 'better'),
          'routing': [results.routing_health(family, moe, s, until_step=_step_at(
              results.curve(family, moe, s), x[-1])) for s, (x, _) in zip(results.seeds, points)]}


def _step_at(curve, flops: float) -> float:
  """The step of `curve`'s run at which its total training FLOPs reached `flops`."""
  return float(np.interp(flops, curve.total_flops, curve.steps))


def summary(results: Results) -> Dict[str, Optional[Dict[str, object]]]:
  """{family: `compare`} for T5 and the Llama, and {'early': {family: `compare` with the
  `EARLY` dense arm}}."""
  return {**{family: compare(results, family) for family in PAIRS},
          'early': {family: compare(results, family, dense=arm) for family, arm in EARLY.items()}}
