"""MoE decoder blocks while decoding: each sequence's new token is routed as a group of its
own, so no token is dropped for capacity and an example decodes to the same tokens whatever
else is in its batch (docs/inference.md).

The model is a random tiny T5 whose decoder routers send most tokens to expert 0 first, with
`moe/paper_t5.gin`'s decoder capacity rule: routed as one group per step (the rule this
replaced), 8 tokens overflow expert 0's 4 slots and some examples decode differently inside
the batch than alone.
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle.decoding import DecodeConfig, make_decode_fn
from upcycle.models import T5, T5Config
from upcycle.moe import MoeConfig, ROUTER_LOGITS, capacity, grouping, router_logits, routers
from tests.models.helpers import jitted

MAX_LENGTH = 10
INPUTS = jnp.asarray(np.random.default_rng(0).integers(2, 32, (8, 7)), jnp.int32)
OTHER_INPUTS = jnp.asarray(np.random.default_rng(1).integers(2, 32, (8, 7)), jnp.int32)


def skewed_model(k):
  """(T5 with a Top-`k` decoder MoE of 8 experts in every layer, its params).

  Weights are 3x their init (so that examples decode to different tokens and some end
  early); each decoder router's expert-0 column gains 6 u / |u|^2, u the mean of its layer's
  MLP inputs, so that expert 0 is the first choice of at least 3/4 of the tokens (asserted).
  """
  moe = MoeConfig(num_experts=8, router=routers.TopK(k=k),
                  capacity_convention=capacity.T5X(), eval_capacity_factor=2.0,
                  grouping=grouping.Flaxformer(max_group_size=4096))
  model = T5(T5Config(vocab_size=32, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                      num_encoder_layers=2, num_decoder_layers=2, decoder_moe=moe,
                      decoder_moe_layers='all'))
  targets = OTHER_INPUTS[:, :6]
  params = flax.linen.meta.unbox(
      jitted(model.init, jax.random.PRNGKey(0), INPUTS, targets)['params'])
  params = jax.tree.map(lambda w: 3.0 * w, params)
  _, state = jitted(model.apply, {'params': params}, INPUTS, targets, capture_intermediates=True,
                    mutable=['intermediates'])
  for name, layer in params['decoder'].items():
    if 'mlp' in layer:
      mlp_inputs = state['intermediates']['decoder'][name]['pre_mlp_layer_norm']['__call__'][0]
      u = mlp_inputs.reshape(-1, 16).mean(axis=0)
      kernel = layer['mlp']['router']['router_weights']['w']['kernel']
      layer['mlp']['router']['router_weights']['w']['kernel'] = kernel.at[:, 0].add(
          6.0 * u / jnp.dot(u, u))
  _, state = jitted(model.apply, {'params': params}, INPUTS, targets, mutable=[ROUTER_LOGITS])
  for logits in router_logits(state).values():
    assert np.mean(np.argmax(logits, axis=-1) == 0) >= 0.75
  return model, params


@pytest.fixture(scope='module', params=[1, 2], ids=['top1', 'top2'])
def skewed(request):
  return skewed_model(request.param)


@pytest.mark.slow
@pytest.mark.parametrize('decoding', [DecodeConfig(method='greedy'),
                                      DecodeConfig(method='beam', num_beams=2)],
                         ids=['greedy', 'beam'])
def test_each_example_decodes_alone_as_inside_a_batch_of_8(skewed, decoding):
  model, params = skewed
  decode = make_decode_fn(model, decoding, MAX_LENGTH)
  batch_tokens, batch_scores = decode(params, INPUTS, None)
  for i in range(len(INPUTS)):
    tokens, scores = decode(params, INPUTS[i:i + 1], None)
    np.testing.assert_array_equal(tokens[0], batch_tokens[i], err_msg=f'example {i}')
    np.testing.assert_allclose(scores[0], batch_scores[i], rtol=1e-5, atol=1e-5)
  assert len({tuple(t) for t in np.asarray(batch_tokens).tolist()}) > 2   # not all alike


@pytest.mark.slow
def test_sampling_does_not_depend_on_the_rest_of_the_batch(skewed):
  """A fixed rng draws its noise per batch row, so each example keeps its row; the other
  rows change (other inputs, finishing at other steps)."""
  model, params = skewed
  decode = make_decode_fn(model, DecodeConfig(method='sample', temperature=1.0), MAX_LENGTH)
  rng = jax.random.PRNGKey(0)
  tokens, scores = decode(params, INPUTS, rng)
  halves = (np.arange(8) < 4, np.arange(8) >= 4)
  for kept in halves:
    mixed = jnp.where(kept[:, None], INPUTS, OTHER_INPUTS)
    mixed_tokens, mixed_scores = decode(params, mixed, rng)
    np.testing.assert_array_equal(mixed_tokens[kept], tokens[kept])
    np.testing.assert_allclose(mixed_scores[kept], scores[kept], rtol=1e-5, atol=1e-5)
    assert np.any(mixed_tokens[~kept] != tokens[~kept])
  eos = np.asarray(tokens) == 1
  lengths = np.where(eos.any(axis=1), eos.argmax(axis=1) + 1, MAX_LENGTH)
  assert lengths.min() < lengths.max()   # some rows finish while others go on


def test_a_training_group_size_that_does_not_divide_the_decode_batch_decodes_as_without_one():
  """The decoder groups 4 tokens at a time in training; 3 prompts x 10 decode positions are
  30 tokens, which 4 does not divide: decoding still routes each new token on its own (the
  prefill's placeholder too), so the tokens are those of the same model without groups."""
  def decoded(groups):
    moe = MoeConfig(num_experts=4, router=routers.TopK(k=2), grouping=groups)
    model = T5(T5Config(vocab_size=32, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                        num_encoder_layers=1, num_decoder_layers=2, decoder_moe=moe,
                        decoder_moe_layers='all'))
    params = flax.linen.meta.unbox(
        jitted(model.init, jax.random.PRNGKey(0), INPUTS[:3], OTHER_INPUTS[:3, :4])['params'])
    params = jax.tree.map(lambda w: 3.0 * w, params)
    return make_decode_fn(model, DecodeConfig(method='greedy'), MAX_LENGTH)(
        params, INPUTS[:3], None)

  tokens, scores = decoded(grouping.Fixed(4))
  reference_tokens, reference_scores = decoded(grouping.PerExample())
  np.testing.assert_array_equal(tokens, reference_tokens)
  np.testing.assert_allclose(scores, reference_scores, rtol=1e-6)
