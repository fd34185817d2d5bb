"""Expert initializers: how the E experts of an MoE block come from one dense MLP.

Every initializer maps the dense MLP of one layer, `{'wi_0/kernel': [d_model,
d_ff], ...}`, to expert leaves `{'wi_0/kernel': [E, d_model, d_ff], ...}`
(Granular: `[E, d_model, d_ff / G]`). Initializers from several dense
checkpoints (Branch-Train-MiX, UpIT) live in `sources.py`.

  Copy      Sparse Upcycling: every expert a copy
  Drop      Drop-Upcycling: copies with a fraction of d_ff units redrawn; the fraction is
            constant, a linear ramp over each stack's MoE layers, or given per layer
  Noise     copies plus Gaussian noise
  Random    from-scratch experts
  Partial   the first N experts copies, the others from scratch (as Random)
  Granular  fine-grained: each expert one of G slices of the dense FFN
  ZeroOutput  another initializer's experts with a zero output projection (shared experts)

Names for entry points: 'copy', 'drop', 'noise', 'random', 'partial', 'granular',
'zero_output' (see `get`).
"""

import dataclasses
import functools
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from upcycle.upcycling import ffn
from upcycle.upcycling.base import (Array, ExpertInit, as_array, check_choice, draw,
                                    from_registry, key_for, tile, unit_mask)
from upcycle.tree import shape_of
from upcycle.upcycling.sources import FromCheckpoints, Merge

__all__ = ['ExpertInit', 'Copy', 'Drop', 'Noise', 'Random', 'Partial', 'Granular',
           'ZeroOutput', 'FromCheckpoints', 'Merge', 'EXPERT_INITS', 'get']


def _tiled(mlp: Mapping[str, Array], num_experts: int) -> Dict[str, Array]:
  return {name: tile(as_array(x), num_experts) for name, x in mlp.items()}


def _unit_broadcast(mask: Array, ndim: int, axis: int) -> Array:
  """`[experts, d_ff]` -> broadcastable against an `[experts, ...]` leaf whose d_ff is `axis`."""
  shape = [1] * ndim
  shape[0], shape[axis] = mask.shape
  return mask.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Copy(ExpertInit):
  """Sparse Upcycling: every expert is an exact copy of the dense MLP."""

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    del rng, layer
    return _tiled(mlp, num_experts)


@jax.jit
def redraw(w: Array, mask: Array, z: Array) -> Array:
  """Replaces `w[mask]` per expert by draws from N(mean, std) of the replaced values.

  Args:
    w: `[experts, ...]`.
    mask: bool, broadcastable to `w`.
    z: standard normal samples of `w`'s shape.

  Returns:
    `w` with the masked entries of expert e set to mean_e + std_e * z, where
    mean_e and std_e (population) are those of expert e's masked entries: one
    scalar pair per expert and leaf. Unmasked entries are bit-identical to `w`.
  """
  mask = jnp.broadcast_to(mask, w.shape)
  x = w.astype(jnp.float32)
  axes = tuple(range(1, w.ndim))
  count = jnp.maximum(mask.sum(axes, keepdims=True), 1)
  mean = jnp.where(mask, x, 0).sum(axes, keepdims=True) / count
  std = jnp.sqrt(jnp.where(mask, (x - mean) ** 2, 0).sum(axes, keepdims=True) / count)
  return jnp.where(mask, (mean + std * z).astype(w.dtype), w)


_RATIO_FORMS = ("Fix: Drop.ratio is a float in [0, 1], 'linear:R_FIRST:R_LAST' (e.g. "
                "'linear:0.2:0.8'), or a mapping {layer index or MLP path: ratio} (e.g. "
                "{1: 0.2, 3: 0.5}).")


def _fraction(value, what: str) -> float:
  """`value` as a float in [0, 1]; else a ValueError that starts with `what`."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f'{what}: not a number. {_RATIO_FORMS}')
  if not 0.0 <= value <= 1.0:
    raise ValueError(f'{what}: must be in [0, 1]. {_RATIO_FORMS}')
  return float(value)


def _linear(ratio: str) -> Tuple[float, float]:
  """'linear:R_FIRST:R_LAST' -> (R_FIRST, R_LAST), each in [0, 1]."""
  kind, *ends = ratio.split(':')
  try:
    r_first, r_last = map(float, ends)
  except ValueError:
    r_first = r_last = None
  if kind != 'linear' or r_first is None:
    raise ValueError(f'Drop.ratio={ratio!r}: not a schedule. {_RATIO_FORMS}')
  return (_fraction(r_first, f'Drop.ratio={ratio!r}: R_FIRST={r_first}'),
          _fraction(r_last, f'Drop.ratio={ratio!r}: R_LAST={r_last}'))


def _check_ratio(ratio) -> None:
  if isinstance(ratio, str):
    _linear(ratio)
  elif isinstance(ratio, Mapping):
    if not ratio:
      raise ValueError(f'Drop.ratio={{}}: an empty mapping gives no layer a ratio. {_RATIO_FORMS}')
    for key, value in ratio.items():
      if isinstance(key, bool) or not isinstance(key, (int, str)) or key == '' or (
          isinstance(key, int) and key < 0):
        raise ValueError(f'Drop.ratio={ratio!r}: key {key!r} is neither a layer index (an int '
                         f">= 0) nor an MLP path ('encoder/layers_3/mlp'). {_RATIO_FORMS}")
      _fraction(value, f'Drop.ratio[{key!r}]={value!r}')
  else:
    _fraction(ratio, f'Drop.ratio={ratio!r}')


@dataclasses.dataclass(frozen=True)
class Drop(ExpertInit):
  """Drop-Upcycling (Nakamura et al., ICLR 2025), with an optional layer-wise ratio.

  Each expert starts as a copy, then `round(r * d_ff)` of its intermediate
  units are re-initialized, r the layer's ratio (`ratio_at`): their columns of
  the input projections (wi_0, wi_1 / Dense_0 and Dense_0's bias entries) and
  their rows of the output projection (wo / Dense_1). New values are drawn
  from a normal with the mean and std of the values they replace, one pair per
  expert and leaf.

  Attributes:
    ratio: r, in [0, 1] everywhere. 0 is Copy exactly; 1 re-draws whole FFNs
      with the dense weights' statistics. One of:
      - a float: the same r in every layer (the paper's Drop-Upcycling);
      - 'linear:R_FIRST:R_LAST': linear in the layer index i over the MoE
        layers of each stack (encoder, decoder; ViT's encoder), from R_FIRST at
        its first MoE layer i0 to R_LAST at its last i1: R_FIRST + (R_LAST -
        R_FIRST) * (i - i0) / (i1 - i0); R_FIRST where a stack has one MoE
        layer. Which layers are MoE comes from the upcycling plan
        (`for_layers`);
      - a mapping {layer index i or MLP path: r}: an explicit r per layer; an
        MLP path ('decoder/layers_3/mlp') overrides its index (3, in every
        stack). Every MoE layer needs one.
      Each MoE layer's stack and index come from the plan (`for_layers`): the model config's
      (`T5Config.moe_positions()`) where the entry point has one, else the names'
      (`tree.layer_positions`).
    index_sharing: 'shared': one index set per expert used by all matrices (as
      the paper writes it), so a fraction 1 - r of units stay intact.
      'per_matrix': an independent set per matrix (as the authors' released
      code does), so only (1 - r)^m of units stay intact in expectation, m = 3
      for T5's gated MLP, 2 for ViT. A bias follows its kernel's set.
    positions: ((MoE layer path, (stack, layer index)), ...) of every MoE layer, set by
      `for_layers` (the plan); not an argument (a tuple, so Drop stays hashable).
  """

  ratio: Union[float, str, Mapping[Union[int, str], float]] = 0.5
  index_sharing: str = 'shared'
  positions: Tuple[Tuple[str, Optional[Tuple[str, int]]], ...] = dataclasses.field(
      default=(), init=False, repr=False)

  def __post_init__(self):
    _check_ratio(self.ratio)
    check_choice(self.index_sharing, ('shared', 'per_matrix'), 'Drop.index_sharing')

  def for_layers(self, positions: Mapping[str, Optional[Tuple[str, int]]]) -> 'Drop':
    """Drop with the plan's MoE layers (the linear ramp's ends); checks every layer's ratio."""
    keys = self.ratio if isinstance(self.ratio, Mapping) else {}
    unknown = [key for key in keys if isinstance(key, str) and key not in positions]
    if unknown:
      raise ValueError(f'Drop.ratio={self.ratio!r}: {unknown} are not MoE layers of the model '
                       f'({list(positions)}). Fix: name MoE layers, or use layer indices as keys.')
    bound = dataclasses.replace(self)
    object.__setattr__(bound, 'positions', tuple(positions.items()))
    for layer in positions:
      bound.ratio_at(layer)
    return bound

  def ratio_at(self, layer: str) -> float:
    """r of the MLP at `layer` ('encoder/layers_3/mlp')."""
    if not isinstance(self.ratio, (str, Mapping)):
      return float(self.ratio)
    if isinstance(self.ratio, Mapping) and layer in self.ratio:
      return float(self.ratio[layer])
    positions = dict(self.positions)
    if layer not in positions:
      raise ValueError(
          f'Drop.ratio={self.ratio!r} varies with the layer index, but {layer} is not among the '
          f'MoE layers Drop was given ({list(positions)}). Fix: upcycle through the plan '
          f'(upcycling.upcycle, the restore hook, convert), which gives them, or call '
          f'Drop(...).for_layers({{MLP path: (stack, index)}}) first.')
    if positions[layer] is None:
      raise ValueError(f'Drop.ratio={self.ratio!r} varies with the layer index, and the MLP '
                       f'path {layer!r} has none (its parent is not \'<block>_<i>\'). Fix: a '
                       f'float Drop.ratio, or give the plan the model config\'s '
                       f'moe_positions() (layers=...).')
    stack, index = positions[layer]
    if isinstance(self.ratio, Mapping):
      if index in self.ratio:
        return float(self.ratio[index])
      raise ValueError(f'Drop.ratio={self.ratio!r} has no ratio for the MoE layer {layer}. Fix: '
                       f'add {index} (every stack) or {layer!r} to the mapping.')
    r_first, r_last = _linear(self.ratio)
    depths = sorted(p[1] for p in positions.values() if p is not None and p[0] == stack)
    first, last = depths[0], depths[-1]
    return r_first if first == last else r_first + (r_last - r_first) * (index - first) / (
        last - first)

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    shapes = {name: shape_of(x) for name, x in mlp.items()}
    axes = ffn.d_ff_axes(shapes, layer)
    d_ff = ffn.d_ff(shapes, layer)
    count = int(round(self.ratio_at(layer) * d_ff))
    out = _tiled(mlp, num_experts)
    if count == 0:
      return out
    names = sorted(name for name, axis in axes.items() if axis is not None)
    groups = (['shared'] if self.index_sharing == 'shared' else
              sorted({ffn.matrix_of(name) for name in names}))
    index_rng, value_rng = jax.random.split(rng)
    masks = unit_mask(index_rng, (len(groups), num_experts, d_ff), count)
    noise = draw(value_rng, [out[name].shape for name in names])
    for name, z in zip(names, noise):
      group = 0 if self.index_sharing == 'shared' else groups.index(ffn.matrix_of(name))
      mask = _unit_broadcast(masks[group], out[name].ndim, axes[name] + 1)
      out[name] = redraw(out[name], mask, z)
    return out


@dataclasses.dataclass(frozen=True)
class Noise(ExpertInit):
  """Noise upcycling: copies, then Gaussian noise on part of each expert.

  Attributes:
    std: standard deviation of the noise.
    fraction: 'neuron': exactly round(fraction * d_ff) intermediate units per
      expert, shared by the MLP's matrices (a unit's input columns and output
      row); the output bias is untouched. 'element': every element of every
      leaf independently with probability `fraction`.
    mode: 'add' (w + noise) or 'replace' (noise).
    unit: 'neuron' or 'element'.
  """

  std: float = 0.02
  fraction: float = 0.5
  mode: str = 'add'
  unit: str = 'neuron'

  def __post_init__(self):
    if not 0.0 <= self.fraction <= 1.0:
      raise ValueError(f'Noise.fraction={self.fraction}: must be in [0, 1].')
    check_choice(self.mode, ('add', 'replace'), 'Noise.mode')
    check_choice(self.unit, ('neuron', 'element'), 'Noise.unit')

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    out = _tiled(mlp, num_experts)
    mask_rng, noise_rng = jax.random.split(rng)
    names = sorted(out)
    if self.unit == 'neuron':
      shapes = {name: shape_of(x) for name, x in mlp.items()}
      axes = ffn.d_ff_axes(shapes, layer)
      d_ff = ffn.d_ff(shapes, layer)
      units = unit_mask(mask_rng, (num_experts, d_ff), int(round(self.fraction * d_ff)))
      names = [name for name in names if axes[name] is not None]
      masks = [_unit_broadcast(units, out[name].ndim, axes[name] + 1) for name in names]
    else:
      uniform = draw(mask_rng, [out[name].shape for name in names], jax.random.uniform)
      masks = [u < self.fraction for u in uniform]
    noise = draw(noise_rng, [out[name].shape for name in names])
    for name, mask, z in zip(names, masks, noise):
      out[name] = _perturb(out[name], mask, self.std * z, self.mode == 'add')
    return out


@functools.partial(jax.jit, static_argnums=3)
def _perturb(w, mask, noise, add):
  new = w.astype(jnp.float32) + noise if add else noise
  return jnp.where(mask, new.astype(w.dtype), w)


def default_kernel_init(rng, shape, dtype):
  """T5X/Flaxformer's MLP kernel init: variance scaling 1.0, fan_in, truncated normal."""
  return jax.nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')(rng, shape, dtype)


@dataclasses.dataclass(frozen=True)
class Random(ExpertInit):
  """From-scratch experts (the baseline): nothing is taken from the dense MLP.

  Attributes:
    init_fn: `(key, shape, dtype) -> array` for 'kernel' leaves, called per
      expert with the dense leaf's shape. Default: T5X's variance scaling
      (1.0, fan_in, truncated normal). For ViT pass big_vision's
      `nn.initializers.xavier_uniform()` to match its Dense init.
    bias_init_fn: the same for 'bias' leaves. Default: zeros.
  """

  init_fn: Optional[Callable] = None
  bias_init_fn: Optional[Callable] = None

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    return self.tail(mlp, num_experts, rng, 0, layer=layer)

  def tail(self, mlp: Mapping[str, Array], num_experts: int, rng: Array, first: int, *,
           layer: str = '') -> Dict[str, Array]:
    """Experts [first, E) of `self(mlp, E, rng)`, drawing only those: `{name: [E - first, ...]}`."""
    out = {}
    for name, x in sorted(mlp.items()):
      leaf = name.split('/')[-1]
      if leaf == 'kernel':
        fn = self.init_fn or default_kernel_init
      elif leaf == 'bias':
        fn = self.bias_init_fn or jax.nn.initializers.zeros
      else:
        raise ValueError(
            f'Random: MLP leaf {layer}/{name} {shape_of(x)} is neither a kernel nor a bias, so it '
            f'has no default initializer. Fix: rename it, or upcycle it with Copy.')
      keys = jax.random.split(key_for(rng, name), num_experts)[first:]
      shape, dtype = shape_of(x), x.dtype
      out[name] = jax.vmap(lambda k, fn=fn, shape=shape, dtype=dtype: fn(k, shape, dtype))(keys)
    return out


@dataclasses.dataclass(frozen=True)
class Partial(ExpertInit):
  """Partial upcycling: the first `copied` experts copy the dense MLP, the rest start from scratch.

  Experts [0, N) are exact copies of the dense MLP; experts [N, E) are exactly
  experts [N, E) of `scratch(mlp, E, rng)`, i.e. what from-scratch upcycling
  (Random) draws for them. N = 0 is `scratch`, N = E is Copy.

  Attributes:
    copied: N, the number of copied experts (the first N), 0 <= N <= E.
    scratch: the Random initializer of experts [N, E) (its init_fn and
      bias_init_fn; for ViT pass big_vision's xavier_uniform as for Random).
  """

  copied: int = 1
  scratch: Random = Random()

  def __post_init__(self):
    if isinstance(self.copied, bool) or not isinstance(self.copied, int) or self.copied < 0:
      raise ValueError(f'Partial.copied={self.copied!r}: must be an int >= 0, the number of '
                       f'experts (the first ones) copied from the dense MLP.')
    if not isinstance(self.scratch, Random):
      raise ValueError(f'Partial.scratch={self.scratch!r}: must be a Random (gin: '
                       f'experts.Partial.scratch = @experts.Random()).')

  def _check(self, num_experts, layer):
    if self.copied > num_experts:
      raise ValueError(
          f'Partial.copied={self.copied} at {layer}: the MoE block has only {num_experts} '
          f'experts. Fix: Partial.copied <= {num_experts}, or more experts '
          f'(MoeConfig.num_experts).')

  def expert_shapes(self, mlp_shapes, num_experts, layer=''):
    self._check(num_experts, layer)
    return super().expert_shapes(mlp_shapes, num_experts, layer)

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    self._check(num_experts, layer)
    copies = _tiled(mlp, self.copied)
    fresh = self.scratch.tail(mlp, num_experts, rng, self.copied, layer=layer)
    return {name: jnp.concatenate([copies[name], fresh[name]]) for name in mlp}


@dataclasses.dataclass(frozen=True)
class Granular(ExpertInit):
  """Fine-grained upcycling: each expert is one of G slices of the dense FFN.

  The dense FFN splits along d_ff into G slices of d_ff / G units; expert
  e = i * G + g (virtual group i, slice g) is slice g, with its output
  projection (wo / Dense_1 kernel) multiplied by G. The output bias (Dense_1
  bias) is kept whole. The G experts of a virtual group share one router
  column (`tie_router`), so they get identical logits and the same tokens.

  A token taken by a whole group gets (1/G) * sum_g G * slice_g(x) + b =
  dense(x) from it, and the MoE block is *exactly* the dense MLP at step 0 for
  every token taken by at least one group when (MoeConfig):
    - normalize_combine_weights=True (the groups' weights then sum to one), and
    - router ExpertsChoose() (experts of a group pick the same tokens), or
      TopK(k) with k a multiple of G (top-k then takes whole
      groups: tied logits are broken by index and a group's indices are
      contiguous);
    - num_experts = n * G for n virtual experts, expert d_ff = dense d_ff / G.
  Capacity, batch priority routing and jitter keep this property, since the
  experts of a group see identical logits. Without normalization, or with k
  not a multiple of G, the block is not function preserving.

  Attributes:
    granularity: G, slices per dense FFN.
  """

  granularity: int = 2

  def __post_init__(self):
    if self.granularity < 1:
      raise ValueError(f'Granular.granularity={self.granularity}: must be >= 1.')

  def _axes(self, mlp_shapes, num_experts, layer):
    axes = ffn.d_ff_axes(mlp_shapes, layer)
    d_ff = ffn.d_ff(mlp_shapes, layer)
    g = self.granularity
    if num_experts % g or d_ff % g:
      raise ValueError(
          f'Granular(granularity={g}) at {layer}: needs num_experts ({num_experts}) and the dense '
          f'd_ff ({d_ff}) to be multiples of {g}. Fix: set MoeConfig.num_experts = n * {g} and the '
          f'expert d_ff to {d_ff} / {g}.')
    return axes, d_ff // g

  def expert_shapes(self, mlp_shapes, num_experts, layer=''):
    axes, width = self._axes(mlp_shapes, num_experts, layer)
    shapes = {}
    for name, shape in mlp_shapes.items():
      shape = list(shape)
      if axes[name] is not None:
        shape[axes[name]] = width
      shapes[name] = (num_experts,) + tuple(shape)
    return shapes

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    del rng
    shapes = {name: shape_of(x) for name, x in mlp.items()}
    axes, width = self._axes(shapes, num_experts, layer)
    g = self.granularity
    out = {}
    for name, x in mlp.items():
      x = as_array(x)
      axis = axes[name]
      if axis is None:
        out[name] = tile(x, num_experts)
        continue
      slices = jnp.stack([jax.lax.slice_in_dim(x, s * width, (s + 1) * width, axis=axis)
                          for s in range(g)])
      if ffn.matrix_of(name) not in ffn.INPUT_LAYERS:
        slices = (slices.astype(jnp.float32) * g).astype(x.dtype)
      out[name] = jnp.tile(slices, (num_experts // g,) + (1,) * x.ndim)
    return out

  def tie_router(self, router, layer=''):
    g = self.granularity
    tied = {}
    for name, w in router.items():
      num_experts = w.shape[-1]
      if num_experts % g:
        raise ValueError(
            f'Granular(granularity={g}): router leaf {layer}/router/{name} {tuple(w.shape)} has '
            f'{num_experts} experts on its last axis, not a multiple of {g}.')
      grouped = w.reshape(w.shape[:-1] + (num_experts // g, g))
      tied[name] = jnp.broadcast_to(grouped[..., :1], grouped.shape).reshape(w.shape)
    return tied


@dataclasses.dataclass(frozen=True)
class ZeroOutput(ExpertInit):
  """The experts of `inner` with their output projection (wo, Dense_1: kernel and bias) zero.

  The routed experts then output exactly zero for every token, whatever the routing, capacity
  or combine weights, so an MoE block with a shared expert (`MoeConfig.shared_expert`, copied
  from the dense MLP at the dense d_ff) computes exactly the dense MLP at step 0: the
  function-preserving init for shared experts. (Copied experts with normalized combine weights
  would add a second dense MLP output: 2 x dense(x) for every routed token.) At step 0 the
  experts' input projections and the router get no gradient from the task loss (the experts
  output zero); they start learning once the output projections have moved.

  Attributes:
    inner: the initializer whose experts are kept but for the output projection (an
      instance, or a name of `EXPERT_INITS`).
  """

  inner: Union[str, ExpertInit] = Copy()

  def __post_init__(self):
    object.__setattr__(self, 'inner', get(self.inner))
    if not self.inner.traceable:
      raise ValueError(f'ZeroOutput(inner={self.inner!r}): wraps initializers of one dense MLP '
                       f'(Copy, Drop, Noise, Random, Granular), not several checkpoints.')

  def expert_shapes(self, mlp_shapes, num_experts, layer=''):
    return self.inner.expert_shapes(mlp_shapes, num_experts, layer)

  def __call__(self, mlp, num_experts, rng, *, layer=''):
    out = self.inner(mlp, num_experts, rng, layer=layer)
    return {name: jnp.zeros_like(x) if ffn.is_output(name, layer) else x
            for name, x in out.items()}

  def tie_router(self, router, layer=''):
    return self.inner.tie_router(router, layer)

  def for_layers(self, positions):
    return dataclasses.replace(self, inner=self.inner.for_layers(positions))


EXPERT_INITS = {'copy': Copy, 'drop': Drop, 'noise': Noise, 'random': Random,
                'partial': Partial, 'granular': Granular, 'zero_output': ZeroOutput}


def get(init: Union[str, ExpertInit]) -> ExpertInit:
  """An expert initializer from a name (with defaults) or an instance."""
  return from_registry(init, ExpertInit, EXPERT_INITS, 'experts',
                       'FromCheckpoints and Merge need sources: pass an instance.')
