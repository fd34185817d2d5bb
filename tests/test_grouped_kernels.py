"""Every grouped matmul is the per-row product `rows[r] @ kernel[group of r]` (numpy, row by
row), rows past the groups 0, and its gradients are that product's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle.grouped_kernels import GROUPED_KERNELS, block_rows

# Uneven groups, an empty one, rows past the groups; R = 45 rows, block_rows(45, 4) = 8.
SIZES = np.array([13, 0, 21, 6], np.int32)
ROWS = np.random.default_rng(0).normal(size=(45, 5)).astype(np.float32)
KERNEL = np.random.default_rng(1).normal(size=(4, 5, 3)).astype(np.float32)
COTANGENT = np.random.default_rng(2).normal(size=(45, 3)).astype(np.float32)


def reference():
  """(out, d rows, d kernel) of sum(out * COTANGENT), row by row in float64."""
  group = np.repeat(np.arange(4), SIZES)
  out = np.zeros((45, 3))
  d_rows, d_kernel = np.zeros((45, 5)), np.zeros((4, 5, 3))
  for r, g in enumerate(group):
    out[r] = ROWS[r].astype(np.float64) @ KERNEL[g]
    d_rows[r] = KERNEL[g] @ COTANGENT[r]
    d_kernel[g] += np.outer(ROWS[r], COTANGENT[r])
  return out, d_rows, d_kernel


@pytest.mark.parametrize('name', ['ragged_dot', 'blocked', 'megablox'])
def test_kernel_is_the_per_row_product_and_its_gradient(name):
  fn = GROUPED_KERNELS[name]
  out, vjp = jax.vjp(lambda r, k: fn(r, k, jnp.asarray(SIZES)), ROWS, KERNEL)
  d_rows, d_kernel = vjp(jnp.asarray(COTANGENT))
  for got, want in zip((out, d_rows, d_kernel), reference()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out[40:], 0.0)


def test_block_is_128_rows_or_fewer_for_small_groups():
  assert block_rows(4096, 8) == 128      # the drop suite's 2048 tokens x top 2 over 8 experts
  assert block_rows(45, 4) == 8
  assert block_rows(20, 8) == 8          # at least 8
