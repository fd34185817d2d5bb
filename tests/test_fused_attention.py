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
