"""Drop-Upcycling's unit statistics, measured on a real dense checkpoint's MLP.

A unit u of an expert is untouched when its column of every input projection and its row of
the output projection equal the dense MLP's. With one index set per expert ('shared') a
fraction 1 - r of units is untouched exactly and two experts share (1 - r)^2 of them in
expectation; with a set per matrix ('per_matrix') only (1 - r)^m are untouched in expectation,
m = the number of matrices (3 for T5's gated MLP).
"""

from typing import Dict, List, Mapping

import jax
import numpy as np

from upcycle import checkpoints, tree
from upcycle.upcycling import ffn
from upcycle.upcycling.experts import Drop


def untouched(dense: Mapping[str, np.ndarray], experts: Mapping[str, np.ndarray],
              layer: str) -> np.ndarray:
  """`[E, d_ff]` True where a unit of an expert equals the dense unit in every matrix."""
  axes = ffn.d_ff_axes({n: np.shape(x) for n, x in dense.items()}, layer)
  same = None
  for name, axis in axes.items():
    if axis is None:
      continue
    equal = np.asarray(experts[name]) == np.asarray(dense[name])[None]
    other = tuple(a + 1 for a in range(np.ndim(dense[name])) if a != axis)
    unit = equal.all(axis=other)          # [E, d_ff]
    same = unit if same is None else same & unit
  return same


def statistics(checkpoint: str, layer: str, num_experts: int, ratios, seed: int = 0
               ) -> List[Dict[str, float]]:
  """Per ratio and index sharing: measured vs expected untouched and pairwise-shared units."""
  params = checkpoints.load(checkpoint).params
  prefix = layer + '/'
  mlp = {k[len(prefix):]: v for k, v in tree.flatten(params).items() if k.startswith(prefix)}
  if not mlp:
    raise ValueError(f'{checkpoint} has no parameters under {layer!r}.')
  m = len({ffn.matrix_of(n) for n, a in ffn.d_ff_axes(
      {n: np.shape(x) for n, x in mlp.items()}, layer).items() if a is not None})
  out = []
  for sharing in ('shared', 'per_matrix'):
    for r in ratios:
      experts = Drop(ratio=r, index_sharing=sharing)(mlp, num_experts, jax.random.PRNGKey(seed),
                                                     layer=layer)
      kept = untouched(mlp, experts, layer)               # [E, d_ff]
      pairs = [(kept[i] & kept[j]).mean() for i in range(num_experts)
               for j in range(i + 1, num_experts)]
      keep = 1 - r
      out.append({'index_sharing': sharing, 'ratio': r,
                  'untouched': float(kept.mean()),
                  'untouched_expected': keep if sharing == 'shared' else keep ** m,
                  'shared_by_two': float(np.mean(pairs)),
                  'shared_by_two_expected': keep ** 2 if sharing == 'shared' else keep ** (2 * m)})
  return out

