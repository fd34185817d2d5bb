"""MoeLayer: the function-preserving invariant, both dispatches, metrics and errors."""

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import layers, partitioning
from upcycle.fields import ConfigError
from upcycle.moe import balance as balances
from upcycle.moe import (MOE_COLLECTIONS, MoeConfig, MoeLayer, ROUTER_LOGITS, aux_losses, capacity,
                         grouping, metrics, router_logits, routers, routing)
from tests.models.helpers import jitted
from tests.moe.helpers import flaxformer_arrays, primitive_names

D_MODEL, D_FF, E = 8, 16, 4
EXPERT = functools.partial(layers.GatedMlp, d_ff=D_FF)
# The routers by the names routing.npz files Flaxformer's decisions under.
TOP2, EXPERT_CHOICE = routers.TopK(k=2), routers.ExpertsChoose()
ROUTERS = {'tokens_choose': TOP2, 'experts_choose': EXPERT_CHOICE}


@functools.lru_cache(maxsize=None)
def dense_setup():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, D_MODEL))
  dense = EXPERT()
  params = nn.meta.unbox(jitted(dense.init, jax.random.PRNGKey(1), x, True))['params']
  return x, params, jitted(dense.apply, {'params': params}, x, True)


def moe_params(config, x, dense_params=None, seed=2):
  """MoE params; experts are copies of `dense_params` when given, router random."""
  init = jitted(MoeLayer(config, EXPERT).init, jax.random.PRNGKey(seed), x, True)
  params = nn.meta.unbox(init)['params']
  if dense_params is not None:
    params['expert'] = jax.tree.map(lambda w: jnp.stack([w] * config.num_experts), dense_params)
  # A strongly opinionated router, to show the invariant holds for any router.
  w = params['router']['router_weights']['w']['kernel']
  params['router']['router_weights']['w']['kernel'] = 5.0 * jax.random.normal(
      jax.random.PRNGKey(seed + 1), w.shape)
  return params


def run(config, params, x, deterministic=True, rngs=None):
  return jitted(MoeLayer(config, EXPERT).apply, {'params': params}, x, deterministic, rngs=rngs,
                mutable=MOE_COLLECTIONS)


@pytest.mark.parametrize('router_init,d_model,std', [
    ('constant', 64, 0.02), ('width_scaled', 64, 0.02 * np.sqrt(768 / 64)),
    ('width_scaled', 768, 0.02), (0.05, 32, 0.05)])
def test_the_router_kernel_is_drawn_at_the_std_of_router_init(router_init, d_model, std):
  """The sample std of the initialized kernel `[d_model, 64]` against the std the setting names
  (0.02 * sqrt(768 / d_model) for 'width_scaled', Flaxformer's 0.02 for 'constant'), within 5
  standard errors of a sample std of n normal draws, std / sqrt(2 (n - 1))."""
  config = MoeConfig(num_experts=64, router_init=router_init)
  x = jnp.ones((1, 4, d_model))
  params = nn.meta.unbox(jitted(MoeLayer(config, EXPERT).init, jax.random.PRNGKey(0), x,
                                True))['params']
  kernel = np.asarray(params['router']['router_weights']['w']['kernel'])
  assert kernel.shape == (d_model, 64)
  assert abs(kernel.std() / std - 1) < 5 / np.sqrt(2 * (kernel.size - 1))


def test_a_router_init_that_is_no_std_is_refused_naming_its_binding():
  with pytest.raises(ConfigError, match=r"^moe\.MoeConfig\.router_init = 'wide': expected one "
                     r"of \('constant', 'width_scaled'\)"):
    MoeConfig(router_init='wide')
  with pytest.raises(ConfigError, match=r'^moe\.MoeConfig\.router_init = -0\.1: expected a '
                     r'number > 0'):
    MoeConfig(router_init=-0.1)


@pytest.mark.slow
@pytest.mark.parametrize('dispatch', ['masked', 'indices'])
@pytest.mark.parametrize('router', [routers.TopK(k=1), TOP2, EXPERT_CHOICE])
def test_identical_experts_normalized_equal_the_dense_mlp(dispatch, router):
  x, dense_params, dense_out = dense_setup()
  # Enough capacity: Top-K capacity ceil(K*C*S/E) >= S; Expert Choice with C >= E.
  config = MoeConfig(num_experts=E, router=router, eval_capacity_factor=float(E),
                     normalize_combine_weights=True, dispatch=dispatch)
  out, state = run(config, moe_params(config, x, dense_params), x)
  np.testing.assert_allclose(out, dense_out, atol=1e-5)
  for name, value in metrics(state).items():
    if name.endswith('fraction_dropped_tokens'):
      assert value == 0.0


@pytest.mark.slow
@pytest.mark.parametrize('router', ['tokens_choose', 'experts_choose'])
def test_without_normalization_output_is_dense_scaled_by_summed_weights(router):
  """Each token's output is the dense MLP's times the sum of its combine weights as
  Flaxformer's router decided them, on Flaxformer's input and router kernel (scaled/ in
  routing.npz: Top-2 capacity 2, Expert Choice capacity 1; some tokens dropped)."""
  arrays = flaxformer_arrays()
  _, dense_params, _ = dense_setup()
  x = jnp.asarray(arrays['scaled/x'])                        # [2, 8, 8]: a group per example
  dense_out = jitted(EXPERT().apply, {'params': dense_params}, x, True)
  config = MoeConfig(num_experts=E, router=ROUTERS[router], eval_capacity_factor=0.5,
                     capacity_convention=capacity.Vmoe(multiple_of=1), dispatch='indices')
  combine = arrays[f'scaled/{router}/combine']               # [G, S, E, C]
  assert config.capacity(8, True) == combine.shape[-1]
  params = moe_params(config, x, dense_params)
  params['router']['router_weights']['w']['kernel'] = jnp.asarray(arrays['scaled/router_kernel'])
  out, _ = run(config, params, x)
  np.testing.assert_allclose(out, dense_out * combine.sum(axis=(-2, -1))[..., None], atol=1e-5)


def test_top_k_routing_metrics_and_masked_dispatch_have_no_scatter_forward_or_backward():
  """Top-2 with Batch Priority Routing, padding, normalized weights, the metrics and the
  auxiliary losses in the loss: no scatter of any kind (each is serialized on TPU, and the
  slot-assignment scatters were most of this layer's bytes accessed there)."""
  x, _, _ = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=2, batch_priority=True),
                     eval_capacity_factor=0.5, capacity_convention=capacity.Vmoe(multiple_of=1),
                     normalize_combine_weights=True, dispatch='masked')
  layer = MoeLayer(config, EXPERT)
  padding = jnp.arange(x.shape[1])[None, :] < jnp.array([[x.shape[1]], [3]])

  def loss(p, x):
    out, state = layer.apply({'params': p}, x, True, padding, mutable=MOE_COLLECTIONS)
    return jnp.sum(out ** 2) + aux_losses(state)['total'] + sum(
        jnp.sum(m) for m in jax.tree.leaves(state['moe_metrics']))

  names = primitive_names(jax.grad(loss, argnums=(0, 1)), moe_params(config, x), x)
  assert 'dot_general' in names and not {n for n in names if 'scatter' in n}, names


@pytest.mark.slow
@pytest.mark.parametrize('router', [TOP2, routers.TopK(k=2, batch_priority=True),
                                    EXPERT_CHOICE])
def test_masked_and_indices_dispatch_agree_on_outputs_and_gradients(router):
  x, _, _ = dense_setup()
  base = MoeConfig(num_experts=E, router=router,
                   eval_capacity_factor=0.5, capacity_convention=capacity.Vmoe(multiple_of=1),
                   normalize_combine_weights=True)
  params = moe_params(base, x)   # distinct random experts, with overflow
  results = []
  for dispatch in ('masked', 'indices'):
    config = MoeConfig(**{**base.__dict__, 'dispatch': dispatch})
    def loss(p, x):
      out, state = run(config, p, x)
      return jnp.sum(out ** 2) + aux_losses(state)['total']
    results.append((loss(params, x), jax.grad(loss, argnums=(0, 1))(params, x)))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(l0, l1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g0, g1)


@pytest.mark.slow
def test_grouping_routes_within_groups_and_rejects_sizes_that_do_not_divide():
  x, dense_params, dense_out = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.ExpertsChoose(), grouping=grouping.Fixed(4),
                     eval_capacity_factor=float(E), normalize_combine_weights=True)
  out, _ = run(config, moe_params(config, x, dense_params), x)
  np.testing.assert_allclose(out, dense_out, atol=1e-5)
  bad = MoeConfig(num_experts=E, grouping=grouping.Fixed(5))
  with pytest.raises(ValueError, match=r'grouping\.Fixed\.size = 5 does not divide the 16 tokens'):
    run(bad, moe_params(config, x), x)


def test_expert_choice_in_a_causal_stack_is_refused():
  x, _, _ = dense_setup()
  with pytest.raises(ValueError, match='Expert Choice .* a causal decoder would read the future'):
    MoeLayer(MoeConfig(num_experts=E), EXPERT, causal=True).init(jax.random.PRNGKey(0), x, True)


@pytest.mark.slow
def test_metrics_and_aux_losses_are_reported():
  x, _, _ = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=1), eval_capacity_factor=0.5,
                     capacity_convention=capacity.Vmoe(multiple_of=1),
                     balance=balances.Switch(weight=0.5), router_z_loss_weight=0.25)
  params = moe_params(config, x)
  _, state = run(config, params, x)
  m = metrics(state)
  assert config.capacity(8, True) == 1   # 1 slot per expert: at most 4 of 8 tokens routed
  # In numpy: each example is a group of 8 tokens; an expert keeps the first token that
  # chose it (its one slot), so a group keeps one token per distinct top-1 expert.
  logits = np.asarray(x) @ np.asarray(params['router']['router_weights']['w']['kernel'])
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)                                  # [2, 8, E]
  chosen = np.eye(E)[logits.argmax(-1)]                                  # [2, 8, E] one-hot
  taken = chosen.any(axis=1)                                             # [2, E]
  np.testing.assert_allclose(m['fraction_dropped_tokens'], 1 - taken.sum() / 16, rtol=1e-6)
  np.testing.assert_allclose(m['tokens_per_expert'], taken.mean(0), rtol=1e-6)
  np.testing.assert_allclose(m['expert_load'], taken.mean(0) / 8, rtol=1e-6)
  np.testing.assert_allclose(m['expert_usage'], taken.sum() / (E * 2), rtol=1e-6)
  np.testing.assert_allclose(m['router_top1_probability'], probs.max(-1).mean(), rtol=1e-5)
  losses = aux_losses(state)
  # Switch loss per group, E * sum_e f_e p_e, averaged over the groups.
  balance = E * np.mean(np.sum(chosen.mean(1) * probs.mean(1), -1))
  np.testing.assert_allclose(losses['load_balancing_loss'], balance, rtol=1e-5)
  z_loss = np.mean((np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
                    + logits.max(-1)) ** 2)
  np.testing.assert_allclose(losses['router_z_loss'], z_loss, rtol=1e-5)
  np.testing.assert_allclose(losses['total'], 0.5 * balance + 0.25 * z_loss, rtol=1e-5)


def test_jitter_applies_only_in_training_and_uses_its_own_rng():
  x, dense_params, _ = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=1), jitter_noise=0.5,
                     eval_capacity_factor=0.5, train_capacity_factor=0.5,
                     capacity_convention=capacity.Vmoe(multiple_of=1))
  params = moe_params(config, x)
  quiet = MoeConfig(**{**config.__dict__, 'jitter_noise': 0.0})
  eval_out, _ = run(config, params, x)
  np.testing.assert_allclose(eval_out, run(quiet, params, x)[0])
  train = [run(config, params, x, False, {'jitter': jax.random.PRNGKey(s)})[0] for s in (0, 0, 1)]
  np.testing.assert_array_equal(train[0], train[1])
  assert not np.allclose(train[0], train[2])
  with pytest.raises(Exception, match='jitter'):
    run(config, params, x, False, {})


def test_batch_priority_routing_in_a_causal_stack_is_refused():
  x, _, _ = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=2, batch_priority=True))
  with pytest.raises(ValueError, match='batch_priority = True cannot be used in a causal'):
    MoeLayer(config, EXPERT, causal=True).init(jax.random.PRNGKey(0), x, True)


@pytest.mark.slow
@pytest.mark.parametrize('router', [TOP2, EXPERT_CHOICE])
def test_flaxformer_groups_span_examples_like_fixed_groups(router):
  # [2, 8] = 16 tokens, E = 4, N = 4: 16 // 4 = 4 groups of 4 consecutive tokens of the flattened
  # batch, exactly what Fixed(4) routes; with little capacity so that grouping matters.
  x, _, _ = dense_setup()
  fixed = MoeConfig(num_experts=E, router=router, grouping=grouping.Fixed(4),
                    eval_capacity_factor=1.0, capacity_convention=capacity.T5X(minimum=1))
  flax_rule = MoeConfig(**{**fixed.__dict__, 'grouping': grouping.Flaxformer(max_group_size=4)})
  params = moe_params(fixed, x)
  np.testing.assert_array_equal(run(flax_rule, params, x)[0], run(fixed, params, x)[0])


@pytest.mark.slow
def test_flaxformer_padding_is_masked_and_sliced_off():
  # [2, 3] = 6 tokens, E = 4: whole examples need b = 2 (+6 tokens), positions s = 1 (+2), so
  # one position per example: 8 tokens, max(8 // 4, 4) = 4 groups of 2. The padding claims no
  # slot, so the output is that of the same layer on the explicitly padded, masked input.
  x = dense_setup()[0][:, :3]
  config = MoeConfig(num_experts=E, router=routers.TopK(k=2), eval_capacity_factor=1.0,
                     capacity_convention=capacity.T5X(),
                     grouping=grouping.Flaxformer(max_group_size=4), normalize_combine_weights=True)
  assert config.group_plan(2, 3) == grouping.GroupPlan(4, 2, 0, 1)
  params = moe_params(config, x)
  out, state = jitted(MoeLayer(config, EXPERT).apply, {'params': params}, x, True,
                      mutable=[ROUTER_LOGITS])
  assert out.shape == x.shape
  padded = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
  mask = jnp.array([[True, True, True, False]] * 2)
  fixed = MoeConfig(**{**config.__dict__, 'grouping': grouping.Fixed(2)})
  reference = jitted(MoeLayer(fixed, EXPERT).apply, {'params': params}, padded, True, mask)
  np.testing.assert_allclose(out, reference[:, :3], atol=1e-6)
  logits = router_logits(state)['']
  np.testing.assert_allclose(logits, x @ params['router']['router_weights']['w']['kernel'],
                             atol=1e-5)



# Two Top-1 layers of one stack, E = 2, two groups (examples) of two tokens; the choices are
# the argmax. Per group (f; p), layer 0: ([1, 0]; [.8, .2]), ([.5, .5]; [.4, .6]); layer 1:
# ([0, 1]; [.2, .8]), ([0, 1]; [.3, .7]).
STACK_PROBS = np.array([[[[.9, .1], [.7, .3]], [[.6, .4], [.2, .8]]],
                        [[[.3, .7], [.1, .9]], [[.4, .6], [.2, .8]]]], np.float32)


def pooled_sow(probs, scope, z_loss):
  """What a `balance.PooledSwitch` layer sows for `probs` (weights .5 and .25)."""
  fraction, mean_prob = routing.load_balancing_statistics(
      probs, jax.lax.top_k(probs, 1)[1], scope)
  return {'pooled_balance': (balances.PooledStatistics(fraction, mean_prob, weight=0.5),),
          'router_z_loss': (z_loss,), 'weighted': (0.25 * z_loss,)}


# Pooled over the two layers, (f; p) per group: ([.5, .5]; [.5, .5]), ([.25, .75]; [.35, .65]);
# over the batch: ([.375, .625]; [.425, .575]). Separate, the layers' losses would be 1.3 and 1.5
# ('group'), 1.1 and 1.5 ('batch').
@pytest.mark.parametrize('scope,own_loss_0,stack_loss', [('group', 1.3, 1.075),
                                                         ('batch', 1.1, 1.0375)])
def test_pooled_load_balancing_closed_form(scope, own_loss_0, stack_loss):
  decoder = {f'layers_{i}': {'mlp': pooled_sow(STACK_PROBS[i], scope, jnp.float32(i))}
             for i in range(2)}
  encoder = {'layers_0': {'mlp': pooled_sow(STACK_PROBS[0], scope, jnp.float32(2.0))}}
  losses = aux_losses({'aux_loss': {'encoder': encoder, 'decoder': decoder}})
  # Each stack pools its own layers: the encoder's one layer keeps its own loss.
  expected = (own_loss_0 + 2 * stack_loss) / 3
  np.testing.assert_allclose(losses['load_balancing_loss'], expected, rtol=1e-6)
  np.testing.assert_allclose(losses['router_z_loss'], 1.0, rtol=1e-6)
  np.testing.assert_allclose(losses['total'], 0.5 * expected + 0.25 * 1.0, rtol=1e-6)
  # A scanned stack sows the same with a leading `layers` axis.
  scanned = jax.tree.map(lambda *v: jnp.stack(v), decoder['layers_0'], decoder['layers_1'])
  unrolled = aux_losses({'aux_loss': {'decoder': decoder}})
  for name, value in aux_losses({'aux_loss': {'decoder': {'layers': scanned}}}).items():
    np.testing.assert_allclose(value, unrolled[name], rtol=1e-6)


# The shapes of test_without_normalization_output_is_dense_scaled_by_summed_weights.
LAYER_CONFIG = dict(num_experts=E, eval_capacity_factor=0.5,
                    capacity_convention=capacity.Vmoe(multiple_of=1),
                    dispatch='indices')


@pytest.mark.parametrize('scope', ['group', 'batch'])
def test_layer_losses_in_each_scope_and_pooled_over_one_layer(scope):
  x, _, _ = dense_setup()
  separate = MoeConfig(router=routers.TopK(), balance=balances.Switch(scope=scope),
                       **LAYER_CONFIG)
  params = moe_params(separate, x)
  _, state = jitted(MoeLayer(separate, EXPERT).apply, {'params': params}, x, True,
                    mutable=MOE_COLLECTIONS + (ROUTER_LOGITS,))
  # One group per example: [G, S, E]. The default scope against Flaxformer's loss:
  # test_flaxformer_reference.py.
  p = np.asarray(jax.nn.softmax(router_logits(state)['']), np.float64)
  chosen = np.eye(E)[np.argsort(-p, axis=-1)[..., :2]].max(axis=-2)  # [G, S, E]
  axes = 1 if scope == 'group' else (0, 1)
  expected = E * np.mean(np.sum(chosen.mean(axes) * p.mean(axes), axis=-1))
  losses = aux_losses(state)
  np.testing.assert_allclose(losses['load_balancing_loss'], expected, rtol=1e-5)
  pooled = MoeConfig(**{**separate.__dict__, 'balance': balances.PooledSwitch(scope=scope)})
  _, state = run(pooled, params, x)
  assert 'load_balancing_loss' not in state['aux_loss']
  for name, value in aux_losses(state).items():
    np.testing.assert_allclose(value, losses[name], rtol=1e-6)


def test_expert_choice_has_no_load_balancing_loss_in_any_scope():
  x, _, _ = dense_setup()
  config = MoeConfig(router=routers.ExpertsChoose(),
                     balance=balances.PooledSwitch(scope='batch'), **LAYER_CONFIG)
  _, state = run(config, moe_params(config, x), x)
  assert 'pooled_balance' not in state['aux_loss']
  assert float(aux_losses(state)['load_balancing_loss']) == 0.0


def test_shared_expert_adds_its_mlp_to_the_routed_output():
  x, _, _ = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=2), eval_capacity_factor=0.5,
                     capacity_convention=capacity.Vmoe(multiple_of=1), dispatch='indices',
                     shared_expert=True)
  shared = functools.partial(layers.GatedMlp, d_ff=4)
  layer = MoeLayer(config, EXPERT, shared_expert=shared)
  params = nn.meta.unbox(jitted(layer.init, jax.random.PRNGKey(2), x, True))['params']
  assert {n: w['kernel'].shape for n, w in params['shared_expert'].items()} == {
      'wi_0': (D_MODEL, 4), 'wi_1': (D_MODEL, 4), 'wo': (4, D_MODEL)}
  out, _ = jitted(layer.apply, {'params': params}, x, True, mutable=MOE_COLLECTIONS)
  routed_params = {k: v for k, v in params.items() if k != 'shared_expert'}
  routed, _ = run(MoeConfig(**{**config.__dict__, 'shared_expert': False}), routed_params, x)
  by_hand = routed + jitted(shared().apply, {'params': params['shared_expert']}, x, True)
  np.testing.assert_allclose(out, by_hand, atol=1e-6)
  with pytest.raises(ValueError, match='shared_expert=True but the model passed no shared_expert'):
    run(config, routed_params, x)
  with pytest.raises(ValueError, match='shared_expert_d_ff = 4 without a shared expert'):
    MoeConfig(shared_expert_d_ff=4)


def test_copied_shared_expert_is_dense_only_with_zero_routed_output():
  """Why upcycling a shared expert zeroes the routed experts' output (`experts.ZeroOutput`):
  copied experts, even with normalized combine weights, add a second dense output."""
  x, dense_params, dense_out = dense_setup()
  config = MoeConfig(num_experts=E, router=routers.TopK(k=2), eval_capacity_factor=float(E),
                     normalize_combine_weights=True, shared_expert=True)
  routed = MoeConfig(**{**config.__dict__, 'shared_expert': False})
  params = {**moe_params(routed, x, dense_params), 'shared_expert': dense_params}
  layer = MoeLayer(config, EXPERT, shared_expert=EXPERT)
  out, _ = jitted(layer.apply, {'params': params}, x, True, mutable=MOE_COLLECTIONS)
  np.testing.assert_allclose(out, 2 * dense_out, atol=1e-5)
  params['expert']['wo']['kernel'] = jnp.zeros_like(params['expert']['wo']['kernel'])
  out, _ = jitted(layer.apply, {'params': params}, x, True, mutable=MOE_COLLECTIONS)
  np.testing.assert_array_equal(out, dense_out)


@pytest.mark.parametrize('replicas, warned', [(1, 'grouping.Flaxformer.num_expert_replicas = 2'),
                                              (2, None)])
def test_groups_that_span_devices_are_named_with_the_replicas_that_split_them(
    replicas, warned, caplog):
  # data 2 x expert 4: 8 batch shards. Flaxformer's rule with E = 4, R = 1: 4 groups of the
  # 128 tokens, so each group spans 2 devices; with R = 2, 8 groups of 16, one per shard.
  mesh = partitioning.make_mesh(num_expert_partitions=E)
  config = MoeConfig(num_experts=E, grouping=grouping.Flaxformer(num_expert_replicas=replicas))
  x = jax.ShapeDtypeStruct((8, 16, D_MODEL), jnp.float32)
  with partitioning.activate(mesh), caplog.at_level(logging.WARNING, logger='upcycle.moe.layer'):
    jax.eval_shape(functools.partial(MoeLayer(config, EXPERT, name='mlp').init,
                                     deterministic=True), jax.random.PRNGKey(0), x)
  assert config.group_plan(8, 16).num_groups == {1: 4, 2: 8}[replicas]
  messages = [r.getMessage() for r in caplog.records]
  if warned is None:
    assert messages == []
  else:
    assert len(messages) == 1 and warned in messages[0], messages
    assert '4 routing groups of 32 tokens' in messages[0] and '8 batch shards' in messages[0]
