"""Experts from several dense checkpoints: Branch-Train-MiX and UpIT.

These initializers change the non-expert parameters too (averaged across the
sources, or taken from one of them): a plan copies its shared leaves from
`init.shared_params()` and makes the experts with the initializer itself, which reads
its sources. `combine` builds one from loaded checkpoints, as the restore hook and
`python -m upcycle.convert` both do. The sources may be lazy (`checkpoints.LazyArray`):
a shared leaf is averaged when it is read, so a conversion streams leaf by leaf.
"""

import copy
import dataclasses
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple,
                    Union)

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import checkpoints, tree
from upcycle.checkpoints.lazy import LazyArray
from upcycle.upcycling.base import Array, ExpertInit, as_array, check_choice, draw, key_for


def mean_leaf(leaves: Sequence[Any]) -> Array:
  """Elementwise mean, computed as x0 + sum(xi - x0) / n in float32.

  Written around the first source so that identical sources give back x0
  bit for bit (a plain sum / n would round).
  """
  first = as_array(leaves[0])
  if not jnp.issubdtype(first.dtype, jnp.floating):
    for i, leaf in enumerate(leaves[1:], 1):
      if not np.array_equal(np.asarray(leaf), np.asarray(first)):
        raise ValueError(f'non-float leaf differs between source 0 and source {i}; '
                         f'it cannot be averaged.')
    return first
  x0 = first.astype(jnp.float32)
  delta = sum(as_array(leaf).astype(jnp.float32) - x0 for leaf in leaves[1:])
  return (x0 + delta / len(leaves)).astype(first.dtype)


class MultiSource(ExpertInit):
  """Experts from several sources; also decides the shared (non-expert) params.

  A plan source: the plan copies the shared leaves from `shared_params()`, and the
  experts read the sources themselves (on the host: not traceable).
  """

  traceable = False

  sources: Sequence[Mapping]
  base: Optional[int]

  def _prepare(self):
    if not self.sources:
      raise ValueError(f'{type(self).__name__}: needs at least one source param tree.')
    flats = [tree.flatten(s) for s in self.sources]
    ref = flats[0]
    for i, flat in enumerate(flats[1:], 1):
      missing, extra = sorted(set(ref) - set(flat)), sorted(set(flat) - set(ref))
      if missing or extra:
        where = (f'{missing[0]} is in source 0 but not in source {i}' if missing else
                 f'{extra[0]} is in source {i} but not in source 0')
        raise ValueError(f'{type(self).__name__}: {where}. All sources must be checkpoints of '
                         f'the same dense architecture.')
      for path, leaf in ref.items():
        other = flat[path]
        if tree.shape_of(leaf) != tree.shape_of(other) or leaf.dtype != other.dtype:
          raise ValueError(
              f'{type(self).__name__}: {path} is {tree.shape_of(leaf)} {leaf.dtype} in source 0 '
              f'but {tree.shape_of(other)} {other.dtype} in source {i}. All sources must be '
              f'checkpoints of the same dense architecture.')
    if self.base is not None and not 0 <= self.base < len(flats):
      raise ValueError(f'{type(self).__name__}.base={self.base}: there are {len(flats)} sources.')
    object.__setattr__(self, '_flats', flats)

  def shared_params(self) -> Dict[str, Any]:
    """The non-expert params: source `base`, or the mean of all sources (`mean_leaf`; a
    float leaf is averaged lazily, when it is read; other leaves are compared now)."""
    flats = self._flats
    if self.base is not None:
      return tree.unflatten(dict(flats[self.base]))
    out = {}
    for path, first in flats[0].items():
      leaves = [flat[path] for flat in flats]
      if jnp.issubdtype(first.dtype, jnp.floating):
        out[path] = LazyArray(tree.shape_of(first), first.dtype,
                              lambda leaves=leaves: np.asarray(mean_leaf(leaves)),
                              f'the mean of {len(flats)} sources', path)
        continue
      try:
        out[path] = mean_leaf(leaves)
      except ValueError as e:
        raise ValueError(f'{type(self).__name__}: {path}: {e} Fix: pick one with '
                         f'base=<index>.') from e
    return tree.unflatten(out)

  def _source_mlp(self, index: int, names, layer: str) -> Dict[str, Any]:
    flat = self._flats[index]
    out = {}
    for name in names:
      path = tree.join(layer, name)
      if path not in flat:
        raise ValueError(f'{type(self).__name__}: source {index} has no leaf {path}.')
      out[name] = flat[path]
    return out

  def describe_shared(self) -> str:
    if self.base is not None:
      return f'source {self.base}'
    return f'mean of {len(self._flats)} sources'


@dataclasses.dataclass(frozen=True, eq=False)
class FromCheckpoints(MultiSource):
  """Branch-Train-MiX: expert e is the dense MLP of checkpoint `assignment[e]`.

  From E identical sources this equals Copy exactly (experts and, through
  `mean_leaf`, the shared params).

  Attributes:
    sources: dense param trees of one architecture (e.g. the branches).
    assignment: source index of each expert, length E. None: expert e from
      source e (needs len(sources) == E).
    base: source index for the non-expert params; None averages all sources.
  """

  sources: Sequence[Mapping]
  assignment: Optional[Sequence[int]] = None
  base: Optional[int] = None

  def __post_init__(self):
    self._prepare()
    if self.assignment is not None:
      object.__setattr__(self, 'assignment', tuple(int(a) for a in self.assignment))
      bad = [a for a in self.assignment if not 0 <= a < len(self.sources)]
      if bad:
        raise ValueError(f'FromCheckpoints.assignment={self.assignment}: index {bad[0]} is out '
                         f'of range for {len(self.sources)} sources.')

  def __repr__(self):
    return (f'FromCheckpoints({len(self.sources)} sources, assignment={self.assignment}, '
            f'base={self.base})')

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    del rng
    assignment = self.assignment
    if assignment is None:
      assignment = tuple(range(len(self.sources)))
    if len(assignment) != num_experts:
      raise ValueError(
          f'FromCheckpoints: the MoE block at {layer} has {num_experts} experts but the '
          f'assignment names {len(assignment)} ({assignment}). Fix: pass assignment=<one '
          f'source index per expert>.')
    per_source = {a: self._source_mlp(a, mlp, layer) for a in set(assignment)}
    return {name: jnp.stack([as_array(per_source[a][name]) for a in assignment])
            for name in mlp}


def gram(pool: Sequence[Mapping[str, Array]]) -> np.ndarray:
  """float64 `[k, k]`: the inner products of k experts' flattened MLPs (`{name: array}` each,
  the same names), computed in float32."""
  names = sorted(pool[0])
  vectors = jnp.stack([jnp.concatenate([jnp.ravel(e[name]).astype(jnp.float32) for name in names])
                       for e in pool])
  return np.asarray(vectors @ vectors.T, np.float64)


def most_distant_pair(inner: np.ndarray, exclude: Set[Tuple[int, int]] = frozenset()
                      ) -> Tuple[int, int]:
  """(i, j), i < j, with the largest cosine distance 1 - <v_i, v_j> / (|v_i| |v_j|) among n
  vectors given by their inner products `inner` `[n, n]` (`gram`, or a sum of grams: the
  distance of the concatenated vectors).

  Pairs in `exclude` are skipped; ties go to the lowest (i, j).
  """
  norms = np.maximum(np.sqrt(np.maximum(np.diag(inner), 0.0)), 1e-30)
  distance = 1.0 - inner / np.outer(norms, norms)
  n = distance.shape[0]
  best, pair = -np.inf, None
  for i in range(n):
    for j in range(i + 1, n):
      if (i, j) not in exclude and distance[i, j] > best:
        best, pair = distance[i, j], (i, j)
  if pair is None:
    raise ValueError(f'No pair of {n} experts is left to merge.')
  return pair


def dare_merge(experts: Sequence[Mapping[str, Array]], base: Mapping[str, Array],
               drop_rate: float, rng: Array) -> Dict[str, Array]:
  """DARE (Drop And REscale) merge of several experts around their common base.

  For every leaf name: tau_i = theta_i - theta_base; each entry of each tau_i is
  dropped with probability p = `drop_rate` and the kept ones are scaled by
  1 / (1 - p), so E[DARE(tau_i)] = tau_i; the merge is
  theta_base + mean_i DARE(tau_i). Experts equal to the base merge back to the
  base exactly, for any p and rng.

  Args:
    experts: per expert `{name: array}` (one MLP), all with the same names and shapes.
    base: `{name: array}`, the MLP of the model the experts were fine-tuned from.
    drop_rate: p in [0, 1).
    rng: key of the drop masks.
  Returns:
    `{name: float32 array}`.
  """
  names = sorted(base)
  keep = 1.0 - drop_rate
  shapes = [tuple(base[name].shape) for name in names] * len(experts)
  uniform = draw(rng, shapes, jax.random.uniform)
  out = {}
  for j, name in enumerate(names):
    theta_base = as_array(base[name]).astype(jnp.float32)
    total = jnp.zeros_like(theta_base)
    for i, expert in enumerate(experts):
      delta = as_array(expert[name]).astype(jnp.float32) - theta_base
      total = total + jnp.where(uniform[i * len(names) + j] < keep, delta / keep, 0.0)
    out[name] = theta_base + total / len(experts)
  return out


PAIR_SCOPES = ('layer', 'model')


@dataclasses.dataclass(frozen=True, eq=False)
class Merge(MultiSource):
  """UpIT expert expansion: more experts than sources, by merging.

  Experts 0..n-1 are the MLPs of the n sources (e.g. intermediate checkpoints
  of one run). While there are fewer than E, the two experts whose flattened
  MLPs are most different (cosine distance) are merged into a new expert, which
  joins the pool. A pair is merged at most once, so that 'average' does not
  produce the same expert twice. `pair_scope` says over what the distance is
  taken, and so whether expert k >= n is one pair's merge in every MoE layer:

  - 'layer': each MoE layer picks its own pairs from its own pool, so expert k
    may merge different pairs in different layers.
  - 'model': the pairs are picked once for the whole model, by the cosine
    distance of the experts' MLPs of every MoE layer flattened together
    (1 - sum_l <a_l, b_l> / sqrt(sum_l |a_l|^2 sum_l |b_l|^2), a merged expert
    being its merge in every layer); expert k merges the same pair everywhere.
    Picking reads every MoE layer's MLP of every source once per merged expert
    (merging again the experts merged before), before the first block is made.

  In both, the merge of expert k at a layer draws its DARE masks from that
  layer's key (`base.key_for(layer key, str(k))`), so the two scopes give the
  same expert wherever they pick the same pair.

  Attributes:
    sources: dense param trees of one architecture.
    method: 'average' ((a + b) / 2) or 'dare' (`dare_merge` of a and b around
      `dare_base`: each entry of the deltas a - base, b - base is dropped with
      probability `drop_rate`, the kept ones rescaled by 1 / (1 - drop_rate);
      base + their mean).
    drop_rate: DARE's p in [0, 1).
    base: source index for the non-expert params; None averages all sources.
    dare_base: for 'dare', the model the sources were fine-tuned from (UpIT: the
      pre-trained model before instruction tuning): a dense param tree of the
      same architecture, or a checkpoint path (read with
      `upcycle.checkpoints.load`).
    pair_scope: 'layer' (each MoE layer picks its pairs) or 'model' (one pair
      per merged expert for all MoE layers); see above.
  """

  sources: Sequence[Mapping]
  method: str = 'average'
  drop_rate: float = 0.5
  base: Optional[int] = None
  dare_base: Union[None, str, Mapping] = None
  pair_scope: str = 'layer'

  def __post_init__(self):
    check_choice(self.method, ('average', 'dare'), 'sources.Merge.method')
    check_choice(self.pair_scope, PAIR_SCOPES, 'sources.Merge.pair_scope')
    if not 0.0 <= self.drop_rate < 1.0:
      raise ValueError(f'Merge.drop_rate={self.drop_rate}: must be in [0, 1).')
    if self.method == 'dare' and self.dare_base is None:
      raise ValueError(
          "Merge(method='dare') merges deltas from the model the sources were fine-tuned from, "
          'and none was given. Fix: sources.Merge.dare_base = \'<checkpoint path>\' (gin) or '
          "dare_base=<param tree>; or method='average'.")
    self._prepare()
    if self.method == 'dare':
      base = self.dare_base
      if isinstance(base, str):
        base = checkpoints.load(base, lazy=True, with_optimizer_state=False).params
      object.__setattr__(self, '_dare_base', tree.flatten(base))
    object.__setattr__(self, '_layers', None)        # for_layers: the MoE layers
    object.__setattr__(self, '_experts_rng', None)   # for_key: every layer's key comes from it
    object.__setattr__(self, '_picked', {})   # 'model': (key, layers, E, names) -> pairs

  def __repr__(self):
    return (f'Merge({len(self.sources)} sources, method={self.method!r}, '
            f'drop_rate={self.drop_rate}, base={self.base}'
            + (', dare_base given' if self.method == 'dare' else '')
            + (f', pair_scope={self.pair_scope!r})' if self.pair_scope != 'layer' else ')'))

  def for_layers(self, positions):
    """This Merge with the plan's MoE layers (over which 'model' picks its pairs)."""
    bound = copy.copy(self)
    object.__setattr__(bound, '_layers', tuple(positions))
    return bound

  def for_key(self, rng):
    """This Merge with the experts' key (every layer's is `key_for(rng, layer)`), which
    'model' needs to merge in every layer while it picks; self for 'layer'."""
    if self.pair_scope == 'layer':
      return self
    bound = copy.copy(self)
    object.__setattr__(bound, '_experts_rng', rng)
    return bound

  def _base_mlp(self, names, layer: str) -> Dict[str, Any]:
    out = {}
    for name in names:
      path = tree.join(layer, name)
      if path not in self._dare_base:
        raise ValueError(f'Merge: dare_base has no leaf {path}; it must be a checkpoint of the '
                         f'sources\' dense architecture.')
      leaf = self._dare_base[path]
      expected = tree.shape_of(self._flats[0][path])
      if tree.shape_of(leaf) != expected:
        raise ValueError(f'Merge: dare_base {path} is {tree.shape_of(leaf)}; the sources have '
                         f'{expected}.')
      out[name] = leaf
    return out

  def _merge(self, a: Dict[str, Array], b: Dict[str, Array], rng: Array,
             layer: str) -> Dict[str, Array]:
    if self.method == 'average':
      return {name: (a[name] + b[name]) / 2 for name in a}
    return dare_merge([a, b], self._base_mlp(sorted(a), layer), self.drop_rate, rng)

  def _extend(self, pool: List[Dict[str, Array]], pair: Tuple[int, int], rng: Array,
              layer: str) -> None:
    """Appends the merge of `pool[i]`, `pool[j]` (`pair`), expert `len(pool)` of the layer
    whose key is `rng`."""
    i, j = pair
    pool.append(self._merge(pool[i], pool[j], key_for(rng, str(len(pool))), layer))

  def _pool(self, names: Sequence[str], layer: str, rng: Array,
            pairs: Sequence[Tuple[int, int]]) -> List[Dict[str, Array]]:
    """The layer's experts, float32 `{name: array}` each: the sources' MLPs, then the
    merges of `pairs` in order."""
    pool = []
    for index in range(len(self.sources)):
      source = self._source_mlp(index, names, layer)
      pool.append({name: as_array(source[name]).astype(jnp.float32) for name in names})
    for pair in pairs:
      self._extend(pool, pair, rng, layer)
    return pool

  def _model_pairs(self, names: Sequence[str], num_experts: int, layer: str
                   ) -> Tuple[Tuple[int, int], ...]:
    """'model': the pairs of experts n..E-1, by the distance over every MoE layer."""
    if self._layers is None or self._experts_rng is None or layer not in self._layers:
      raise ValueError(
          f"Merge(pair_scope='model') picks each merged expert's pair over every MoE layer, and "
          f'was called for {layer} without them. Fix: upcycle through the plan '
          f'(upcycle_from_checkpoints, the restore hook, convert), which gives them.')
    key = (np.asarray(jax.random.key_data(self._experts_rng)).tobytes(), self._layers,
           num_experts, tuple(names))
    if key not in self._picked:
      keys = {moe: key_for(self._experts_rng, moe) for moe in self._layers}
      pairs: List[Tuple[int, int]] = []
      while len(self.sources) + len(pairs) < num_experts:
        inner = sum(gram(self._pool(names, moe, keys[moe], pairs)) for moe in self._layers)
        pairs.append(most_distant_pair(inner, set(pairs)))
      self._picked[key] = tuple(pairs)
    return self._picked[key]

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    n = len(self.sources)
    if n > num_experts:
      raise ValueError(
          f'Merge: {n} sources but the MoE block at {layer} has only {num_experts} experts. '
          f'Fix: use FromCheckpoints with an assignment to pick sources.')
    names = sorted(mlp)
    if self.pair_scope == 'model':
      pool = self._pool(names, layer, rng, self._model_pairs(names, num_experts, layer))
    else:
      pool, pairs = self._pool(names, layer, rng, ()), set()
      while len(pool) < num_experts:
        pair = most_distant_pair(gram(pool), pairs)
        pairs.add(pair)
        self._extend(pool, pair, rng, layer)
    return {name: jnp.stack([e[name] for e in pool]).astype(mlp[name].dtype) for name in names}


def combine(ckpts: Sequence[checkpoints.Checkpoint], make: Callable[..., MultiSource], *,
            step: Any, names: Mapping[str, str]) -> Tuple[checkpoints.Checkpoint, MultiSource]:
  """Branch-Train-MiX / UpIT from loaded dense checkpoints (lazy ones stream).

  Args:
    ckpts: the sources, in order (expert e of FromCheckpoints comes from `ckpts[e]`).
    make: `make(sources=[params, ...])` -> the initializer (FromCheckpoints, Merge, or a
      partial of one with its other arguments).
    step: the step policy (`optimizer_state.counts.check`'d); 'keep' needs the sources at one step.
    names: what to call the step policy and `make` in errors: {'step': ..., 'experts': ...}.

  Returns:
    (one Checkpoint standing for all: the first's, with every path and their common step;
    the initializer).
  """
  steps = sorted({c.step for c in ckpts}, key=lambda s: -1 if s is None else s)
  if step == 'keep' and len(steps) > 1:
    raise ValueError(f'the source checkpoints are at different steps {steps}, so '
                     f"{names['step']} = 'keep' is ambiguous. Fix: set it to 'reset' or a "
                     f'number.')
  init = make(sources=[c.params for c in ckpts])
  if not isinstance(init, MultiSource):
    raise ValueError(f"{names['experts']}(sources=...) returned {init!r}; expected "
                     f'FromCheckpoints or Merge.')
  return dataclasses.replace(ckpts[0], path=', '.join(c.path for c in ckpts)), init
