"""Padding in the auxiliary losses and metrics of an MoE layer, worked out by hand.

The router is fixed: token j of the input is the unit vector e_j, so its router logits are row
j of the router kernel, log(p_j) + c_j: probabilities p_j and logsumexp c_j (its z-loss is
c_j^2). Two groups (examples) of four tokens, E = 2, Top-1; the first choice is the argmax.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import layers
from upcycle.moe import balance as balances
from upcycle.moe import (MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses, capacity, metrics,
                         routers, routing)
from tests.models.helpers import jitted

D_MODEL, E = 8, 2
EXPERT = functools.partial(layers.GatedMlp, d_ff=4)
# Group 0: choices e0, e0, e0, (e1, padding); group 1: e1, e1, (e0, padding), (e0, padding).
PROBS = np.array([[.9, .1], [.7, .3], [.6, .4], [.2, .8],
                  [.3, .7], [.4, .6], [.8, .2], [.55, .45]])
SHIFTS = np.array([1., 2., 0., 3., -1., 1., 4., 2.])
MASK = np.array([[True, True, True, False], [True, True, False, False]])
X = jnp.eye(D_MODEL).reshape(2, 4, D_MODEL)


def run(ignore_padding_tokens, mask=MASK, **overrides):
  """(output, sown state) of a Top-1 layer with the fixed router on X."""
  config = MoeConfig(**{**dict(num_experts=E, router=routers.TopK(k=1),
                               capacity_convention=capacity.T5X(minimum=1),
                               eval_capacity_factor=1.0, balance=balances.Switch(weight=1.0),
                               router_z_loss_weight=1.0,
                               ignore_padding_tokens=ignore_padding_tokens), **overrides})
  layer = MoeLayer(config, EXPERT)
  params = jitted(layer.init, jax.random.PRNGKey(0), X, True)['params']
  params['router']['router_weights']['w']['kernel'] = jnp.asarray(
      np.log(PROBS) + SHIFTS[:, None], jnp.float32)
  mask = None if mask is None else jnp.asarray(mask)
  return jitted(layer.apply, {'params': params}, X, True, mask, mutable=MOE_COLLECTIONS)


# Padding left out: group 0 has f = [1, 0], p = [2.2, .8] / 3; group 1 f = [0, 1],
# p = [.35, .65]; loss 2 * (2.2/3 + .65) / 2. The batch as one group: f = [3, 2] / 5,
# p = [2.9, 2.1] / 5, loss 2 * (.6 * .58 + .4 * .42). z-loss: (1 + 4 + 0 + 1 + 1) / 5.
# Padding counted (Flaxformer's ignore_padding_tokens=False): group 0 f = [.75, .25],
# p = [.6, .4]; group 1 f = [.5, .5], p = [2.05, 1.95] / 4; loss 2 * (.55 + .5) / 2;
# batch f = [5, 3] / 8, p = [4.45, 3.55] / 8; z-loss: 36 / 8.
@pytest.mark.slow
@pytest.mark.parametrize('ignore_padding_tokens,scope,balance,z_loss', [
    (True, 'group', 2.2 / 3 + .65, 1.4),
    (True, 'batch', 2 * (.6 * .58 + .4 * .42), 1.4),
    (False, 'group', 1.05, 4.5),
    (False, 'batch', 2 * (5 * 4.45 + 3 * 3.55) / 64, 4.5),
])
def test_losses_on_padded_groups(ignore_padding_tokens, scope, balance, z_loss):
  _, state = run(ignore_padding_tokens, balance=balances.Switch(weight=1.0, scope=scope))
  losses = aux_losses(state)
  np.testing.assert_allclose(losses['load_balancing_loss'], balance, rtol=1e-5)
  np.testing.assert_allclose(losses['router_z_loss'], z_loss, rtol=1e-5)
  np.testing.assert_allclose(losses['total'], balance + z_loss, rtol=1e-5)


@pytest.mark.parametrize('ignore_padding_tokens', [True, False])
def test_unpadded_inputs_give_the_same_losses_in_both_modes(ignore_padding_tokens):
  _, state = run(ignore_padding_tokens, mask=None)
  _, all_real = run(True, mask=np.ones((2, 4), bool))
  # Padding-free by hand: the 'padding counted' values above.
  np.testing.assert_allclose(aux_losses(state)['load_balancing_loss'], 1.05, rtol=1e-5)
  for name, value in aux_losses(state).items():
    np.testing.assert_array_equal(value, aux_losses(all_real)[name])


def test_without_ignoring_padding_the_layer_is_flaxformers_bit_for_bit():
  """Transcriptions of Flaxformer's `routing._load_balancing_loss` and `_router_z_loss` (no
  padding mask: `ignore_padding_tokens=False`) on the layer's router logits; padding is
  routed, so the output is that of the layer given no mask."""
  def flaxformer_load_balancing_loss(router_probs, expert_indices):
    num_experts = router_probs.shape[-1]
    expert_mask = jax.nn.one_hot(expert_indices, num_experts, dtype=jnp.int32)
    expert_mask = jnp.max(expert_mask, axis=-2)
    tokens_per_group_and_expert = jnp.mean(expert_mask, dtype=jnp.float32, axis=-2)
    router_prob_per_group_and_expert = jnp.mean(router_probs, dtype=jnp.float32, axis=-2)
    return jnp.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert,
                    dtype=jnp.float32) * num_experts ** 2

  def flaxformer_router_z_loss(router_logits):
    num_groups, tokens_per_group, _ = router_logits.shape
    log_z = jax.nn.logsumexp(router_logits, axis=-1)
    return jnp.sum(log_z ** 2, dtype=jnp.float32) / (num_groups * tokens_per_group)

  out, state = run(False)
  logits = jnp.einsum('gsd,de->gse', X, jnp.asarray(np.log(PROBS) + SHIFTS[:, None],
                                                     jnp.float32))
  probs = jax.nn.softmax(logits, axis=-1)
  np.testing.assert_array_equal(state['aux_loss']['load_balancing_loss'][0],
                                flaxformer_load_balancing_loss(probs, jax.lax.top_k(probs, 1)[1]))
  np.testing.assert_array_equal(state['aux_loss']['router_z_loss'][0],
                                flaxformer_router_z_loss(logits))
  np.testing.assert_array_equal(out, run(False, mask=None)[0])


def test_metrics_count_the_routed_tokens():
  # Two slots per expert and group: max(round(1.0 * 4 / 2), 1).
  # Padding left out: group 0 routes t0, t1 to e0 (t2 overflows), group 1 t4, t5 to e1:
  # 4 of 5 real tokens dispatched into 8 slots, weights .9, .7, .7, .6.
  _, state = run(True)
  m = metrics(state)
  np.testing.assert_allclose(m['fraction_dropped_tokens'], 1 / 5, rtol=1e-6)
  np.testing.assert_allclose(m['router_confidence'], (.9 + .7 + .7 + .6) / 4, rtol=1e-5)
  np.testing.assert_allclose(m['expert_usage'], 4 / 8, rtol=1e-6)
  np.testing.assert_allclose(m['router_top1_probability'], (.9 + .7 + .6 + .7 + .6) / 5,
                             rtol=1e-5)
  np.testing.assert_allclose(m['tokens_per_expert'], [1, 1], rtol=1e-6)
  np.testing.assert_allclose(m['expert_load'], [.25, .25], rtol=1e-6)
  # Padding counted: group 0 e0 takes t0, t1 (t2 drops), e1 t3; group 1 e1 takes t4, t5,
  # e0 t6, t7: 7 of 8 tokens in 8 slots.
  m = metrics(run(False)[1])
  np.testing.assert_allclose(m['fraction_dropped_tokens'], 1 / 8, rtol=1e-6)
  np.testing.assert_allclose(m['router_confidence'],
                             (.9 + .7 + .8 + .7 + .6 + .8 + .55) / 7, rtol=1e-5)
  np.testing.assert_allclose(m['expert_usage'], 7 / 8, rtol=1e-6)


# Two Top-1 layers of one stack, E = 2, two groups of two tokens, the first token of group 1
# padding. Layer 0: group 0 f = [1, 0], p = [.8, .2]; group 1 (t1 only) f = [0, 1],
# p = [.2, .8]. Layer 1: group 0 f = [0, 1], p = [.2, .8]; group 1 f = [0, 1], p = [.2, .8].
# Pooled per group: ([.5, .5]; [.5, .5]) and ([0, 1]; [.2, .8]): 2 * (.5 + .8) / 2 = 1.3.
# Pooled over the batch: layer 0 f = [2, 1] / 3, p = [.6, .4]; layer 1 f = [0, 1],
# p = [.2, .8]; pooled ([1/3, 2/3]; [.4, .6]): 2 * (.4 / 3 + .4) = 16 / 15.
STACK_PROBS = np.array([[[[.9, .1], [.7, .3]], [[.6, .4], [.2, .8]]],
                        [[[.3, .7], [.1, .9]], [[.4, .6], [.2, .8]]]], np.float32)
STACK_MASK = np.array([[True, True], [False, True]])


@pytest.mark.parametrize('scope,expected', [('group', 1.3), ('batch', 16 / 15)])
def test_pooled_load_balancing_leaves_padding_out(scope, expected):
  def sow(probs):
    fraction, mean_prob = routing.load_balancing_statistics(
        probs, jax.lax.top_k(probs, 1)[1], scope, STACK_MASK)
    return {'pooled_balance': (balances.PooledStatistics(fraction, mean_prob, weight=1.0),),
            'router_z_loss': (jnp.float32(0),), 'weighted': (jnp.float32(0),)}
  decoder = {f'layers_{i}': {'mlp': sow(STACK_PROBS[i])} for i in range(2)}
  np.testing.assert_allclose(aux_losses({'aux_loss': {'decoder': decoder}})['load_balancing_loss'],
                             expected, rtol=1e-5)
