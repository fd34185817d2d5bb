"""Router initializers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle.fields import ConfigError
from upcycle.upcycling import router_init

KEY = jax.random.PRNGKey(0)
ROUTER = {'router_weights/w/kernel': jax.ShapeDtypeStruct((64, 32), jnp.float32),
          'router_weights/w/bias': jax.ShapeDtypeStruct((32,), jnp.float32)}


@pytest.mark.parametrize('init,std', [(router_init.Normal(), 0.02), (router_init.Normal(0.1), 0.1),
                                      (router_init.Uniform(0.05), 0.05)])
def test_distributions_have_zero_mean_and_the_given_std(init, std):
  out = init(ROUTER, KEY, layer='l')
  kernel = np.asarray(out['router_weights/w/kernel'])
  assert kernel.shape == (64, 32) and kernel.dtype == np.float32
  assert abs(kernel.mean()) < 4 * std / np.sqrt(kernel.size)
  assert abs(kernel.std() / std - 1) < 0.05
  assert not np.asarray(out['router_weights/w/bias']).any()
  if isinstance(init, router_init.Uniform):
    assert np.abs(kernel).max() <= std * np.sqrt(3)


def test_normal_takes_the_std_names_of_the_moe_router_init():
  """'width_scaled': 0.02 * sqrt(768 / d_model) for the kernel [64, 32] (0.0693), within 5
  standard errors of a sample std of n normal draws."""
  kernel = np.asarray(router_init.Normal('width_scaled')(ROUTER, KEY)['router_weights/w/kernel'])
  assert abs(kernel.std() / (0.02 * np.sqrt(768 / 64)) - 1) < 5 / np.sqrt(2 * (kernel.size - 1))
  with pytest.raises(ConfigError, match=r'^router_init\.Normal\.std = -0\.02: expected a '
                     r'number > 0'):
    router_init.Normal(-0.02)
  with pytest.raises(ConfigError, match=r"^router_init\.Normal\.std = 'wide': expected one of "
                     r"\('constant', 'width_scaled'\)"):
    router_init.Normal('wide')


def test_zeros():
  out = router_init.get('zeros')(ROUTER, KEY)
  assert not np.asarray(out['router_weights/w/kernel']).any()


def test_from_data_columns_are_normalized_means():
  rng = np.random.default_rng(0)
  hidden = [rng.normal(e, 1.0, (3, 5, 4)).astype(np.float32) for e in range(3)]
  init = router_init.FromData({'enc/mlp': hidden}, scale=2.0)
  router = {'w/kernel': jax.ShapeDtypeStruct((4, 3), jnp.float32)}
  kernel = np.asarray(init(router, KEY, layer='enc/mlp')['w/kernel'])
  for e in range(3):
    mean = hidden[e].reshape(-1, 4).mean(0)
    np.testing.assert_allclose(kernel[:, e], 2.0 * mean / np.linalg.norm(mean), rtol=1e-5)
  # Each expert's data has its highest mean logit at that expert.
  for e in range(3):
    assert np.argmax(hidden[e].reshape(-1, 4).mean(0) @ kernel) == e


def test_from_data_errors_name_the_layer():
  router = {'w/kernel': jax.ShapeDtypeStruct((4, 3), jnp.float32)}
  with pytest.raises(ValueError, match=r"no hidden states for the MoE block at dec/mlp; "
                     r"have \['enc/mlp'\]"):
    router_init.FromData({'enc/mlp': [np.ones((2, 4))] * 3})(router, KEY, layer='dec/mlp')
  with pytest.raises(ValueError, match=r'2 batches of hidden states for enc/mlp but its router '
                     r'kernel \(4, 3\) has 3 experts'):
    router_init.FromData({'enc/mlp': [np.ones((2, 4))] * 2})(router, KEY, layer='enc/mlp')


@pytest.mark.parametrize('name', sorted(router_init.ROUTER_INITS))
def test_every_router_name_convert_accepts_is_one_get_accepts(name):
  from upcycle import convert  # pylint: disable=g-import-not-at-top
  parsed = convert.parse_init(name, router_init.ROUTER_INITS, '--router')
  assert parsed == router_init.get(name) == router_init.ROUTER_INITS[name]()
