"""upcycle/leaf_ops.py: each op on a leaf and on a factor of it, against numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import leaf_ops

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


@pytest.mark.parametrize('wrap', [np.asarray, jnp.asarray], ids=['numpy', 'jax'])
def test_ops_on_a_leaf_equal_numpy_and_keep_numpy_leaves_on_the_host(wrap):
  x = wrap(X)
  tiled = leaf_ops.Tile(3).apply(x)
  np.testing.assert_array_equal(tiled, np.stack([X, X, X]))
  taken = leaf_ops.Take(axis=2, index=(3, 0, 3)).apply(x)
  np.testing.assert_array_equal(taken, X[:, :, [3, 0, 3]])
  assert leaf_ops.COPY.apply(x) is x
  # numpy in, numpy out (lazily read checkpoint leaves stay on the host); jax in, jax out.
  for out in (tiled, taken):
    assert isinstance(out, np.ndarray) == (wrap is np.asarray)


def test_shapes_are_those_of_the_applied_op():
  for op in (leaf_ops.COPY, leaf_ops.Tile(5), leaf_ops.Take(axis=0, index=(1,)),
             leaf_ops.Take(axis=1, index=(2, 0, 1, 1))):
    assert op.shape(X.shape) == op.apply(X).shape, op
  assert leaf_ops.Tile(5).shape((2, 3)) == (5, 2, 3)
  assert leaf_ops.Take(axis=1, index=(0, 0, 0, 0, 0)).shape((2, 3)) == (2, 5)


def test_moves_says_where_each_axis_lands():
  assert [leaf_ops.COPY.moves(a) for a in range(3)] == [0, 1, 2]
  assert [leaf_ops.Tile(4).moves(a) for a in range(3)] == [1, 2, 3]   # a new axis 0
  assert [leaf_ops.Take(axis=1, index=(0,)).moves(a) for a in range(3)] == [0, None, 2]


@pytest.mark.parametrize('kept', [(0, 2), (1, 2), (0, 1)])
def test_op_on_a_factor_is_that_factor_of_the_op_on_the_leaf(kept):
  """A factor keeping axes `kept` of X (its mean over the other axis): the op on the factor is
  the same mean of the op's result, for each op that reads no axis the factor lacks."""
  (reduced,) = tuple(a for a in range(3) if a not in kept)
  factor = X.mean(axis=reduced)
  # (op, the op's result in numpy, where the reduced axis is in it)
  cases = [(leaf_ops.COPY, X, reduced), (leaf_ops.Tile(2), np.stack([X, X]), reduced + 1)]
  cases += [(leaf_ops.Take(axis=a, index=(1, 0, 1)), np.take(X, [1, 0, 1], axis=a), reduced)
            for a in kept]
  for op, result, axis in cases:
    assert op.moves(reduced) == axis
    want = result.mean(axis=axis)
    np.testing.assert_allclose(op.on_factor(factor, kept), want, rtol=1e-6, err_msg=str(op))
    np.testing.assert_allclose(op.on_factor(jnp.asarray(factor), kept), want, rtol=1e-6)


def test_notes_name_what_the_op_did():
  assert leaf_ops.COPY.note() == ''
  assert leaf_ops.Tile(8).note() == 'tiled x8'
  assert leaf_ops.Take(axis=0, index=(2, 2)).note() == 'axis 0 <- [2, 2]'
  assert leaf_ops.FRESH.note() == 'fresh'
  assert leaf_ops.COPY == leaf_ops.Copy() and leaf_ops.FRESH == leaf_ops.Fresh()
