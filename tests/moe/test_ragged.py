"""The dropless 'ragged' dispatch equals the slot dispatch given a capacity of the whole group
(outputs, gradients, losses, metrics), keeps identical experts dense, and its sort has no
scatter-add in either direction."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import fields, layers
from upcycle.models import LlamaConfig
from upcycle.moe import balance as balances
from upcycle.moe import (MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses, capacity, grouping,
                         metrics, ragged, routers)
from tests.moe.helpers import primitive_names

E = 4
SWIGLU = functools.partial(layers.GatedMlp, d_ff=12, activation='silu')
VIT_MLP = functools.partial(layers.Mlp, mlp_dim=12)   # kernels and biases per expert
X = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8))
PADDING = jnp.arange(8)[None, :] < jnp.array([[8], [5]])   # the second sequence: 3 pads


def config(dispatch, **overrides):
  # Capacity factor E with vmoe's K * C * S / E: each expert has a slot for every token.
  return MoeConfig(**{**dict(num_experts=E, router=routers.TopK(k=2),
                             train_capacity_factor=float(E), eval_capacity_factor=float(E),
                             capacity_convention=capacity.Vmoe(multiple_of=1), dispatch=dispatch),
                      **overrides})


@functools.partial(jax.jit, static_argnums=(0, 1))
def loss_and_grads(layer_config, expert, params, x, mask):
  layer = MoeLayer(layer_config, expert, causal=True)

  def loss(params, x):
    out, state = layer.apply({'params': params}, x, True, mask, mutable=MOE_COLLECTIONS)
    weights = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
    return jnp.sum(out * weights) + aux_losses(state)['total'], (out, metrics(state))

  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


@pytest.mark.parametrize('expert, overrides, kernel', [
    (SWIGLU, dict(normalize_combine_weights=True), 'ragged_dot'),        # the Mixtral block
    (SWIGLU, dict(grouping=grouping.Fixed(4), balance=balances.Switch(scope='batch')),
     'ragged_dot'),
    (VIT_MLP, dict(normalize_combine_weights=True), 'ragged_dot'),
    (SWIGLU, dict(normalize_combine_weights=True), 'megablox'),   # blocked off TPU
    (VIT_MLP, dict(grouping=grouping.Fixed(4)), 'blocked'),
    pytest.param(SWIGLU, dict(normalize_combine_weights=True), 'megablox_interpret',
                 marks=pytest.mark.slow),
    pytest.param(VIT_MLP, dict(grouping=grouping.Fixed(4)), 'megablox_interpret',
                 marks=pytest.mark.slow)],
    ids=['mixtral', 'groups-unnormalized', 'biased-experts', 'mixtral-megablox-off-tpu',
         'biased-experts-blocked',
         'mixtral-megablox', 'biased-experts-megablox'])
def test_ragged_equals_indices_with_a_slot_for_every_token(expert, overrides, kernel):
  """'megablox_interpret': megablox's Pallas kernels interpreted (their TPU build is compiled
  by benchmarks/moe_layer.py --topology), with padding whose rows the kernel leaves
  unwritten."""
  indices = config('indices', **overrides)
  dropless = config('ragged', grouped_kernel=kernel, **overrides)
  params = nn.meta.unbox(MoeLayer(indices, expert, causal=True).init(
      jax.random.PRNGKey(1), X, True, PADDING))['params']
  # An opinionated router: uneven loads, and experts left empty in some groups.
  kernel = params['router']['router_weights']['w']['kernel']
  params['router']['router_weights']['w']['kernel'] = 3.0 * jax.random.normal(
      jax.random.PRNGKey(2), kernel.shape)
  (loss_i, (out_i, metrics_i)), grads_i = loss_and_grads(indices, expert, params, X, PADDING)
  (loss_r, (out_r, metrics_r)), grads_r = loss_and_grads(dropless, expert, params, X, PADDING)
  np.testing.assert_allclose(out_r, out_i, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out_r[1, 5:], 0.0)     # padding goes through no expert
  np.testing.assert_allclose(loss_r, loss_i, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               grads_r, grads_i)
  jax.tree.map(np.testing.assert_array_equal, metrics_r, metrics_i)


def test_identical_experts_normalized_give_the_dense_mlp():
  dense_params = nn.meta.unbox(SWIGLU().init(jax.random.PRNGKey(3), X, True))['params']
  dense_out = SWIGLU().apply({'params': dense_params}, X, True)
  layer = MoeLayer(config('ragged', normalize_combine_weights=True), SWIGLU)
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(4), X, True))['params']
  params['expert'] = jax.tree.map(lambda w: jnp.stack([w] * E), dense_params)
  out, _ = layer.apply({'params': params}, X, True, mutable=MOE_COLLECTIONS)
  np.testing.assert_allclose(out, dense_out, rtol=1e-5, atol=1e-6)


def test_sort_and_unsort_have_no_scatter_add_forward_or_backward():
  expert_index = jax.random.randint(jax.random.PRNGKey(5), (2, 8, 2), 0, E)
  routed = jnp.broadcast_to(PADDING[..., None], expert_index.shape)

  def through(x):   # sort, the identity as the experts, unsort with weight 1
    rows, _, order, inverse = ragged.sort_by_expert(x, expert_index, routed, E)
    return jnp.sum(ragged.unsort_and_combine(rows, inverse, order, routed * 1.0, routed) ** 2)

  # Each real token comes back k = 2 times: out = 2x, loss = 4x^2, gradient 8x (pads: 0).
  np.testing.assert_allclose(jax.grad(through)(X), 8 * X * PADDING[..., None], rtol=1e-6)
  primitives = primitive_names(jax.grad(through), X)
  assert not {name for name in primitives if 'scatter' in name}, primitives


def test_ragged_is_top_k_only_and_grouped_kernels_are_named():
  with pytest.raises(fields.ConfigError, match=r"dispatch = 'ragged' is dropless Top-K.*"
                                               r"router = @routers\.TopK\(\)"):
    MoeConfig(num_experts=E, router=routers.ExpertsChoose(), dispatch='ragged')
  with pytest.raises(fields.ConfigError, match=r"grouped_kernel.*'gmm'.*'megablox'"):
    MoeConfig(num_experts=E, router=routers.TopK(), dispatch='ragged', grouped_kernel='gmm')


def test_capacity_is_the_whole_group_and_flops_count_k_rows_per_token():
  dropless = config('ragged', train_capacity_factor=1.0)
  assert dropless.capacity(64, deterministic=False) == 64
  dense = LlamaConfig(vocab_size=32, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4,
                      d_ff=12, num_layers=2)
  count = lambda moe: dataclasses.replace(dense, moe=moe).forward_flops(batch=2, length=8)
  # Per layer: each of the 16 tokens through k = 2 experts instead of one MLP
  # (2 * 3 * d FLOPs per unit), and the router (2 * d * E per token).
  mlp, router = 16 * 12 * 2 * 3 * 8, 2 * 16 * 8 * E
  assert count(dropless) - count(None) == 2 * (mlp + router)
  # The slot dispatch computes every slot: capacity ceil(2 * 1.0 * 8 / 4) = 4 per expert
  # and sequence, 2 sequences x 4 experts x 4 slots = 32 rows, as many as k = 2 here.
  slots = dataclasses.replace(dropless, dispatch='indices', train_capacity_factor=2.0)
  assert count(slots) - count(None) == 2 * (3 * mlp + router)   # 64 slots: 4x the tokens
