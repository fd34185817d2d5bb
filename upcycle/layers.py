"""Blocks shared by T5, ViT and Llama, every parameter and main activation with logical axes.

Parameters are created in float32 (`param_dtype`) and cast to the compute `dtype`
(bfloat16 on TPU) where they are used. Norms and softmaxes compute in float32.
"""

import functools
import math
from typing import Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

Array = jax.Array
Axes = Tuple[Optional[str], ...]
Initializer = Callable[..., Array]

# The compute dtypes a model config may name (`T5Config.dtype`, `ViTConfig.dtype`).
DTYPES = ('float32', 'bfloat16', 'float16')

default_kernel_init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')


def constrain(x: Array, axes: Optional[Axes]) -> Array:
  """Logical sharding constraint; a no-op outside a mesh / rules context."""
  return x if axes is None else nn.with_logical_constraint(x, axes)


def _as_tuple(x: Union[int, Sequence[int]]) -> Tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def mesh_axes(logical: str) -> Tuple[str, ...]:
  """The mesh axes (size > 1) the logical axis `logical` (e.g. 'batch') is split over in the
  current mesh and rules; () outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  spec = nn.logical_to_mesh_axes((logical,))
  axes = spec[0] if spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return tuple(a for a in axes if mesh.shape[a] > 1)


def per_batch_shard(fn: Callable, batched: Tuple[Union[bool, str], ...],
                    out_batched: Tuple[bool, ...]):
  """`fn` run on each batch shard: arguments flagged True in `batched` split on their leading
  axis over the batch's mesh axes, those flagged with a logical axis's name (e.g. 'expert')
  split on it over that axis's mesh axes, the others (False) whole; outputs likewise. Outside
  a mesh: `fn`.

  shard_map's varying-axes check is off: Pallas kernels (megablox) declare outputs without
  the axes they vary over."""
  axes = mesh_axes('batch')
  if not axes:
    return fn
  mesh = jax.sharding.get_abstract_mesh()
  spec = lambda split: (PartitionSpec(mesh_axes(split)) if isinstance(split, str)
                        else PartitionSpec(axes) if split else PartitionSpec())
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(b) for b in batched),
                       out_specs=tuple(spec(b) for b in out_batched),
                       axis_names=frozenset(mesh.axis_names), check_vma=False)


def mesh_size(axes: Tuple[str, ...]) -> int:
  """How many shards the mesh axes `axes` of the current mesh make (1 for none)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in axes)


def batch_shards() -> int:
  """How many shards the logical 'batch' axis has in the current mesh (1 outside one)."""
  return mesh_size(mesh_axes('batch'))


def matrix_init(kernel_init: Initializer, in_features: Tuple[int, ...],
                features: Tuple[int, ...]) -> Initializer:
  """`kernel_init` drawn as a 2-D `[prod(in_features), prod(features)]` matrix and reshaped to
  the kernel's shape, so fan_in/fan_out are what they are for a dense layer."""
  def init(rng, shape, dtype):
    flat = kernel_init(rng, (int(np.prod(in_features)), int(np.prod(features))), dtype)
    return flat.reshape(shape)
  return init


class DenseGeneral(nn.Module):
  """Projection of the last `len(in_features)` axes onto `features`.

  The kernel has shape `[*in_features, *features]`, e.g. `[d_model, heads, head_dim]`
  for big_vision attention or `[d_model, heads * d_kv]` for T5X attention. With
  `flat_kernel` it is stored as the matrix `[prod(in_features), prod(features)]` (T5X's and
  HF's layout, e.g. `[d_model, heads * head_dim]`) and multiplied as `[*in_features,
  *features]` (Flaxformer's `reshape_kernel`): the projection then maps `[..., d_model]` to
  `[..., heads, head_dim]` itself, so the TPU compiler lays the heads out as attention reads
  them, where reshaping the product copied every activation (Llama-3.2-1B on a v4-32: 4 GB
  of 44 per layer and step).
  """

  features: Union[int, Sequence[int]]
  kernel_axes: Axes
  in_features: Union[int, Sequence[int], None] = None  # None: the last input axis.
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros
  flat_kernel: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    """x `[..., *in_features]` -> `[..., *features]`."""
    features = _as_tuple(self.features)
    in_features = (x.shape[-1],) if self.in_features is None else _as_tuple(self.in_features)
    n_in = len(in_features)
    kernel_shape = in_features + features
    stored_shape = ((math.prod(in_features), math.prod(features)) if self.flat_kernel
                    else kernel_shape)
    init = matrix_init(self.kernel_init, in_features, features)
    kernel = self.param('kernel', nn.with_logical_partitioning(init, self.kernel_axes),
                        stored_shape, self.param_dtype)
    kernel = jnp.asarray(kernel, self.dtype).reshape(kernel_shape)
    x = jnp.asarray(x, self.dtype)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
    if self.use_bias:
      bias_shape, bias_axes = ((stored_shape[1:], self.kernel_axes[1:]) if self.flat_kernel
                               else (features, self.kernel_axes[n_in:]))
      bias = self.param('bias', nn.with_logical_partitioning(self.bias_init, bias_axes),
                        bias_shape, self.param_dtype)
      y = y + jnp.asarray(bias, self.dtype).reshape(features)
    return y


class RMSNorm(nn.Module):
  """T5 layer norm: scale only, no mean subtraction, no bias; computed in float32.

  `scale_in_dtype`: HF Llama's order, normalized in float32, cast to `dtype`, then scaled in
  `dtype` (the same in float32, not in bfloat16).
  """

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  scale_in_dtype: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = jnp.asarray(x, jnp.float32)
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(var + self.epsilon)
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
                       (x.shape[-1],), self.param_dtype)
    if self.scale_in_dtype:
      return jnp.asarray(scale, self.dtype) * y.astype(self.dtype)
    return jnp.asarray(y * jnp.asarray(scale, jnp.float32), self.dtype)


class LayerNorm(nn.Module):
  """Standard layer norm with scale and bias (ViT); computed in float32."""

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = jnp.asarray(x, jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
    features = (x.shape[-1],)
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
                       features, self.param_dtype)
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                      features, self.param_dtype)
    return jnp.asarray(y * scale + bias, self.dtype)


# The gate activations of `GatedMlp`: T5 v1.1's tanh-approximated GELU (HF 'gelu_new') and
# Llama's SiLU (SwiGLU).
GATE_ACTIVATIONS = {'gelu': functools.partial(nn.gelu, approximate=True), 'silu': nn.silu}


class GatedMlp(nn.Module):
  """Gated feed-forward: wo(dropout(act(wi_0 x) * wi_1 x)); T5 v1.1 (gelu), Llama (silu).

  Kernels: wi_0 (the gate), wi_1 `[d_model, d_ff]`, wo `[d_ff, d_model]`. Rank agnostic, so
  the MoE layer can vmap it over experts. `intermediate_axes=None` leaves the
  hidden activation unconstrained (inside the experts the MoE layer constrains). `dense`:
  the projections' module, called as `DenseGeneral` is (the MoE layer's dropless experts
  pass `upcycle.moe.experts.GroupedDense`).
  """

  d_ff: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  intermediate_axes: Optional[Axes] = ('batch', 'length', 'mlp')
  activation: str = 'gelu'   # a key of GATE_ACTIVATIONS
  dense: Callable[..., nn.Module] = DenseGeneral

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    dense = functools.partial(self.dense, dtype=self.dtype)
    gate = dense(self.d_ff, ('embed', 'mlp'), name='wi_0')(x)
    linear = dense(self.d_ff, ('embed', 'mlp'), name='wi_1')(x)
    h = constrain(GATE_ACTIVATIONS[self.activation](gate) * linear, self.intermediate_axes)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return dense(x.shape[-1], ('mlp', 'embed'), name='wo')(h)


class Mlp(nn.Module):
  """ViT feed-forward with biases: Dense_1(dropout(gelu(Dense_0 x))) (big_vision MlpBlock).

  `dense`: the projections' module, as in `GatedMlp`.
  """

  mlp_dim: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: jnp.dtype = jnp.float32
  intermediate_axes: Optional[Axes] = ('batch', 'length', 'mlp')
  dense: Callable[..., nn.Module] = DenseGeneral

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    dense = functools.partial(
        self.dense, use_bias=True, dtype=self.dtype,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6))
    h = nn.gelu(dense(self.mlp_dim, ('embed', 'mlp'), name='Dense_0')(x),
                approximate=self.approximate_gelu)
    h = constrain(h, self.intermediate_axes)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return dense(x.shape[-1], ('mlp', 'embed'), name='Dense_1')(h)


def attention_bias_from_mask(mask: Array, dtype=jnp.float32) -> Array:
  """Boolean `[batch, 1, q, k]` mask -> additive bias (0 where attended, -1e10 where not)."""
  return jnp.where(mask, 0.0, -1e10).astype(dtype)


def combine_masks(*masks: Optional[Array]) -> Optional[Array]:
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


def make_attention_mask(query_valid: Array, key_valid: Array) -> Array:
  """`[batch, q]` x `[batch, k]` booleans -> `[batch, 1, q, k]`."""
  return jnp.logical_and(query_valid[:, None, :, None], key_valid[:, None, None, :])


def make_segment_mask(query_segments: Array, key_segments: Array) -> Array:
  """Packed examples attend only within their own segment: `[batch, 1, q, k]`."""
  return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def make_causal_mask(length: int) -> Array:
  """`[1, 1, length, length]`: position i sees positions <= i."""
  return jnp.tril(jnp.ones((length, length), bool))[None, None]


class MultiHeadAttention(nn.Module):
  """Multi-head dot-product attention in two parameter layouts, with a decoding cache.

  T5X (`joined_kv=True`): kernels `[d_model, heads * head_dim]`, no biases, no
  1/sqrt(head_dim) on the logits (T5 folds it into the query initializer).
  big_vision (`joined_kv=False`): kernels `[d_model, heads, head_dim]` with biases
  `[heads, head_dim]`, logits scaled by 1/sqrt(head_dim).

  Decoding (`decode=True`) keeps projected keys and values in the `'cache'` collection
  (`cached_key`, `cached_value`: `[batch, cache_length, heads, head_dim]`), as `kv_cache` says:
    'append' (causal self-attention): the first call creates zeros of the key length; each
      later call takes one query token and writes its key/value at `position`.
    'fixed' (cross-attention): the first call projects `inputs_kv` (the encoder output)
      once; later calls read them and may pass `inputs_kv=None`.
  """

  num_heads: int
  head_dim: int
  joined_kv: bool = True
  use_bias: bool = False
  scale_logits: bool = False
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  kv_cache: Optional[str] = None  # None (never decodes), 'append' or 'fixed'.

  @nn.compact
  def __call__(self, inputs_q: Array, inputs_kv: Optional[Array], bias: Optional[Array],
               deterministic: bool, decode: bool = False,
               position: Optional[Array] = None) -> Array:
    """inputs `[batch, q|k, d_model]`, bias `[batch|1, heads|1, q, k]` -> `[batch, q, d_model]`.

    With `decode=True` and a cache already in place, `inputs_q` is `[batch, 1, d_model]`, `k`
    is the cache length, and 'append' needs `position` (scalar int32, the query's index).
    """
    h, d = self.num_heads, self.head_dim
    d_model = inputs_q.shape[-1]
    if self.joined_kv:
      in_axes, out_axes = ('embed', 'joined_kv'), ('joined_kv', 'embed')
      features, out_in = h * d, h * d
    else:
      in_axes, out_axes = ('embed', 'heads', 'kv'), ('heads', 'kv', 'embed')
      features, out_in = (h, d), (h, d)
    query_init = self.kernel_init
    if not self.scale_logits:
      # T5: scale the query initializer instead of the logits.
      query_init = lambda *a: self.kernel_init(*a) / np.sqrt(d).astype(np.float32)
    dense = functools.partial(DenseGeneral, use_bias=self.use_bias, dtype=self.dtype)
    heads = lambda x: constrain(x.reshape(x.shape[:2] + (h, d)), ('batch', 'length', 'heads', 'kv'))
    project_kv = lambda: tuple(
        heads(dense(features, in_axes, kernel_init=self.kernel_init, name=name)(inputs_kv))
        for name in ('key', 'value'))
    q = heads(dense(features, in_axes, kernel_init=query_init, name='query')(inputs_q))
    k, v = self._cached(project_kv, position) if decode else project_kv()
    if self.scale_logits:
      q = q / jnp.sqrt(d).astype(q.dtype)
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = nn.Dropout(self.dropout_rate)(weights, deterministic=deterministic)
    y = jnp.einsum('bhqk,bkhd->bqhd', weights.astype(self.dtype), v)
    if self.joined_kv:
      y = y.reshape(y.shape[:2] + (h * d,))
    y = dense(d_model, out_axes, in_features=out_in, kernel_init=self.kernel_init, name='out')(y)
    return constrain(y, ('batch', 'length', 'embed'))

  def _cached(self, project_kv: Callable[[], Tuple[Array, Array]],
              position: Optional[Array]) -> Tuple[Array, Array]:
    """Keys and values `[batch, cache_length, heads, head_dim]` through the 'cache' collection."""
    if self.kv_cache not in ('append', 'fixed'):
      raise ValueError(f'{self.name}: decode=True needs kv_cache="append" (causal '
                       f'self-attention) or "fixed" (cross-attention), not {self.kv_cache!r}.')
    if not self.has_variable('cache', 'cached_key'):   # The first call creates the cache.
      k, v = project_kv()
      fill = jnp.zeros_like if self.kv_cache == 'append' else (lambda x: x)
      self.variable('cache', 'cached_key', lambda: fill(k))
      self.variable('cache', 'cached_value', lambda: fill(v))
      return k, v
    cached_key = self.variable('cache', 'cached_key')
    cached_value = self.variable('cache', 'cached_value')
    if self.kv_cache == 'append':
      if position is None:
        raise ValueError(f'{self.name}: an "append" cache step needs the query position.')
      k, v = project_kv()   # [batch, 1, heads, head_dim]
      cached_key.value = jax.lax.dynamic_update_slice_in_dim(cached_key.value, k, position, 1)
      cached_value.value = jax.lax.dynamic_update_slice_in_dim(
          cached_value.value, v, position, 1)
    return cached_key.value, cached_value.value


def relative_position_bucket(relative_position: np.ndarray, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> np.ndarray:
  """T5's bucketing of `memory_position - query_position` (numpy, static shapes).

  Half the buckets hold exact small distances, the rest grow logarithmically up
  to `max_distance`; a bidirectional stack spends half its buckets on each side,
  a causal one only looks back.
  """
  n = -relative_position
  ret = np.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(n.dtype) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  eps = np.finfo(np.float32).eps
  large = max_exact + (
      np.log(n.astype(np.float32) / max_exact + eps) / np.log(max_distance / max_exact)
      * (num_buckets - max_exact)).astype(n.dtype)
  large = np.minimum(large, num_buckets - 1)
  return ret + np.where(is_small, n, large)


class RelativePositionBias(nn.Module):
  """One learned scalar per (head, bucket), shared by every layer of a stack."""

  num_buckets: int
  max_distance: int
  num_heads: int
  bidirectional: bool
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, q_len: int, k_len: int) -> Array:
    """-> `[1, heads, q_len, k_len]`."""
    context = np.arange(q_len, dtype=np.int32)[:, None]
    memory = np.arange(k_len, dtype=np.int32)[None, :]
    buckets = relative_position_bucket(memory - context, self.bidirectional,
                                       self.num_buckets, self.max_distance)
    table = self.param(
        'rel_embedding',
        nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform'),
            ('heads', 'relpos_buckets')),
        (self.num_heads, self.num_buckets), jnp.float32)
    return jnp.asarray(table, self.dtype)[:, buckets][None]


class Embed(nn.Module):
  """Token embedding `[vocab, d_model]`; `attend` gives tied output logits.

  Initialized N(0, 1) as T5 (whose tied logits are rescaled by d_model**-0.5); a model whose
  tied logits are not rescaled (Llama) passes a smaller `embedding_init`.
  """

  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32
  embedding_init: Initializer = nn.initializers.normal(stddev=1.0)

  def setup(self):
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(self.embedding_init, ('vocab', 'embed')),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, tokens: Array) -> Array:
    y = jnp.take(jnp.asarray(self.embedding, self.dtype), tokens, axis=0)
    return constrain(y, ('batch', 'length', 'embed'))

  def attend(self, x: Array) -> Array:
    return jnp.einsum('bld,vd->blv', x, jnp.asarray(self.embedding, self.dtype))
