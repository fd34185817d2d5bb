"""The base layers' products against numpy's."""

import flax.linen as nn
import jax
import numpy as np

from upcycle import layers


def _unboxed(variables):
  return nn.meta.unbox(variables)['params']


def test_a_flat_kernel_is_stored_as_the_matrix_and_multiplies_as_heads():
  """`flat_kernel`: the kernel and bias keep T5X's / HF's 2-D layout `[d_model, heads *
  head_dim]` while the product has the heads as axes (and back, for the output projection)."""
  x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32)
  project = layers.DenseGeneral((4, 5), ('embed', 'joined_kv'), use_bias=True,
                                flat_kernel=True, bias_init=nn.initializers.normal(1.0))
  params = _unboxed(project.init(jax.random.PRNGKey(0), x))
  assert (params['kernel'].shape, params['bias'].shape) == ((8, 20), (20,))
  heads = np.asarray(project.apply({'params': params}, x))
  kernel, bias = np.asarray(params['kernel']), np.asarray(params['bias'])
  np.testing.assert_allclose(heads, (x @ kernel + bias).reshape(2, 3, 4, 5), rtol=1e-5,
                             atol=1e-6)

  out = layers.DenseGeneral(6, ('joined_kv', 'embed'), in_features=(4, 5), use_bias=True,
                            flat_kernel=True, bias_init=nn.initializers.normal(1.0))
  params = _unboxed(out.init(jax.random.PRNGKey(1), heads))
  assert (params['kernel'].shape, params['bias'].shape) == ((20, 6), (6,))
  kernel, bias = np.asarray(params['kernel']), np.asarray(params['bias'])
  np.testing.assert_allclose(np.asarray(out.apply({'params': params}, heads)),
                             heads.reshape(2, 3, 20) @ kernel + bias, rtol=1e-5, atol=1e-6)
