"""UpIT's router stage: bucket assignment by hand, and routers trained on the buckets."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from upcycle.models import T5, T5Config
from upcycle.moe import ROUTER_LOGITS, MoeConfig, router_logits
from upcycle.upcycling import data_selection, router_training
from upcycle.upcycling.surgery import upcycle
from tests.models.helpers import jitted


def test_assign_buckets_by_hand_with_ties_and_full_buckets():
  losses = np.array([
      [1.0, 2.0, 3.0],   # -> 0
      [0.5, 0.5, 2.0],   # tie 0/1 -> 0 (lower index); bucket 0 now full
      [0.1, 0.9, 0.2],   # 0 full -> next lowest 2
      [0.3, 0.3, 0.3],   # all tied, 0 full -> 1
      [0.0, 5.0, 4.0],   # 0 full -> 2 (4.0 < 5.0); bucket 2 now full
      [0.0, 9.0, 1.0],   # 0 and 2 full -> 1
  ])
  np.testing.assert_array_equal(data_selection.assign_buckets(losses, bucket_size=2),
                                [0, 0, 2, 1, 2, 1])
  np.testing.assert_array_equal(data_selection.assign_buckets(losses, bucket_size=6),
                                [0, 0, 0, 0, 0, 0])
  with pytest.raises(ValueError, match='7 samples do not fit 3 buckets of bucket_size=2'):
    data_selection.assign_buckets(np.zeros((7, 3)), bucket_size=2)


def test_score_samples_stacks_each_experts_per_sample_loss():
  loss_fn = lambda p, batch: p * batch
  scores = data_selection.score_samples(loss_fn, [1.0, 2.0], [np.array([1.0, 3.0]),
                                                              np.array([5.0])])
  np.testing.assert_array_equal(scores, [[1, 2], [3, 6], [5, 10]])


E = 4
CONFIG = T5Config(vocab_size=32, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=2,
                  num_decoder_layers=2,
                  encoder_moe=MoeConfig(num_experts=E, router='experts_choose'),
                  decoder_moe=MoeConfig(num_experts=E, router='tokens_choose', k=2))


def _bucket_batch(rng, labels, length=8):
  """Samples of bucket e use tokens from their own range [1 + 4e, 5 + 4e).

  Few tokens per bucket, so that their hidden states (d_model = 16) are linearly separable.
  """
  low = 1 + 4 * labels[:, None]
  tokens = low + rng.integers(0, 4, (len(labels), length))
  return jnp.asarray(tokens, jnp.int32)


def _router_logits_fn(params, batch):
  enc, dec = batch
  _, state = jitted(T5(CONFIG).apply, {'params': params}, enc, dec, mutable=[ROUTER_LOGITS])
  return {layer: (logits, (enc if layer.startswith('encoder') else dec) > 0)
          for layer, logits in router_logits(state).items()}


def _fraction_routed_to_label(params, batch, labels):
  fractions = []
  for logits, mask in _router_logits_fn(params, batch).values():
    top1 = jnp.argmax(logits, -1)
    fractions.append(float(jnp.sum((top1 == labels[:, None]) * mask) / jnp.sum(mask)))
  return min(fractions)


@pytest.mark.slow
def test_after_the_router_stage_each_buckets_tokens_route_to_its_expert():
  rng = np.random.default_rng(0)
  dense_cfg = dataclasses.replace(CONFIG, encoder_moe=None, decoder_moe=None)
  enc = dec = jnp.ones((2, 8), jnp.int32)
  dense = nn.meta.unbox(jitted(T5(dense_cfg).init, jax.random.PRNGKey(0), enc, dec)['params'])
  target = jax.eval_shape(T5(CONFIG).init, jax.random.PRNGKey(1), enc, dec)['params']
  params, _ = upcycle(dense, target, rng=0)

  def batches():
    while True:
      labels = np.repeat(np.arange(E), 2)
      yield (_bucket_batch(rng, labels), _bucket_batch(rng, labels)), labels

  held_out_labels = np.repeat(np.arange(E), 4)
  held_out = (_bucket_batch(rng, held_out_labels), _bucket_batch(rng, held_out_labels))
  before = _fraction_routed_to_label(params, held_out, held_out_labels)
  trained = router_training.train_routers(params, _router_logits_fn, batches(), steps=40,
                                          optimizer=optax.adam(0.05))
  after = _fraction_routed_to_label(trained, held_out, held_out_labels)
  assert before < 0.6 and after > 0.9, (before, after)
  # Only the routers changed.
  for path in ('encoder/layers_1/mlp/expert/wi_0/kernel', 'token_embedder/embedding'):
    node_a, node_b = params, trained
    for key in path.split('/'):
      node_a, node_b = node_a[key], node_b[key]
    np.testing.assert_array_equal(node_a, node_b)
