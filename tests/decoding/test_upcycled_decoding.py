"""An upcycled, function-preserving MoE (copied experts, normalized combine weights, capacity
for every token) decodes exactly like its dense source: greedy and beam search, token by token
routed MoE decoder blocks (docs/inference.md)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import pretrained, upcycling
from upcycle.decoding import DecodeConfig, make_decode_fn
from upcycle.models.families import abstract_params
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers

MAX_LENGTH = 10


def moe_config(dense, normalize):
  return dataclasses.replace(
      dense,
      encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose(), eval_capacity_factor=4.0,
                            normalize_combine_weights=normalize),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2),
                            eval_capacity_factor=2.0, normalize_combine_weights=normalize),
      decoder_moe_layers='all')


@pytest.fixture(scope='module')
def dense(hf_t5):
  params, config = pretrained.load_hf(hf_t5[0])
  return config, jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope='module')
def inputs():
  tokens = np.random.default_rng(3).integers(2, 32, (5, 9))
  tokens[2, 5:] = 0
  return jnp.asarray(tokens, jnp.int32)


def upcycled(dense_config, dense_params, normalize):
  config = moe_config(dense_config, normalize)
  params, _ = upcycling.upcycle(dense_params, abstract_params(config), experts='copy',
                                router='normal', rng=jax.random.PRNGKey(0))
  assert params['decoder']['layers_0']['mlp']['expert']['wi_0']['kernel'].shape == (4, 8, 12)
  return config, params


@pytest.mark.slow
@pytest.mark.parametrize('decoding', [DecodeConfig(method='greedy'),
                                      DecodeConfig(method='beam', num_beams=4, alpha=0.6)],
                         ids=['greedy', 'beam'])
def test_upcycled_moe_decodes_like_its_dense_source(dense, inputs, decoding):
  dense_config, dense_params = dense
  moe_config_, moe_params = upcycled(dense_config, dense_params, normalize=True)
  dense_tokens, dense_scores = make_decode_fn(T5(dense_config), decoding, MAX_LENGTH)(
      dense_params, inputs, None)
  tokens, scores = make_decode_fn(T5(moe_config_), decoding, MAX_LENGTH)(
      moe_params, inputs, None)
  np.testing.assert_array_equal(tokens, dense_tokens)
  np.testing.assert_allclose(scores, dense_scores, rtol=1e-5)


def test_without_normalized_combine_weights_the_moe_decodes_differently(dense, inputs):
  """The control: the paper's T5 setting scales each expert output by its router weight."""
  dense_config, dense_params = dense
  config, params = upcycled(dense_config, dense_params, normalize=False)
  decoding = DecodeConfig(method='greedy')
  _, dense_scores = make_decode_fn(T5(dense_config), decoding, MAX_LENGTH)(
      dense_params, inputs, None)
  _, scores = make_decode_fn(T5(config), decoding, MAX_LENGTH)(params, inputs, None)
  assert np.abs(np.asarray(scores) - np.asarray(dense_scores)).max() > 1e-3
