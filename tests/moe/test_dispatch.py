"""The dispatch registry (`moe.config.DISPATCHES`): every dispatch it names is a `Dispatch`
built from the config, and given a slot for every token computes what numpy computes from the
parameters: each token's top-2 experts' SwiGLU outputs, weighted by their probabilities."""

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from upcycle import fields, layers
from upcycle.moe import MoeConfig, MoeLayer, capacity, routers
from upcycle.moe.config import DISPATCHES
from upcycle.moe.dispatch import Dispatch
from upcycle.moe.dropless import Dropless
from upcycle.moe.slots import Slots

E, K, D, D_FF = 4, 2, 4, 6
EXPERT = functools.partial(layers.GatedMlp, d_ff=D_FF, activation='silu')
X = jax.random.normal(jax.random.PRNGKey(0), (2, 4, D))


def numpy_top_k_moe(params, x):
  """x `[B, L, D]` -> `[B, L, D]`: sum over each token's top K experts of p_e * SwiGLU_e(x)."""
  logits = x @ params['router']['router_weights']['w']['kernel']
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  w = params['expert']
  out = np.zeros_like(x)
  for index in np.ndindex(x.shape[:2]):
    for e in np.argsort(-probs[index])[:K]:
      gate = x[index] @ w['wi_0']['kernel'][e]
      hidden = gate / (1 + np.exp(-gate)) * (x[index] @ w['wi_1']['kernel'][e])
      out[index] += probs[index][e] * (hidden @ w['wo']['kernel'][e])
  return out


@pytest.mark.parametrize('name', sorted(DISPATCHES))
def test_every_registered_dispatch_computes_top_k_experts_given_room_for_every_token(name):
  # Capacity factor E with vmoe's K * C * S / E: each expert has a slot for every token.
  config = MoeConfig(num_experts=E, router=routers.TopK(k=K), dispatch=name,
                     train_capacity_factor=float(E), eval_capacity_factor=float(E),
                     capacity_convention=capacity.Vmoe(multiple_of=1))
  assert isinstance(config.dispatcher, Dispatch)
  layer = MoeLayer(config, EXPERT)
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), X, True))['params']
  out = layer.apply({'params': params}, X, True, mutable=['aux_loss', 'moe_metrics'])[0]
  np.testing.assert_allclose(out, numpy_top_k_moe(jax.tree.map(np.asarray, params), np.asarray(X)),
                             rtol=1e-5, atol=1e-6)


def test_an_unregistered_dispatch_is_refused_with_the_registered_names():
  with pytest.raises(fields.ConfigError,
                     match=r"moe.MoeConfig.dispatch = 'scatter': expected one of "
                           r".*'masked', 'indices', 'ragged'"):
    MoeConfig(dispatch='scatter')


def test_dispatch_objects_name_their_bad_field_and_the_choices():
  with pytest.raises(fields.ConfigError, match=r"slots.Slots.by = 'gather': expected one of "
                                               r".*'masked', 'indices'"):
    Slots('gather')
  with pytest.raises(fields.ConfigError, match=r"dropless.Dropless.kernel = 'gmm': expected one "
                                               r"of .*'ragged_dot', 'blocked', 'megablox'"):
    Dropless('gmm')
