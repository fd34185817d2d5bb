"""Routing health of an MoE run: did its routers learn to route?

Every training row of an MoE run's metrics.jsonl carries, per MoE layer, what the layer sows
(`upcycle.moe.layer`): `moe/<layer>/router_top1_probability` (the mean over the routed tokens
of the largest router probability, the softmax over the experts of each token's logits: the
same quantity for Top-K and Expert Choice routers, which both route from that softmax),
`fraction_dropped_tokens` (the fraction of tokens no expert took: unrouted) and
`effective_experts` (exp of the entropy of the experts' shares of the routed tokens); and
`router_kernel_rms` (`step.router_kernel_rms`, of the params the step read, before its
update: the first training row, logged at the run's first step, has the RMS of the router the
run started from, initialized or upcycled). Each MoE layer's expert spread (`expert_spread`):
how far apart its experts are, which is what a router can learn to tell apart, of the params
the run started from (the first training row's `moe/<layer>/expert_spread`) and of the trained
params at the end.

At the end of the run the trainer writes one row `{'step', 'split': 'routing_health',
'routers_learned', 'criterion', 'layers': {layer: {...}}}` to metrics.jsonl (`health`, over
the training rows of the last `WINDOW` of the run's steps), and the run's closing lines show it
(`run_summary`). The study marks the numbers of a run whose routers did not learn.

The criterion (`routers_learned`): the top-1 router probability is at least `LEARNED_RATIO`
(1.5) times uniform, 1.5 / E, in every MoE layer. A router that learned nothing gives every
token about 1 / E: the tiny T5 MoE from scratch with the 0.02 router init ended 300 steps at
0.156 and 0.158 in two of its four layers at E = 8 (uniform 0.125; 0.300 to 0.439 with the
width-scaled init; docs/moe.md, "Router initialization").

The expert spread of a layer is ||W - mean_e W|| / ||mean_e W|| over all its experts'
parameters (`W[e]` every leaf under `expert`, `[E, ...]`; the mean over the experts broadcast
to each): 0 when every expert is the same (upcycled copies, before training separates them),
about sqrt(E - 1) for experts drawn independently around zero (an MoE from scratch: 2.65 at
E = 8). Over identical experts which expert a token goes to changes nothing, so the task loss
cannot teach a router which expert suits a token: the main job's upcycled experts, copies at
step 200, were 0.066-0.089 apart at its end, step 500 (0.03-0.04 at step 300).
"""

import math
from typing import Any, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import tree
from upcycle.models import scan_layout

SPLIT = 'routing_health'              # the metrics.jsonl row's split
LEARNED_RATIO = 1.5                   # top-1 probability >= 1.5 / E in every layer
WINDOW = 0.1                          # the last 10% of the run's steps
CRITERION = (f'top-1 router probability >= {LEARNED_RATIO} x uniform (1/E) in every MoE layer, '
             f'mean over the training rows of the last {WINDOW:.0%} of the steps')


def expert_spread(params: Any, model_config: Any) -> Dict[str, jax.Array]:
  """{'encoder/layers_1/mlp': ||W - mean_e W|| / ||mean_e W||} of every MoE layer of `params`
  (a float32 scalar each; W: the layer's expert leaves `[E, ...]`), per layer whether or not
  the model scans its layers."""
  experts = scan_layout.per_layer(
      {p: v for p, v in tree.flatten(params).items() if tree.EXPERT in p.split('/')},
      model_config)
  apart, mean_norm = {}, {}
  for path, role in tree.classify(experts).items():
    w = experts[path].astype(jnp.float32)
    mean = jnp.mean(w, axis=0, keepdims=True)
    apart[role.layer] = apart.get(role.layer, 0.0) + jnp.sum(jnp.square(w - mean))
    mean_norm[role.layer] = mean_norm.get(role.layer, 0.0) + w.shape[0] * jnp.sum(
        jnp.square(mean))
  return {layer: jnp.sqrt(apart[layer] / mean_norm[layer]) for layer in apart}


def rows_at_end(rows: Sequence[Mapping], window: float = WINDOW) -> list:
  """The training rows (`rows`, in step order) of the last `window` of the steps from the
  first row's to the last's."""
  first, last = rows[0]['step'], rows[-1]['step']
  return [r for r in rows if r['step'] > last - window * (last - first + 1)]


def health(rows: Sequence[Mapping], num_experts: Mapping[str, int],
           spread: Optional[Mapping[str, float]] = None) -> Optional[dict]:
  """The routing-health row of a run from its metrics.jsonl `rows`; None without MoE layers
  (`num_experts`: {layer: E}) or training rows.

  Per layer: top1_probability, unrouted_fraction and effective_experts (means over the rows of
  the last `WINDOW`), uniform_probability 1 / E, num_experts, router_kernel_rms (the last row's)
  and router_kernel_rms_at_init (the first training row's: the params before the run's first
  update), expert_spread (`spread`, {layer: `expert_spread` of the trained params}) and
  expert_spread_at_init (the first training row's `moe/<layer>/expert_spread`: of the params
  the run started from); a quantity the rows do not carry (a run logged before it was) is None.
  """
  train = [r for r in rows if r.get('split') == 'train']
  if not num_experts or not train:
    return None
  end = rows_at_end(train)

  def mean(layer: str, name: str) -> Optional[float]:
    values = [r[f'moe/{layer}/{name}'] for r in end if f'moe/{layer}/{name}' in r]
    return float(np.mean(values)) if values else None

  layers = {}
  for layer, experts in sorted(num_experts.items()):
    rms = f'moe/{layer}/router_kernel_rms'
    layers[layer] = {
        'top1_probability': mean(layer, 'router_top1_probability'),
        'uniform_probability': 1.0 / experts, 'num_experts': int(experts),
        'unrouted_fraction': mean(layer, 'fraction_dropped_tokens'),
        'effective_experts': mean(layer, 'effective_experts'),
        'router_kernel_rms': end[-1].get(rms), 'router_kernel_rms_at_init': train[0].get(rms),
        'expert_spread': (spread or {}).get(layer),
        'expert_spread_at_init': train[0].get(f'moe/{layer}/expert_spread')}
  learned = all(h['top1_probability'] is not None
                and h['top1_probability'] >= LEARNED_RATIO * h['uniform_probability']
                for h in layers.values())
  return {'step': int(train[-1]['step']), 'split': SPLIT, 'routers_learned': learned,
          'criterion': CRITERION, 'layers': layers}


def lines(row: Mapping) -> list:
  """The routing-health row as text lines, one per layer after a verdict line."""
  verdict = 'routers learned' if row['routers_learned'] else 'ROUTERS DID NOT LEARN'
  out = [f'{verdict} ({row["criterion"]})']
  fmt = lambda v, spec: '?' if v is None or (isinstance(v, float) and math.isnan(v)) else (
      format(v, spec))
  for layer, h in row['layers'].items():
    out.append(f'{layer}: top-1 {fmt(h["top1_probability"], ".3f")} (uniform '
               f'{h["uniform_probability"]:.3f}), unrouted {fmt(h["unrouted_fraction"], ".1%")}, '
               f'effective experts {fmt(h["effective_experts"], ".2f")} of {h["num_experts"]}, '
               f'router kernel RMS {fmt(h["router_kernel_rms"], ".4f")} (at init '
               f'{fmt(h["router_kernel_rms_at_init"], ".4f")})'
               + ('' if h.get('expert_spread') is None else
                  f', expert spread {h["expert_spread"]:.3f}')
               + ('' if h.get('expert_spread_at_init') is None else
                  f' (at init {h["expert_spread_at_init"]:.3f})'))
  return out


def of_run(rows: Sequence[Mapping]) -> Optional[dict]:
  """The last routing-health row among a run's metrics.jsonl `rows`; None if it has none (a
  dense run, or one trained before runs wrote it)."""
  found = [r for r in rows if r.get('split') == SPLIT]
  return found[-1] if found else None
