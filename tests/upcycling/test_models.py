"""Upcycling real model trees: the MoE model computes the dense model at step 0."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import tree
from upcycle.models import T5, T5Config, ViT, ViTConfig
from upcycle.moe import MoeConfig, capacity, routers
from upcycle.upcycling import capture, experts, router_init
from upcycle.upcycling.surgery import upcycle
from tests.models.helpers import jitted

T5_DENSE = T5Config(vocab_size=32, d_model=8, num_heads=2, d_kv=4, d_ff=16,
                    num_encoder_layers=2, num_decoder_layers=2)
VIT_DENSE = ViTConfig(num_classes=5, image_size=(8, 8), patch_size=(4, 4), width=8, depth=2,
                      mlp_dim=16, num_heads=2, head_zeroinit=False)
# Capacity = group size: every token reaches an expert, so normalized combine
# weights make identical experts compute exactly the dense MLP.
ENCODER_MOE = MoeConfig(num_experts=4, router=routers.ExpertsChoose(), eval_capacity_factor=4.0,
                        capacity_convention=capacity.Vmoe(multiple_of=1),
                        normalize_combine_weights=True)
DECODER_MOE = MoeConfig(num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=2.0,
                        capacity_convention=capacity.Vmoe(multiple_of=1),
                        normalize_combine_weights=True)


def _tokens(seed, low=1, high=32, shape=(2, 6)):
  return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


@pytest.fixture(scope='module')
def t5_dense():
  enc, dec = _tokens(0), _tokens(1, shape=(2, 5))
  params = nn.meta.unbox(jitted(T5(T5_DENSE).init, jax.random.PRNGKey(0), enc, dec)['params'])
  return params, enc, dec, jitted(T5(T5_DENSE).apply, {'params': params}, enc, dec)


def _t5_target(config, enc, dec):
  return jax.eval_shape(T5(config).init, jax.random.PRNGKey(1), enc, dec)['params']


@pytest.mark.slow
def test_t5_copy_upcycling_is_function_preserving(t5_dense):
  params, enc, dec, dense_logits = t5_dense
  config = dataclasses.replace(T5_DENSE, encoder_moe=ENCODER_MOE, decoder_moe=DECODER_MOE)
  moe_params, report = upcycle(params, _t5_target(config, enc, dec), rng=0)
  assert sorted(report.num_experts) == ['decoder/layers_1/mlp', 'encoder/layers_1/mlp']
  assert set(report.fresh) == {'encoder/layers_1/mlp/router/router_weights/w/kernel',
                               'decoder/layers_1/mlp/router/router_weights/w/kernel'}
  assert len(report.experts) == 6 and report.unused == ()
  logits = jitted(T5(config).apply, {'params': moe_params}, enc, dec)
  np.testing.assert_allclose(logits, dense_logits, rtol=1e-5, atol=1e-5)


def test_t5_granular_upcycling_is_function_preserving(t5_dense):
  """G = 2, E = 4, expert d_ff = 16 / 2; Expert Choice encoder, Top-2 decoder, normalized."""
  params, enc, dec, dense_logits = t5_dense
  config = dataclasses.replace(
      T5_DENSE, d_ff=8, encoder_moe=ENCODER_MOE, decoder_moe=DECODER_MOE,
      encoder_moe_layers='all', decoder_moe_layers='all')
  moe_params, _ = upcycle(params, _t5_target(config, enc, dec), experts=experts.Granular(2),
                          router=router_init.Normal(1.0), rng=0)
  logits = jitted(T5(config).apply, {'params': moe_params}, enc, dec)
  np.testing.assert_allclose(logits, dense_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_vit_copy_upcycling_is_function_preserving():
  images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
  params = nn.meta.unbox(jitted(ViT(VIT_DENSE).init, jax.random.PRNGKey(0), images)['params'])
  config = dataclasses.replace(VIT_DENSE, moe=ENCODER_MOE)
  target = jax.eval_shape(ViT(config).init, jax.random.PRNGKey(1), images)['params']
  moe_params, report = upcycle(params, target, rng=0)
  mlp = 'Transformer/encoderblock_1/MlpBlock_0'
  assert tree.flatten(moe_params)[f'{mlp}/expert/Dense_0/bias'].shape == (4, 16)
  assert report.num_experts == {mlp: 4}
  np.testing.assert_allclose(jitted(ViT(config).apply, {'params': moe_params}, images),
                             jitted(ViT(VIT_DENSE).apply, {'params': params}, images),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_from_data_router_sends_each_experts_data_to_it(t5_dense):
  params, _, _, _ = t5_dense
  config = dataclasses.replace(T5_DENSE, encoder_moe=dataclasses.replace(ENCODER_MOE,
                                                                         num_experts=3))
  batches = [{'encoder_input_tokens': _tokens(e, 1 + 10 * e, 11 + 10 * e),
              'decoder_input_tokens': _tokens(e, 1, 32, (2, 5))} for e in range(3)]
  target = _t5_target(config, batches[0]['encoder_input_tokens'],
                      batches[0]['decoder_input_tokens'])
  layers = capture.moe_layers(target)
  assert layers == ['encoder/layers_1/mlp']
  hidden = capture.hidden_states_per_expert(T5(T5_DENSE), {'params': params}, layers, batches)
  moe_params, _ = upcycle(params, target, router=router_init.FromData(hidden), rng=0)
  kernel = tree.flatten(moe_params)['encoder/layers_1/mlp/router/router_weights/w/kernel']
  for e, batch in enumerate(batches):
    # What the MoE model's router sees at step 0.
    x = capture.mlp_inputs(T5(config), {'params': moe_params}, layers, **batch)[layers[0]]
    np.testing.assert_allclose(x, hidden[layers[0]][e], rtol=1e-6, atol=1e-6)
    mean_logits = (x.reshape(-1, x.shape[-1]) @ kernel).mean(0)
    assert int(jnp.argmax(mean_logits)) == e, mean_logits
