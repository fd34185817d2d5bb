"""Causal self-attention over whole sequences, by an einsum or a fused kernel
(`LlamaConfig.attention`).

Every implementation maps queries `[batch, length, heads, head_dim]`, keys and values
`[batch, length, kv_heads, head_dim]` (query head h reads key/value head h // (heads /
kv_heads)) and segment ids `[batch, length]` (packed examples; 0 = padding, which attends to
the padding before it, as any segment does; None: one example per row) to
`[batch, length, heads, head_dim]`: softmax(q k^T head_dim**-0.5 + causal and segment masks) v,
the softmax in float32. They differ in what they keep in memory:

- 'einsum': `einsum_attention`, the reference: float32 logits `[batch, kv_heads, group, q, k]`
  and their softmax materialized, forward and backward. Also what decoding (the KV cache)
  and attention dropout use.
- 'splash': jax's Pallas splash-attention kernel on TPU (causal mask, segment ids, blocks of up
  to 512 tokens: the scores live in VMEM, one block at a time), 'einsum' elsewhere. The
  kernel is not partitioned by XLA, so it runs per shard (`jax.shard_map`) over the mesh axes
  of the logical 'batch' axis and, when they divide both head counts, of 'heads'.
- 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')` on GPU (bfloat16 / float16
  only), 'einsum' elsewhere.
- 'auto' (the default): 'cudnn' on GPU for bfloat16 / float16, 'splash' on TPU, 'einsum'
  elsewhere (so CPU results are the einsum's, bit for bit). 'splash' and 'auto' attend with
  the einsum where the batch shards do not divide the rows (a model's one-row init).
- 'splash_interpret': the splash kernel in Pallas' interpreter on any platform (slow; for
  tests).
"""

import functools
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from upcycle import layers

Array = jax.Array

# `LlamaConfig.attention`'s choices.
ATTENTION = ('auto', 'einsum', 'splash', 'cudnn', 'splash_interpret')
# Dtypes cuDNN's fused attention takes.
CUDNN_DTYPES = ('bfloat16', 'float16')
# The splash kernel's blocks: the largest of these dividing the (padded) length.
SPLASH_BLOCKS = (512, 256, 128)
# The splash kernel's matmuls per call, each over the tiles the causal mask keeps: the
# forward's q k^T and p v; the backward's dq kernel q k^T, do v^T, ds k and its dkv kernel
# q k^T, do v^T, p^T do, ds^T q.
SPLASH_FORWARD_MATMULS, SPLASH_BACKWARD_MATMULS = 2, 3 + 4


def causal_bias(segment_ids: Optional[Array], length: int) -> Array:
  """The additive bias `[batch|1, 1, length, length]` of causal attention within segments."""
  mask = layers.combine_masks(
      layers.make_causal_mask(length),
      None if segment_ids is None else layers.make_segment_mask(segment_ids, segment_ids))
  return layers.attention_bias_from_mask(mask)


def einsum_attention(q: Array, k: Array, v: Array, bias: Array, dtype: str,
                     dropout: Optional[Callable[[Array], Array]] = None) -> Array:
  """q `[batch, q_len, heads, head_dim]`, k and v `[batch, k_len, kv_heads, head_dim]`, bias
  `[batch|1, 1, q_len, k_len]` (additive) -> `[batch, q_len, heads, head_dim]`; the logits
  `[batch, kv_heads, group, q_len, k_len]` in float32, the weights in `dtype`, `dropout` (if
  any) applied to them."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  logits = jnp.einsum('bqhgd,bkhd->bhgqk', q, k, preferred_element_type=jnp.float32)
  logits = logits * head_dim**-0.5 + bias[:, :, None].astype(jnp.float32)
  weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
  if dropout is not None:
    weights = dropout(weights)
  return jnp.einsum('bhgqk,bkhd->bqhgd', weights, v).reshape(batch, length, heads, head_dim)


def _splash_shard(q: Array, k: Array, v: Array, *segment_ids: Array,
                  interpret: bool) -> Array:
  """The splash kernel on one shard: q `[batch, heads, length, head_dim]` (scaled), k and v
  `[batch, kv_heads, length, head_dim]`, optional segment ids `[batch, length]`; length a
  multiple of 128."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  # pylint: enable=g-import-not-at-top
  heads, length = q.shape[1], q.shape[2]
  block = _splash_block(length)
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  mask = sm.MultiHeadMask([sm.CausalMask((length, length))] * heads)
  kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  if not segment_ids:
    return jax.vmap(kernel)(q, k, v)
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, sk.SegmentIds(s, s)))(
      q, k, v, segment_ids[0])


def _padded(length: int) -> int:
  """The length `splash` runs the kernel at: a multiple of 128."""
  return -(-length // 128) * 128


def _splash_block(padded: int) -> int:
  return next(b for b in SPLASH_BLOCKS if padded % b == 0)


def _head_axes(heads: int, kv_heads: int) -> Tuple[str, ...]:
  """The mesh axes the kernel's heads are split over: the logical 'heads' axis's, where they
  divide both head counts; else none."""
  axes = layers.mesh_axes('heads')
  return () if heads % layers.mesh_size(axes) or kv_heads % layers.mesh_size(axes) else axes


def compiles_splash(attention: str, rows: int, dropout: bool) -> bool:
  """Whether `attend` compiles the splash kernel for TPU under the current mesh: attention
  'splash' or 'auto', no attention dropout, and `rows` the kernel's batch shards divide."""
  return (attention in ('splash', 'auto') and not dropout
          and rows % layers.batch_shards() == 0)


def splash_flops(*, rows: int, length: int, heads: int, kv_heads: int, head_dim: int,
                 forwards: int = 1, backward: bool = False) -> float:
  """FLOPs per device of the splash kernel (`splash`) under the current mesh on `rows`
  sequences of `length` tokens, `heads` query heads of `head_dim`: `forwards` forward calls
  (2 where remat runs the forward again in the backward) and, with `backward`, its backward.
  Each matmul runs over the [block, block] tiles the causal mask keeps (n (n + 1) / 2 of n²,
  n the padded length over the block) at 2 FLOPs per multiply-add; the work is split over the
  kernel's shards ('batch', and 'heads' where they divide both head counts).

  The TPU compiler's cost analysis counts a Pallas call as nothing: `upcycle.aot` adds this."""
  padded = _padded(length)
  block = _splash_block(padded)
  n = padded // block
  matmul = 2 * rows * heads * (n * (n + 1) // 2) * block * block * head_dim
  calls = SPLASH_FORWARD_MATMULS * forwards + (SPLASH_BACKWARD_MATMULS if backward else 0)
  shards = layers.batch_shards() * layers.mesh_size(_head_axes(heads, kv_heads))
  return calls * matmul / shards


def splash(q: Array, k: Array, v: Array, segment_ids: Optional[Array],
           interpret: bool = False) -> Array:
  """The splash kernel (module docstring's shapes), per shard of the current mesh.

  The rows are padded to a multiple of 128 tokens at their end: causal, no real token
  attends to them, and their outputs are cut off."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  padded = _padded(length)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - length)) + ((0, 0),) * (x.ndim - 2))
  heads_major = lambda x: jnp.swapaxes(pad(x), 1, 2)
  args = [heads_major(q * jnp.asarray(head_dim**-0.5, q.dtype)), heads_major(k),
          heads_major(v)]
  if segment_ids is not None:
    args.append(pad(segment_ids.astype(jnp.int32)))
  batch_axes = layers.mesh_axes('batch')
  head_axes = _head_axes(heads, kv_heads)
  fn = functools.partial(_splash_shard, interpret=interpret)
  if batch_axes or head_axes:
    mesh = jax.sharding.get_abstract_mesh()
    qkv = PartitionSpec(batch_axes or None, head_axes or None)
    specs = (qkv,) * 3 + (PartitionSpec(batch_axes or None),) * (len(args) - 3)
    fn = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=qkv,
                       axis_names=frozenset(mesh.axis_names), check_vma=False)
  return jnp.swapaxes(fn(*args), 1, 2)[:, :length]


def dot_product(q: Array, k: Array, v: Array, segment_ids: Optional[Array],
                implementation: str = 'cudnn') -> Array:
  """`jax.nn.dot_product_attention` by `implementation` (module docstring's shapes): 'cudnn'
  (GPU only), or 'xla' (any platform: the same call's masks and scale). Segment ids enter as a
  boolean mask, which cuDNN takes as a bias `[batch, 1, length, length]` in q's dtype."""
  mask = None if segment_ids is None else layers.make_segment_mask(segment_ids, segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=q.shape[-1]**-0.5,
                                      is_causal=True, implementation=implementation)


def attend(q: Array, k: Array, v: Array, segment_ids: Optional[Array], attention: str,
           dtype: str, dropout: Optional[Callable[[Array], Array]] = None) -> Array:
  """Causal self-attention over whole sequences by `attention` (one of ATTENTION; module
  docstring's shapes). With `dropout` (attention dropout, which no kernel has): 'einsum'."""
  einsum = lambda q, k, v, *s: einsum_attention(
      q, k, v, causal_bias(s[0] if s else None, q.shape[1]), dtype, dropout)
  args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
  unpack = lambda fn: lambda q, k, v, *s: fn(q, k, v, s[0] if s else None)
  gpu = jax.default_backend() == 'gpu' and dtype in CUDNN_DTYPES
  if dropout is not None or attention == 'einsum':
    return einsum(*args)
  if attention == 'splash_interpret':
    return splash(q, k, v, segment_ids, interpret=True)
  if attention == 'cudnn' or (attention == 'auto' and gpu):
    return dot_product(q, k, v, segment_ids) if gpu else einsum(*args)
  if not compiles_splash(attention, q.shape[0], dropout=False):   # rows the shards cannot split
    return einsum(*args)
  # 'splash', or 'auto' off GPU: the kernel where the program is lowered for TPU.
  return jax.lax.platform_dependent(*args, tpu=unpack(splash), default=einsum)
