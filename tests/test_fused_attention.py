"""The splash-attention kernel (Pallas' interpreter, on CPU) computes causal grouped-query
attention within segments: its outputs are a float64 numpy softmax's, its gradients the
einsum path's, on one device and per shard of a (batch, heads) mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import fused_attention, layers, partitioning

# 300 tokens (padded to 384: blocks of 128, three by three), 4 query heads over 2 key/value
# heads; row 0 packs two examples and 20 tokens of padding (segment 0), row 1 is one example.
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 300, 4, 2, 8
_rng = np.random.default_rng(0)
Q = _rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32)
K = _rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
V = _rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
COTANGENT = _rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32)
SEGMENTS = np.stack([np.repeat([1, 2, 0], [130, 150, 20]),
                     np.ones(LENGTH, int)]).astype(np.int32)


def numpy_attention(segments):
  """softmax(q k^T / sqrt(d)) v over earlier tokens of the same segment, in float64."""
  out = np.zeros(Q.shape)
  for b in range(BATCH):
    seg = np.ones(LENGTH, int) if segments is None else segments[b]
    allowed = np.tril(np.ones((LENGTH, LENGTH), bool)) & (seg[:, None] == seg[None, :])
    for h in range(HEADS):
      kv = h // (HEADS // KV_HEADS)
      logits = Q[b, :, h].astype(np.float64) @ K[b, :, kv].T / np.sqrt(HEAD_DIM)
      logits = np.where(allowed, logits, -np.inf)
      weights = np.exp(logits - logits.max(-1, keepdims=True))
      out[b, :, h] = (weights / weights.sum(-1, keepdims=True)) @ V[b, :, kv]
  return out


def _vjp(attention, segments):
  """(output, dq, dk, dv) of sum(output * COTANGENT), jitted."""
  def run(q, k, v):
    fn = lambda q, k, v: fused_attention.attend(q, k, v, segments, attention, 'float32')
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(jnp.asarray(COTANGENT))
  return jax.jit(run)(Q, K, V)


@pytest.mark.parametrize('packed', [True, False], ids=['packed_and_padded', 'causal'])
def test_splash_kernel_is_the_softmax_and_the_einsum_gradient(packed):
  segments = SEGMENTS if packed else None
  want = _vjp('einsum', segments)
  got = _vjp('splash_interpret', segments)
  np.testing.assert_allclose(got[0], numpy_attention(segments), rtol=0, atol=2e-5)
  np.testing.assert_allclose(want[0], numpy_attention(segments), rtol=0, atol=2e-5)
  for name, g, w in zip(('dq', 'dk', 'dv'), got[1:], want[1:]):
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5, err_msg=name)


def test_cudnn_call_masks_and_scales_as_the_softmax():
  """'cudnn' is `jax.nn.dot_product_attention`'s cuDNN build (GPU only); its XLA build on CPU
  checks the call: causal, segments as the mask, grouped-query heads, the scale."""
  got = jax.jit(fused_attention.dot_product, static_argnums=4)(Q, K, V, SEGMENTS, 'xla')
  np.testing.assert_allclose(got, numpy_attention(SEGMENTS), rtol=0, atol=2e-5)


def test_splash_kernel_runs_per_shard_of_batch_and_heads():
  """On a mesh of 2 (data) x 2 (model) devices, the batch split over 'data' and the heads
  over 'model': the same outputs and gradients."""
  mesh = partitioning.make_mesh(num_expert_partitions=1, num_model_partitions=2,
                                devices=jax.devices()[:4])
  with partitioning.activate(mesh):
    assert (layers.mesh_axes('batch'), layers.mesh_axes('heads')) == (('data',), ('model',))
    got = _vjp('splash_interpret', SEGMENTS)
  want = _vjp('einsum', SEGMENTS)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-5)


def _splash_flops(length: int, forwards: int = 1, backward: bool = False, heads: int = 4,
                  kv_heads: int = 2) -> float:
  return fused_attention.splash_flops(rows=8, length=length, heads=heads, kv_heads=kv_heads,
                                      head_dim=16, forwards=forwards, backward=backward)


def test_splash_flops_are_its_matmuls_over_the_causal_tiles():
  """The closed form `upcycle.aot` adds for the kernel the compiler counts as nothing: per
  matmul 2 · rows · heads · head_dim FLOPs per score computed, over the tiles on or below the
  diagonal; 2 matmuls a forward, 7 a backward (dq's 3, dkv's 4)."""
  tile = 2 * 8 * 4 * 16 * 128 * 128          # one matmul over one 128 x 128 tile
  assert _splash_flops(128) == 2 * tile
  assert _splash_flops(128, forwards=2, backward=True) == (2 * 2 + 7) * tile
  # A length padded to 256 (blocks of 256 then): 1 block; to 384 (blocks of 128): 3 x 3 tiles
  # of 128, 6 on or below the diagonal.
  assert _splash_flops(200) == 2 * 4 * tile
  assert _splash_flops(384) == 2 * 6 * tile
  # 4096 tokens in blocks of 512: 8 x 8 tiles, 36 kept of 64.
  assert _splash_flops(4096) == 2 * 36 * 16 * tile


def test_splash_flops_split_over_the_kernels_shards():
  """Per device, under a mesh of 8: the rows over 'data', the heads over 'model' where it
  divides both head counts (4 query heads, 2 key/value heads: 2 ways yes, 4 ways no)."""
  whole = _splash_flops(256)
  for model, per_device in ((2, whole / (4 * 2)), (4, whole / 2)):
    mesh = partitioning.make_mesh(num_expert_partitions=1, num_model_partitions=model,
                                  devices=jax.devices()[:8])
    with partitioning.activate(mesh):
      assert _splash_flops(256) == per_device, model


def test_a_one_row_batch_compiles_no_kernel_where_the_batch_is_split():
  mesh = partitioning.make_mesh(num_expert_partitions=1, num_model_partitions=1,
                                devices=jax.devices()[:2])
  with partitioning.activate(mesh):
    assert fused_attention.compiles_splash('auto', 2, dropout=False)
    assert not fused_attention.compiles_splash('auto', 1, dropout=False)
  assert not fused_attention.compiles_splash('einsum', 2, dropout=False)
  assert not fused_attention.compiles_splash('splash', 2, dropout=True)
