"""Routers on cases worked out by hand, capacity arithmetic, and losses against numpy (the
default load-balancing loss against Flaxformer's: test_flaxformer_reference.py)."""

import jax
import numpy as np
import pytest

from upcycle import fields
from upcycle.moe import MoeConfig, capacity, routers, routing
from upcycle.moe import balance as balances

# One group, 4 tokens, 2 experts. Top-1 choices: t0->e0, t1->e0, t2->e1, t3->e0.
PROBS = np.array([[[0.6, 0.4], [0.7, 0.3], [0.2, 0.8], [0.9, 0.1]]], np.float32)


def top(k):
  """Each token's k most probable experts in PROBS."""
  return jax.lax.top_k(PROBS, k)[1]


def slots(decision):
  """{expert: [(token, weight), ...]} of the valid slots, in slot order."""
  out = {}
  for e in range(decision.token_index.shape[1]):
    out[e] = [(int(t), round(float(w), 4))
              for t, w, v in zip(decision.token_index[0, e], decision.combine_weight[0, e],
                                 decision.valid[0, e]) if v]
  return out


def test_experts_choose_takes_each_experts_top_tokens():
  decision = routing.experts_choose(PROBS, capacity=2)
  assert slots(decision) == {0: [(3, 0.9), (1, 0.7)], 1: [(2, 0.8), (0, 0.4)]}


def test_experts_choose_takes_padding_last_and_marks_it_invalid():
  mask = np.array([[True, True, True, False]])
  decision = routing.experts_choose(PROBS, capacity=2, token_mask=mask)
  assert slots(decision) == {0: [(1, 0.7), (0, 0.6)], 1: [(2, 0.8), (0, 0.4)]}


@pytest.mark.slow
def test_top2_first_choices_outrank_second_choices_and_overflow_drops():
  decision = routing.tokens_choose(PROBS, top(2), capacity=2)
  # First choices in position order: t0,t1 fill e0; t3's first choice overflows e0.
  # Second choices: t0 -> e1 fits; t1 -> e1 overflows; t2 -> e0 and t3 -> e1 overflow.
  assert slots(decision) == {0: [(0, 0.6), (1, 0.7)], 1: [(2, 0.8), (0, 0.4)]}
  counts = routing.token_slot_counts(decision, 4)
  np.testing.assert_array_equal(counts, [[2, 1, 1, 0]])  # t3 is dropped entirely


def test_top2_batch_priority_routing_ranks_by_top1_probability():
  decision = routing.tokens_choose(PROBS, top(2), capacity=2, batch_priority=True)
  # Priority t3 (.9), t2 (.8), t1 (.7), t0 (.6): t0's first choice now overflows.
  assert slots(decision) == {0: [(3, 0.9), (1, 0.7)], 1: [(2, 0.8), (3, 0.1)]}
  np.testing.assert_array_equal(routing.token_slot_counts(decision, 4), [[0, 1, 1, 2]])


def test_top1_with_room_for_everyone():
  decision = routing.tokens_choose(PROBS, top(1), capacity=4)
  assert slots(decision) == {0: [(0, 0.6), (1, 0.7), (3, 0.9)], 1: [(2, 0.8)]}


def test_padding_claims_no_slot_in_top_k():
  mask = np.array([[False, True, True, True]])
  decision = routing.tokens_choose(PROBS, top(1), capacity=2, token_mask=mask)
  assert slots(decision) == {0: [(1, 0.7), (3, 0.9)], 1: [(2, 0.8)]}


def test_normalized_weights_sum_to_one_per_routed_token_and_zero_for_dropped():
  decision = routing.normalize_combine_weights(routing.tokens_choose(PROBS, top(2), 2), 4)
  assert slots(decision) == {0: [(0, 0.6), (1, 1.0)], 1: [(2, 1.0), (0, 0.4)]}
  np.testing.assert_allclose(routing.token_weight_sums(decision, 4), [[1, 1, 1, 0]], atol=1e-6)


@pytest.mark.parametrize('k,factor,tokens,experts,multiple,expected', [
    (1, 2.0, 16, 4, 4, 8),     # ceil(1*2*16/4) = 8
    (2, 1.0, 16, 8, 4, 4),     # ceil(2*16/8) = 4
    (2, 1.25, 10, 4, 1, 7),    # ceil(6.25) = 7, no rounding
    (2, 1.25, 10, 4, 4, 8),    # rounded up to a multiple of 4
    (1, 8.0, 16, 4, 4, 16),    # capped at the group size
    (2, 0.01, 16, 4, 4, 4),    # at least one slot, then rounded
])
def test_capacity(k, factor, tokens, experts, multiple, expected):
  config = MoeConfig(num_experts=experts, router=routers.TopK(k=k),
                     train_capacity_factor=factor, eval_capacity_factor=factor * 2,
                     capacity_convention=capacity.Vmoe(multiple_of=multiple))
  assert config.capacity(tokens, deterministic=False) == expected


def test_expert_choice_counts_one_expert_per_token_and_eval_factor_is_separate():
  config = MoeConfig(num_experts=4, router=routers.ExpertsChoose(), train_capacity_factor=1.0,
                     eval_capacity_factor=2.0, capacity_convention=capacity.Vmoe(multiple_of=1))
  assert config.capacity(16, deterministic=False) == 4
  assert config.capacity(16, deterministic=True) == 8


def test_load_balancing_loss_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 10, 4)).astype(np.float32)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top2 = np.argsort(-probs, axis=-1)[..., :2]
  expected = 0.0
  for g in range(3):
    for e in range(4):
      fraction = np.mean([e in top2[g, s] for s in range(10)])
      expected += fraction * probs[g, :, e].mean()
  expected *= 4 ** 2 / (3 * 4)
  got = routing.load_balancing_loss(
      *routing.load_balancing_statistics(probs, jax.lax.top_k(probs, 2)[1]))
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  uniform = np.full((1, 8, 4), 0.25, np.float32)
  balanced_choice = np.arange(8).reshape(1, 8, 1) % 4
  np.testing.assert_allclose(
      routing.load_balancing_loss(*routing.load_balancing_statistics(uniform, balanced_choice)),
      1.0, rtol=1e-6)


# Top-1, E = 2, two groups of two tokens; the choices are the argmax. Per group (f; p):
# group 0 ([1, 0]; [.8, .2]), group 1 ([.5, .5]; [.4, .6]). Per batch: ([.75, .25]; [.6, .4]).
TINY_PROBS = np.array([[[.9, .1], [.7, .3]], [[.6, .4], [.2, .8]]], np.float32)


def test_load_balancing_scopes_closed_form():
  choice = jax.lax.top_k(TINY_PROBS, 1)[1]
  loss = lambda scope: routing.load_balancing_loss(
      *routing.load_balancing_statistics(TINY_PROBS, choice, scope))
  # 'group': E * mean_g sum_e f_ge p_ge = 2 * (.8 + .5) / 2; 'batch': 2 * (.75 * .6 + .25 * .4).
  np.testing.assert_allclose(loss('group'), 1.3, rtol=1e-6)
  np.testing.assert_allclose(loss('batch'), 1.1, rtol=1e-6)
  fraction, mean_prob = routing.load_balancing_statistics(TINY_PROBS, choice, 'batch')
  np.testing.assert_allclose(fraction, [[.75, .25]], rtol=1e-6)
  np.testing.assert_allclose(mean_prob, [[.6, .4]], rtol=1e-6)


def test_a_group_of_padding_only_is_left_out_of_the_loss():
  choice = jax.lax.top_k(TINY_PROBS, 1)[1]
  mask = np.array([[True, True], [False, False]])
  fraction, mean_prob = routing.load_balancing_statistics(TINY_PROBS, choice, 'group', mask)
  np.testing.assert_array_equal(fraction[1], [0, 0])
  np.testing.assert_array_equal(mean_prob[1], [0, 0])
  # Group 0 alone: 2 * (1 * .8 + 0 * .2), not diluted by group 1 to 0.8.
  np.testing.assert_allclose(routing.load_balancing_loss(fraction, mean_prob), 1.6, rtol=1e-6)


def test_the_default_balance_is_a_switch_loss_per_layer_weight_001_per_group():
  assert type(MoeConfig().balance) is balances.Switch   # pylint: disable=unidiomatic-typecheck
  assert (MoeConfig().balance.weight, MoeConfig().balance.scope) == (0.01, 'group')


@pytest.mark.parametrize('make, error', [
    (lambda: balances.Switch(scope='global'),
     "balance.Switch.scope = 'global': expected one of ('group', 'batch')."),
    (lambda: balances.PooledSwitch(weight=-1.0),
     'balance.PooledSwitch.weight = -1.0: expected a number >= 0.0.'),
    (lambda: MoeConfig(balance='pooled'),
     "moe.MoeConfig.balance = 'pooled': expected a balance.Switch object, @balance.Switch() or "
     '@balance.PooledSwitch() in gin (from upcycle.moe import balance), with its fields bound '
     'on it (balance.Switch.weight = 0.01).'),
])
def test_load_balancing_options_are_checked(make, error):
  with pytest.raises(fields.ConfigError) as raised:
    make()
  assert str(raised.value) == error


def test_router_z_loss_against_numpy():
  logits = np.random.default_rng(1).normal(size=(2, 5, 3)).astype(np.float32) * 3
  expected = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
  np.testing.assert_allclose(routing.router_z_loss(logits), expected, rtol=1e-5)
  mask = np.array([[True] * 5, [True, False, False, False, False]])
  expected = np.mean(np.log(np.exp(logits).sum(-1))[mask] ** 2)
  np.testing.assert_allclose(routing.router_z_loss(logits, mask), expected, rtol=1e-5)


def test_effective_experts_is_the_exp_entropy_of_the_load():
  """Closed form: two experts with every token -> 2; eight equal -> 8; one -> 1; shares
  (1/2, 1/4, 1/4) -> exp(1.5 log 2) = 2^1.5."""
  cases = [([5., 5., 0., 0., 0., 0., 0., 0.], 2.0), ([3.] * 8, 8.0), ([0., 7., 0.], 1.0),
           ([2., 1., 1.], 2 ** 1.5), ([0., 0.], 1.0)]
  for counts, expected in cases:
    np.testing.assert_allclose(routing.effective_experts(np.array(counts, np.float32)), expected,
                               rtol=1e-6)
