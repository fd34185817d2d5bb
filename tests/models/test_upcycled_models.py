"""The central invariant end to end: a T5 / ViT whose experts are its dense MLPs tiled gives
the dense model's logits (identical experts, normalized combine weights, enough capacity)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from tests.models.helpers import jitted, MODEL_T5, MODEL_VIT, tile_experts, tokens
from upcycle import upcycling
from upcycle.models.families import abstract_params
from upcycle.models import T5, T5Config, ViT
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, aux_losses, metrics, routers


def init(model, *args):
  return nn.meta.unbox(jitted(model.init, jax.random.PRNGKey(0), *args))['params']


@functools.lru_cache(maxsize=None)
def dense_model(name):
  """(model class, config, inputs, params, logits) of a dense 4-layer T5 or ViT."""
  if name == 't5':
    model, cfg = T5, dataclasses.replace(MODEL_T5, num_encoder_layers=4, num_decoder_layers=4)
    inputs = (tokens(0, (2, 12), cfg.vocab_size), tokens(1, (2, 6), cfg.vocab_size))
  else:
    model, cfg = ViT, dataclasses.replace(MODEL_VIT, depth=4)
    inputs = (jax.random.normal(jax.random.PRNGKey(3), (2, 8, 8, 3)),)
  params = init(model(cfg), *inputs)
  return model, cfg, inputs, params, jitted(model(cfg).apply, {'params': params}, *inputs)


@pytest.mark.slow
@pytest.mark.parametrize('dispatch', ['masked', 'indices'])
def test_upcycled_t5_gives_the_dense_logits(dispatch):
  _, cfg, (enc, dec), dense_params, dense_logits = dense_model('t5')
  moe_cfg = dataclasses.replace(
      cfg,
      encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose(), eval_capacity_factor=4.0,
                            normalize_combine_weights=True, dispatch=dispatch),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=2.0,
                            normalize_combine_weights=True, dispatch=dispatch))
  moe = T5(moe_cfg)
  params = tile_experts(dense_params, init(moe, enc, dec))
  assert params['encoder']['layers_1']['mlp']['expert']['wi_0']['kernel'].shape == (4, 16, 32)
  assert 'expert' not in params['encoder']['layers_2']['mlp']
  logits, state = jitted(moe.apply, {'params': params}, enc, dec, mutable=MOE_COLLECTIONS)
  np.testing.assert_allclose(logits, dense_logits, atol=1e-5)
  assert sorted({k.rsplit('/', 1)[0] for k in metrics(state)}) == [
      'decoder/layers_1/mlp', 'decoder/layers_3/mlp', 'encoder/layers_1/mlp',
      'encoder/layers_3/mlp']
  assert float(aux_losses(state)['router_z_loss']) > 0


@pytest.mark.slow
def test_upcycled_vit_gives_the_dense_logits():
  _, cfg, (images,), dense_params, dense_logits = dense_model('vit')
  moe_cfg = dataclasses.replace(cfg, moe=MoeConfig(
      num_experts=4, eval_capacity_factor=4.0, normalize_combine_weights=True))
  moe = ViT(moe_cfg)
  params = tile_experts(dense_params, init(moe, images))
  np.testing.assert_allclose(jitted(moe.apply, {'params': params}, images), dense_logits, atol=1e-5)


def test_t5_refuses_expert_choice_in_the_decoder():
  with pytest.raises(ValueError, match='causal decoder would read the future'):
    T5Config(decoder_moe=MoeConfig(router=routers.ExpertsChoose()))


@pytest.mark.parametrize('placement,encoder,decoder', [
    ('every_other', [1, 3], [1, 3]), ('last_1', [3], [3]), ([0, 2], [0, 2], [0, 2]),
    ('none', [], []), ('all', [0, 1, 2, 3], [0, 1, 2, 3])])
def test_placement_decides_which_mlps_are_sparse(placement, encoder, decoder):
  cfg = dataclasses.replace(
      MODEL_T5, num_encoder_layers=4, num_decoder_layers=4,
      encoder_moe=MoeConfig(num_experts=2),
      decoder_moe=MoeConfig(num_experts=2, router=routers.TopK()),
      encoder_moe_layers=placement, decoder_moe_layers=placement)
  enc, dec = tokens(0, (1, 4), cfg.vocab_size), tokens(1, (1, 4), cfg.vocab_size)
  shapes = jax.eval_shape(T5(cfg).init, jax.random.PRNGKey(0), enc, dec)['params']
  sparse = lambda stack: [i for i in range(4)
                          if 'expert' in shapes[stack][f'layers_{i}']['mlp']]
  assert sparse('encoder') == encoder and sparse('decoder') == decoder


@pytest.mark.slow
def test_bfloat16_activations_keep_float32_params_routers_and_logits():
  moe = MoeConfig(num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=2.0)
  cfg = dataclasses.replace(MODEL_T5, encoder_moe=moe, decoder_moe=moe)
  enc, dec = tokens(0, (2, 8), cfg.vocab_size), tokens(1, (2, 4), cfg.vocab_size)
  params = jax.jit(lambda: init(T5(cfg), enc, dec))()
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype('float32')}
  f32 = jax.jit(lambda p: T5(cfg).apply({'params': p}, enc, dec))(params)
  bf16_model = T5(dataclasses.replace(cfg, dtype='bfloat16'))
  logits, state = jax.jit(lambda p: bf16_model.apply({'params': p}, enc, dec,
                                                     mutable=MOE_COLLECTIONS))(params)
  assert logits.dtype == np.float32
  assert aux_losses(state)['router_z_loss'].dtype == np.float32
  np.testing.assert_allclose(logits, f32, atol=0.05 * float(np.max(np.abs(f32))))
  assert not np.array_equal(logits, f32)   # the activations really ran in bfloat16


@pytest.mark.slow
def test_shared_expert_with_zero_output_experts_gives_the_dense_logits():
  """Shared expert = the dense MLP, routed experts output zero (`experts.ZeroOutput`): the
  dense model exactly, in T5's encoder and decoder and in ViT (the MoE configs above)."""
  top2 = MoeConfig(num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=2.0,
                   normalize_combine_weights=True, shared_expert=True)
  choice = MoeConfig(num_experts=4, router=routers.ExpertsChoose(), eval_capacity_factor=4.0,
                     normalize_combine_weights=True, shared_expert=True)
  for name, fields in [('t5', dict(encoder_moe=choice, decoder_moe=top2)),
                       ('vit', dict(moe=choice))]:
    model, cfg, inputs, dense_params, dense_logits = dense_model(name)
    moe_cfg = dataclasses.replace(cfg, **fields)
    params, report = upcycling.upcycle(dense_params, abstract_params(moe_cfg),
                                       experts='zero_output', rng=0)
    assert len(report.shared) == len(report.experts) > 0
    np.testing.assert_allclose(jitted(model(moe_cfg).apply, {'params': params}, *inputs),
                               dense_logits, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['t5', 'vit'])
def test_upcycled_model_preserves_the_dense_function_in_bfloat16(name):
  """Pods run bfloat16 activations: upcycled (copied experts, normalized combine weights,
  enough capacity), the MoE at step 0 gives the dense model's bfloat16 logits within 1% of the
  largest logit, less than bfloat16's own error against float32, and the same argmax."""
  model, cfg, inputs, dense_params, dense_f32 = dense_model(name)
  if name == 't5':
    fields = dict(
        encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose(),
                              eval_capacity_factor=4.0,
                              normalize_combine_weights=True),
        decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2),
                              eval_capacity_factor=2.0, normalize_combine_weights=True))
  else:
    fields = dict(moe=MoeConfig(num_experts=4, eval_capacity_factor=4.0,
                                normalize_combine_weights=True))
  bf16 = lambda config: dataclasses.replace(config, dtype='bfloat16')
  moe_cfg = dataclasses.replace(cfg, **fields)
  params, _ = upcycling.upcycle(dense_params, abstract_params(moe_cfg), experts='copy', rng=0)
  dense = np.asarray(jitted(model(bf16(cfg)).apply, {'params': dense_params}, *inputs))
  moe = np.asarray(jitted(model(bf16(moe_cfg)).apply, {'params': params}, *inputs))
  scale = float(np.max(np.abs(dense_f32)))
  difference = float(np.max(np.abs(moe - dense)))
  assert difference <= 0.01 * scale
  assert difference < float(np.max(np.abs(dense - np.asarray(dense_f32))))
  np.testing.assert_array_equal(np.argmax(moe, -1), np.argmax(dense, -1))
