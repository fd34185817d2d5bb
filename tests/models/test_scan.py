"""Scanned layers and remat compute the unrolled model: logits, gradients, sharded, decoding."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.helpers import jitted, MODEL_T5, MODEL_VIT, tokens
from upcycle import fields, partitioning, tree, upcycling
from upcycle.models.families import abstract_params
from upcycle.models import T5, ViT, scan_layout
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, aux_losses, metrics, routers
from upcycle.train.step import per_layer_metrics

# Four layers, 'every_other': two periods of (dense, MoE) per stack.
T5_MOE = dataclasses.replace(
    MODEL_T5, num_encoder_layers=4, num_decoder_layers=4,
    encoder_moe=MoeConfig(num_experts=4, train_capacity_factor=1.0, eval_capacity_factor=1.0),
    decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2), dispatch='indices'))
T5_DENSE = dataclasses.replace(T5_MOE, encoder_moe=None, decoder_moe=None)
VIT_MOE = dataclasses.replace(MODEL_VIT, depth=4, moe=MoeConfig(num_experts=4,
                                                                router=routers.TopK(k=2)))
VIT_DENSE = dataclasses.replace(VIT_MOE, moe=None)
CONFIGS = {'t5_moe': T5_MOE, 't5_dense': T5_DENSE, 'vit_moe': VIT_MOE, 'vit_dense': VIT_DENSE}


def _model_and_inputs(config):
  if isinstance(config, type(MODEL_T5)):
    return T5(config), (tokens(0, (8, 8), 64), tokens(1, (8, 6), 64))
  return ViT(config), (jax.random.normal(jax.random.PRNGKey(0), (8, 8, 8, 3)),)


def _loss_fn(config):
  model, inputs = _model_and_inputs(config)

  def loss(params):
    logits, state = model.apply({'params': params}, *inputs, mutable=MOE_COLLECTIONS)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1]) + aux_losses(state)['total'], logits
  return loss


@functools.lru_cache(maxsize=None)
def _unrolled(name):
  config = CONFIGS[name]
  model, inputs = _model_and_inputs(config)
  params = tree.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), *inputs))['params']
  (loss, logits), grads = jax.jit(jax.value_and_grad(_loss_fn(config), has_aux=True))(params)
  return params, loss, logits, grads


def _assert_trees_close(actual, expected, tol=1e-5):
  """Every leaf within `tol` x max(1, its largest |value|) (float32 sums in another order)."""
  assert tree.flatten(actual).keys() == tree.flatten(expected).keys()
  for path, leaf in tree.flatten(expected).items():
    atol = tol * max(1.0, float(np.max(np.abs(np.asarray(leaf)), initial=0.0)))
    np.testing.assert_allclose(tree.flatten(actual)[path], leaf, rtol=0, atol=atol, err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize('name,scan,policy', [
    ('t5_moe', True, 'none'), ('t5_moe', True, 'full'), ('t5_moe', False, 'full'),
    ('t5_moe', True, 'minimal'), ('t5_dense', True, 'dots'),
    ('vit_moe', True, 'none'), ('vit_moe', True, 'full'), ('vit_moe', False, 'minimal'),
    ('vit_dense', True, 'full')])
def test_scan_and_remat_equal_the_unrolled_model(name, scan, policy):
  params, loss, logits, grads = _unrolled(name)
  config = dataclasses.replace(CONFIGS[name], scan_layers=scan, remat_policy=policy)
  layout = (lambda t: scan_layout.stack(t, config)) if scan else (lambda t: t)
  (got_loss, got_logits), got_grads = jax.jit(
      jax.value_and_grad(_loss_fn(config), has_aux=True))(layout(params))
  np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-5)
  np.testing.assert_allclose(got_loss, loss, rtol=0, atol=1e-5)
  _assert_trees_close(scan_layout.unstack(got_grads, config) if scan else got_grads, grads)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['t5_moe', 'vit_moe'])
def test_scanned_sharded_equals_unrolled_unsharded(name):
  assert jax.device_count() == 8, 'tests/conftest.py simulates 8 CPU devices'
  params, loss, logits, grads = _unrolled(name)
  config = dataclasses.replace(CONFIGS[name], scan_layers=True, remat_policy='full')
  model, inputs = _model_and_inputs(config)
  mesh = partitioning.make_mesh(num_expert_partitions=2, num_model_partitions=2)
  with partitioning.activate(mesh):
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)['params']
    shardings = partitioning.logical_sharding(boxed, mesh)
    sharded = jax.device_put(scan_layout.stack(params, config), shardings)
    sharded_inputs = [jax.device_put(x, partitioning.batch_sharding(mesh, x.ndim))
                      for x in inputs]

    def fn(p, *xs):
      def loss(q):
        out, state = model.apply({'params': q}, *xs, mutable=MOE_COLLECTIONS)
        return jnp.mean(jax.nn.log_softmax(out)[..., 1]) + aux_losses(state)['total'], out
      return jax.value_and_grad(loss, has_aux=True)(p)
    (got_loss, got_logits), got_grads = jax.jit(fn, out_shardings=((None, None), shardings))(
        sharded, *sharded_inputs)
  np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-5)
  np.testing.assert_allclose(got_loss, loss, rtol=0, atol=1e-5)
  _assert_trees_close(scan_layout.unstack(got_grads, config), grads)
  flat = tree.flatten(got_grads)
  expert = next(v for p, v in flat.items() if '/expert/' in p)
  assert expert.sharding.spec[:2] == (None, 'expert')   # [layers, E, ...]: layers replicated


def test_stacked_parameters_have_the_layers_axis():
  config = dataclasses.replace(T5_MOE, scan_layers=True)
  axes = partitioning.logical_axes(jax.eval_shape(
      T5(config).init, jax.random.PRNGKey(0), *_model_and_inputs(config)[1])['params'])
  assert axes['encoder/layers/subblock_1/mlp/expert/wi_0/kernel'] == (
      'layers', 'expert', 'embed', 'mlp')
  assert axes['decoder/layers/subblock_0/self_attention/query/kernel'] == (
      'layers', 'embed', 'joined_kv')
  assert axes['encoder/relpos_bias/rel_embedding'] == ('heads', 'relpos_buckets')
  assert dict(partitioning.LOGICAL_AXIS_RULES)['layers'] is None


def test_shared_expert_is_stacked_with_its_moe_sub_block():
  moe = dataclasses.replace(T5_MOE.encoder_moe, shared_expert=True, shared_expert_d_ff=8)
  config = dataclasses.replace(T5_MOE, encoder_moe=moe)
  scanned = dataclasses.replace(config, scan_layers=True)
  boxed = jax.eval_shape(T5(scanned).init, jax.random.PRNGKey(0),
                         *_model_and_inputs(scanned)[1])['params']
  path = 'encoder/layers/subblock_1/mlp/shared_expert/wi_0/kernel'
  assert partitioning.logical_axes(boxed)[path] == ('layers', 'embed', 'mlp')
  shapes = lambda t: {p: tuple(x.shape) for p, x in tree.flatten(t).items()}
  assert shapes(boxed)[path] == (2, 16, 8)
  assert shapes(scan_layout.stack(abstract_params(config), config)) == shapes(boxed)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['t5_moe', 'vit_moe', 'vit_dense'])
def test_stack_unstack_round_trip_and_abstract_shapes(name):
  config = CONFIGS[name]
  params = _unrolled(name)[0]
  stacked = scan_layout.stack(params, config)
  _assert_trees_close(scan_layout.unstack(stacked, config), params, tol=0)
  scanned_abstract = abstract_params(dataclasses.replace(config, scan_layers=True))
  shapes = lambda t: {p: tuple(x.shape) for p, x in tree.flatten(t).items()}
  assert shapes(stacked) == shapes(scanned_abstract)
  assert shapes(scan_layout.stack(abstract_params(config), config)) == shapes(scanned_abstract)
  assert shapes(scan_layout.unstack(scanned_abstract, config)) == shapes(params)


def test_periods_and_non_periodic_placements():
  assert scan_layout.pattern((1, 3, 5, 7), 8) == (False, True)
  assert scan_layout.pattern((), 8) == (False,)
  assert scan_layout.pattern(tuple(range(8)), 8) == (True,)
  assert scan_layout.pattern((3, 7), 8) == (False, False, False, True)
  with pytest.raises(fields.ConfigError,
                     match=r'^models.T5Config.encoder_moe_layers: .*scan_layers=False'):
    dataclasses.replace(T5_MOE, scan_layers=True, encoder_moe_layers='last_2')
  with pytest.raises(fields.ConfigError,
                     match=r"^models.ViTConfig.remat_policy = 'some': expected one of"):
    dataclasses.replace(VIT_MOE, remat_policy='some')


@pytest.mark.slow
def test_upcycling_a_dense_checkpoint_into_a_scanned_moe_is_upcycle_then_stack():
  dense_params = _unrolled('t5_dense')[0]
  target = abstract_params(T5_MOE)     # the unrolled MoE model
  moe_params, _ = upcycling.upcycle(dense_params, target, experts='copy', router='normal',
                                    rng=jax.random.PRNGKey(1))
  scanned = dataclasses.replace(T5_MOE, scan_layers=True)
  scanned_params = scan_layout.stack(moe_params, scanned)
  # Also from the stacked dense checkpoint: unstack, upcycle, stack.
  from_stacked_dense = scan_layout.stack(upcycling.upcycle(
      scan_layout.unstack(scan_layout.stack(dense_params, T5_DENSE), T5_DENSE), target,
      experts='copy', router='normal', rng=jax.random.PRNGKey(1))[0], scanned)
  _assert_trees_close(from_stacked_dense, scanned_params, tol=0)
  _, inputs = _model_and_inputs(T5_MOE)
  expected = jitted(T5(T5_MOE).apply, {'params': moe_params}, *inputs)
  got = jitted(T5(scanned).apply, {'params': scanned_params}, *inputs)
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
  assert scan_layout.unstack(scanned_params, scanned).keys() == moe_params.keys()


@pytest.mark.slow
def test_scanned_decoding_equals_unrolled():
  params = _unrolled('t5_moe')[0]
  scanned = dataclasses.replace(T5_MOE, scan_layers=True)
  encoder_tokens = tokens(0, (8, 8), 64)
  steps = tokens(2, (8, 3), 64)

  def decode(config, p):
    model = T5(config)
    prefill = jax.jit(lambda p: model.apply({'params': p}, encoder_tokens, 3,
                                            method=T5.prefill, mutable=['cache']))
    step = jax.jit(lambda p, cache, token: model.apply({'params': p, **cache}, token,
                                                       method=T5.decode_step, mutable=['cache']))
    _, cache = prefill(p)
    out = []
    for t in range(3):   # one compiled step, as the decoding loops run it
      logits, cache = step(p, cache, steps[:, t:t + 1])
      out.append(logits)
    return jnp.stack(out, 1), cache['cache']

  expected, _ = decode(T5_MOE, params)
  got, cache = decode(scanned, scan_layout.stack(params, scanned))
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
  # Every cache leaf keeps the batch first (beam search reorders it): [batch, layers, ...].
  key = cache['decoder']['layers']['subblock_0']['self_attention']['cached_key']
  assert key.shape == (8, 2, 3, T5_MOE.num_heads, T5_MOE.d_kv)


@pytest.mark.slow
def test_scanned_model_sows_one_value_per_layer():
  params = _unrolled('vit_moe')[0]
  config = dataclasses.replace(VIT_MOE, scan_layers=True)
  _, inputs = _model_and_inputs(config)
  _, expected = jitted(ViT(VIT_MOE).apply, {'params': params}, *inputs, mutable=MOE_COLLECTIONS)
  _, got = jitted(ViT(config).apply, {'params': scan_layout.stack(params, config)}, *inputs,
                  mutable=MOE_COLLECTIONS)
  per_layer = scan_layout.unstack(got['moe_metrics'], config)
  _assert_trees_close(per_layer, nn.meta.unbox(expected['moe_metrics']))
  # What the train step logs: the same per-layer names and values, scanned or not.
  logged, want = per_layer_metrics(config)(got), per_layer_metrics(VIT_MOE)(expected)
  assert logged.keys() == want.keys() == metrics(expected).keys()
  _assert_trees_close(logged, nn.meta.unbox(want))
  np.testing.assert_allclose(aux_losses(got)['total'], aux_losses(expected)['total'], atol=1e-7)
