"""Sharded forward passes and gradients on 8 simulated devices equal unsharded ones, with the
default rules and with the fully-sharded-data-parallel ones."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.models.helpers import MODEL_T5, MODEL_VIT, tokens
from upcycle import fields, partitioning, tree
from upcycle.optimizer_state import shardings as slots
from upcycle.models import Llama, LlamaConfig, T5, ViT
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, aux_losses, grouping, routers
from upcycle.train import optimizers

T5_MOE = dataclasses.replace(
    MODEL_T5, num_encoder_layers=2, num_decoder_layers=2,
    encoder_moe=MoeConfig(num_experts=8, train_capacity_factor=1.0, eval_capacity_factor=1.0),
    decoder_moe=MoeConfig(num_experts=8, router=routers.TopK(k=2), dispatch='indices'))
VIT_MOE = dataclasses.replace(MODEL_VIT, moe=MoeConfig(num_experts=8, router=routers.TopK(k=2),
                                                       grouping=grouping.Fixed(10)))
LLAMA_MOE = LlamaConfig(vocab_size=64, d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
                        d_ff=32, num_layers=2,
                        moe=MoeConfig(num_experts=8, router=routers.TopK(k=2),
                                      dispatch='indices', train_capacity_factor=2.0),
                        moe_layers='every_other')


def t5_case():
  model = T5(T5_MOE)
  inputs = (tokens(0, (8, 8), 64), tokens(1, (8, 4), 64))
  return model, inputs, lambda logits: jnp.mean(logits ** 2)


def vit_case():
  model = ViT(VIT_MOE)
  inputs = (jax.random.normal(jax.random.PRNGKey(0), (8, 8, 8, 3)),)
  return model, inputs, lambda logits: jnp.mean(logits ** 2)


def llama_case():
  model = Llama(LLAMA_MOE)
  return model, (tokens(2, (8, 8), 64),), lambda logits: jnp.mean(logits ** 2)


def llama_dropless_case(groups=grouping.PerExample()):
  """The Mixtral block's dropless dispatch: rows sorted and multiplied per batch shard."""
  model = Llama(dataclasses.replace(LLAMA_MOE, moe=dataclasses.replace(
      LLAMA_MOE.moe, dispatch='ragged', normalize_combine_weights=True, grouping=groups)))
  return model, (tokens(2, (8, 8), 64),), lambda logits: jnp.mean(logits ** 2)


def llama_dropless_few_groups_case():
  """4 routing groups of 16 tokens over 8 batch shards: each group is cut in two."""
  return llama_dropless_case(grouping.Fixed(16))


@functools.lru_cache(maxsize=None)
def unsharded(case):
  model, inputs, objective = case()
  boxed = model.init(jax.random.PRNGKey(0), *inputs)['params']
  params = nn.meta.unbox(boxed)
  reference = jax.jit(loss_and_grads(model, inputs, objective))(params)
  return model, inputs, objective, boxed, params, reference


def loss_and_grads(model, inputs, objective):
  def loss(params):
    logits, state = model.apply({'params': params}, *inputs, mutable=MOE_COLLECTIONS)
    return objective(logits) + aux_losses(state)['total']
  return jax.value_and_grad(loss)


@pytest.mark.slow
@pytest.mark.parametrize('case, mesh_shape, rules', [
    (t5_case, (2, 2, 2), 'default'), (t5_case, (1, 8, 1), 'default'),
    (vit_case, (2, 2, 2), 'default'), (vit_case, (1, 8, 1), 'default'),
    (t5_case, (4, 2, 1), 'fsdp'), (vit_case, (2, 2, 2), 'fsdp'),
    (llama_case, (2, 2, 2), 'default'), (llama_case, (4, 2, 1), 'fsdp'),
    (llama_dropless_case, (2, 2, 2), 'fsdp'), (llama_dropless_few_groups_case, (4, 2, 1),
                                               'default')],
    ids=['t5-2x2x2', 't5-1x8x1', 'vit-2x2x2', 'vit-1x8x1', 't5-fsdp-4x2x1', 'vit-fsdp-2x2x2',
         'llama-2x2x2', 'llama-fsdp-4x2x1', 'llama-ragged-fsdp-2x2x2',
         'llama-ragged-few-groups-4x2x1'])
def test_sharded_equals_unsharded(case, mesh_shape, rules):
  assert jax.device_count() == 8, 'tests/conftest.py simulates 8 CPU devices'
  model, inputs, objective, boxed, params, (expected_loss, expected_grads) = unsharded(case)
  rules = partitioning.rules(rules, 'rules')

  mesh = partitioning.make_mesh(num_expert_partitions=mesh_shape[1],
                                num_model_partitions=mesh_shape[2])
  assert dict(mesh.shape) == dict(zip(partitioning.MESH_AXES, mesh_shape))
  with partitioning.activate(mesh, rules):
    shardings = partitioning.logical_sharding(boxed, mesh, rules)
    sharded_params = jax.device_put(params, shardings)
    sharded_inputs = [jax.device_put(x, partitioning.batch_sharding(mesh, x.ndim))
                      for x in inputs]
    fn = lambda p, *xs: loss_and_grads(model, xs, objective)(p)
    loss, grads = jax.jit(fn, out_shardings=(None, shardings))(sharded_params, *sharded_inputs)

  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads,
               expected_grads)
  block = (grads['encoder']['layers_1']['mlp'] if 'encoder' in grads
           else grads['decoder']['layers_1']['mlp'] if 'decoder' in grads
           else grads['Transformer']['encoderblock_1']['MlpBlock_0'])
  kernel = next(leaf for path, leaf in tree.flatten(block['expert']).items()
                if path in ('wi_0/kernel', 'Dense_0/kernel'))   # [experts, d_model, d_ff]
  assert kernel.sharding.spec[:2] == (
      ('expert', 'data') if rules == partitioning.FSDP_RULES else ('expert', None))


def test_rules_put_experts_on_the_expert_axis_and_mlp_on_model():
  boxed = jax.eval_shape(T5(T5_MOE).init, jax.random.PRNGKey(0), *t5_case()[1])['params']
  mesh = partitioning.make_mesh(2, 2)
  shardings = partitioning.logical_sharding(boxed, mesh)
  spec = lambda *path: functools.reduce(lambda tree, key: tree[key], path, shardings).spec
  assert spec('encoder', 'layers_1', 'mlp', 'expert', 'wi_0', 'kernel') == P(
      'expert', None, 'model')
  assert spec('encoder', 'layers_1', 'mlp', 'router', 'router_weights', 'w', 'kernel') == P(
      None, None)
  assert spec('encoder', 'layers_0', 'mlp', 'wo', 'kernel') == P('model', None)
  assert spec('token_embedder', 'embedding') == P('model', None)
  assert spec('decoder', 'layers_0', 'self_attention', 'query', 'kernel') == P(None, 'model')


def test_shared_expert_is_sharded_like_the_dense_mlp():
  moe = dataclasses.replace(T5_MOE.encoder_moe, shared_expert=True)
  boxed = jax.eval_shape(T5(dataclasses.replace(T5_MOE, encoder_moe=moe)).init,
                         jax.random.PRNGKey(0), *t5_case()[1])['params']
  axes = partitioning.logical_axes(boxed)
  assert axes['encoder/layers_1/mlp/shared_expert/wi_0/kernel'] == ('embed', 'mlp')
  assert axes['encoder/layers_1/mlp/shared_expert/wo/kernel'] == ('mlp', 'embed')
  shardings = tree.flatten(partitioning.logical_sharding(boxed, partitioning.make_mesh(2, 2)))
  assert shardings['encoder/layers_1/mlp/shared_expert/wi_1/kernel'].spec == P(None, 'model')
  assert shardings['encoder/layers_1/mlp/shared_expert/wo/kernel'].spec == P('model', None)


def test_mesh_must_divide_the_devices():
  with pytest.raises(ValueError, match='does not divide the 8 devices'):
    partitioning.make_mesh(num_expert_partitions=3)


def test_fsdp_splits_parameters_and_their_optimizer_state_over_the_data_parallel_devices():
  boxed = jax.eval_shape(T5(T5_MOE).init, jax.random.PRNGKey(0), *t5_case()[1])['params']
  mesh = partitioning.make_mesh(2, 2)   # data 2 x expert 2 x model 2
  fsdp = partitioning.rules('fsdp', 'rules')
  shardings = partitioning.logical_sharding(boxed, mesh, fsdp)
  flat = tree.flatten(shardings)
  # Every data-parallel device, data x expert, holds a slice; the experts' kernels, already
  # split over 'expert', are split over 'data' as well.
  assert flat['encoder/layers_1/mlp/expert/wi_0/kernel'].spec == P('expert', 'data', 'model')
  assert flat['encoder/layers_0/mlp/wo/kernel'].spec == P('model', ('data', 'expert'))
  assert flat['token_embedder/embedding'].spec == P('model', ('data', 'expert'))
  assert flat['encoder/layers_1/mlp/router/router_weights/w/kernel'].spec == P(
      ('data', 'expert'), None)
  # Activations keep the batch on ('expert', 'data'); their d_model stays whole.
  assert nn.logical_to_mesh_axes(('batch', 'length', 'embed'), fsdp) == P(('expert', 'data'),
                                                                          None, None)
  params = tree.unbox(boxed)
  opt_state = jax.eval_shape(optimizers.AdamW(schedule=1e-3).build().init, params)
  state = slots.state_shardings(opt_state, params, shardings)
  adam = [s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, 'mu'))
          if hasattr(s, 'mu')]
  mu = tree.flatten(adam[0].mu)   # optax's ScaleByAdamState
  assert mu['encoder/layers_1/mlp/expert/wi_0/kernel'].spec == P('expert', 'data', 'model')
  assert mu['encoder/layers_0/mlp/wo/kernel'].spec == P('model', ('data', 'expert'))


@pytest.mark.parametrize('value, message', [
    ('zero3', r"^TrainConfig.logical_axis_rules = 'zero3': expected one of \['default', "
              r"'fsdp'\] or a list"),
    ([('embed', 'dta')], r"^TrainConfig.logical_axis_rules: \('embed', 'dta'\) is not a "
                         r'\(logical axis, mesh axes\) pair; mesh axes are None, one of'),
])
def test_rules_that_are_neither_a_set_nor_pairs_are_named(value, message):
  with pytest.raises(fields.ConfigError, match=message):
    partitioning.rules(value, 'TrainConfig.logical_axis_rules')


def test_rules_from_gin_lists_are_a_table():
  assert partitioning.rules([['batch', ['expert', 'data']], ['embed', None]], 'b') == (
      ('batch', ('expert', 'data')), ('embed', None))
