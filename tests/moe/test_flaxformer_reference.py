"""Routers, the load-balancing loss and the layer against Flaxformer's, on arrays Flaxformer
computed (tests/fixtures/flaxformer/routing.npz, written by make_routing.py beside it)."""

import functools
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.moe.helpers import flaxformer_arrays
from upcycle import layers
from upcycle.moe import (MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses, capacity, grouping,
                         routers, routing)

FIXTURE = flaxformer_arrays()
CAPACITY = FIXTURE['top2_bpr/combine'].shape[-1]
# name -> (router, k, batch priority, padded), as make_routing.py made them
CASES = json.loads(str(FIXTURE['cases']))


def dispatch_and_combine(probs, mask, router, k, bpr):
  """Our router's decision in Flaxformer's form: dispatch and combine `[G, S, E, C]`."""
  ours = (routers.ExpertsChoose() if router == 'experts_choose' else
          routers.TopK(k=k, batch_priority=bpr))
  decision = ours.route(probs, capacity=CAPACITY, token_mask=mask,
                        balance=MoeConfig().balance).decision
  tokens = probs.shape[1]
  holds = decision.valid[..., None] & (decision.token_index[..., None] == jnp.arange(tokens))
  dispatch = jnp.transpose(holds, (0, 3, 1, 2))                       # [G, S, E, C]
  return dispatch, dispatch * decision.combine_weight[:, None]


@pytest.mark.parametrize('case', list(CASES))
def test_decisions_and_their_gradients_are_flaxformers(case):
  router, k, bpr, padded = CASES[case]
  probs = jnp.asarray(FIXTURE['probs'])
  mask = jnp.asarray(FIXTURE['mask'] > 0) if padded else None
  dispatch, combine = dispatch_and_combine(probs, mask, router, k, bpr)
  theirs = FIXTURE[f'{case}/dispatch']
  if router == 'experts_choose' and padded:
    # Flaxformer's experts may pick padding (its probability zeroed, so its weight is 0);
    # ours mark those slots empty: the same layer output.
    assert np.all(FIXTURE[f'{case}/combine'][~FIXTURE['mask'].astype(bool)] == 0)
    theirs = theirs & FIXTURE['mask'].astype(bool)[:, :, None, None]
  np.testing.assert_array_equal(dispatch, theirs)
  np.testing.assert_allclose(combine, FIXTURE[f'{case}/combine'], rtol=0, atol=1e-7)
  cotangent = jnp.asarray(FIXTURE['cotangent'])
  dprobs = jax.grad(
      lambda p: jnp.sum(dispatch_and_combine(p, mask, router, k, bpr)[1] * cotangent))(probs)
  np.testing.assert_allclose(dprobs, FIXTURE[f'{case}/dprobs'], rtol=0, atol=1e-6)


# Unpadded: with padding, Flaxformer's means count the padding tokens (their probabilities
# zeroed), ours leave them out (`routing.load_balancing_statistics`).
@pytest.mark.parametrize('case', [c for c, (router, _, _, padded) in CASES.items()
                                  if router == 'tokens_choose' and not padded])
def test_default_load_balancing_loss_is_flaxformers(case):
  """The default balance (`Switch()`, scope 'group') is Flaxformer's `_load_balancing_loss`
  on the same choices."""
  _, k, _, _ = CASES[case]
  probs = jnp.asarray(FIXTURE['probs'])
  routed = routers.TopK(k=k).route(probs, capacity=CAPACITY, token_mask=None,
                                   balance=MoeConfig().balance)
  loss = routing.load_balancing_loss(*routed.balance)
  np.testing.assert_allclose(loss, FIXTURE[f'{case}/load_balancing_loss'], rtol=1e-6)


@pytest.mark.parametrize('dispatch', ['masked', 'indices'])
def test_layer_outputs_and_gradients_are_flaxformers(dispatch):
  """Top-2 with Batch Priority Routing, capacity by T5X's convention: the output, the
  gradients of sum(y^2) for the input and for the router (through the combine weights), and
  the auxiliary losses the layer sows."""
  config = MoeConfig(num_experts=4, router=routers.TopK(k=2, batch_priority=True),
                     train_capacity_factor=1.0, eval_capacity_factor=1.0,
                     capacity_convention=capacity.T5X(minimum=1),
                     grouping=grouping.Flaxformer(max_group_size=8),
                     dispatch=dispatch)
  layer = MoeLayer(config, functools.partial(layers.GatedMlp, d_ff=16, dtype=jnp.float32))
  params = flax.traverse_util.unflatten_dict(
      {tuple(k.split('/')[2:]): jnp.asarray(v) for k, v in FIXTURE.items()
       if k.startswith('layer/params/')})
  x = jnp.asarray(FIXTURE['layer/x'])

  def loss(p, x):
    y, state = layer.apply({'params': p}, x, True, mutable=MOE_COLLECTIONS)
    return jnp.sum(y ** 2), (y, aux_losses(state))

  (_, (y, losses)), (dparams, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      params, x)
  np.testing.assert_allclose(y, FIXTURE['layer/y'], rtol=0, atol=1e-5)
  np.testing.assert_allclose(losses['load_balancing_loss'], FIXTURE['layer/load_balancing_loss'],
                             rtol=1e-6)
  np.testing.assert_allclose(losses['router_z_loss'], FIXTURE['layer/router_z_loss'], rtol=1e-6)
  np.testing.assert_allclose(dx, FIXTURE['layer/dx'], rtol=0, atol=1e-4)
  np.testing.assert_allclose(dparams['router']['router_weights']['w']['kernel'],
                             FIXTURE['layer/drouter'], rtol=0, atol=1e-4)
