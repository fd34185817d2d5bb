"""optimizer_state/adafactor.py: layouts, the second-moment estimate and its carry through a
leaf op, against numpy (the estimate is v_row / mean(v_row, over the row axes) x v_col)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from upcycle import leaf_ops
from upcycle.optimizer_state import adafactor

RNG = np.random.default_rng(0)


def _positive(*shape):
  return RNG.uniform(0.5, 2.0, shape).astype(np.float32)


def _numpy_estimate(v_row, v_col, rows, cols):
  """v_row lacks the `cols` axes, v_col the `rows` axes; one row and one column axis."""
  (r,), (c,) = rows, cols
  reduced_r = r - (c < r)
  row = v_row / v_row.mean(axis=reduced_r, keepdims=True)
  return np.expand_dims(row, c) * np.expand_dims(v_col, r)


def test_factored_dims_are_optax_second_largest_and_largest_axes():
  assert adafactor.factored_dims((8, 16)) == (0, 1)
  assert adafactor.factored_dims((16, 8)) == (1, 0)
  assert adafactor.factored_dims((32, 8, 16)) == (2, 0)
  assert adafactor.factored_dims((4, 8, 16)) == (1, 2)
  # optax lays out its FactoredState the same way: v_row without d0, v_col without d1.
  state = optax.adafactor(0.1, min_dim_size_to_factor=4).init({'w': jnp.zeros((32, 8, 16))})
  assert state[0].v_row['w'].shape == (8, 16) and state[0].v_col['w'].shape == (32, 8)


def test_heuristic_reads_full_and_factored_slots_and_names_a_misfit():
  full = adafactor.heuristic(adafactor.UNUSED, adafactor.UNUSED, _positive(8), adafactor.UNUSED,
                             (8,))
  assert (full.rows, full.cols) == ((), ())
  factored = adafactor.heuristic(_positive(8), _positive(16), adafactor.UNUSED,
                                 adafactor.UNUSED, (8, 16))
  assert (factored.rows, factored.cols) == ((0,), (1,))
  with pytest.raises(ValueError, match=r'^Adafactor slots of dense/wo \(8, 16\): v_row \(16,\), '
                     r'v_col \(8,\), v \(1,\) fit neither a full second moment nor the heuristic '
                     r'factored layout .*\.$'):
    adafactor.heuristic(_positive(16), _positive(8), adafactor.UNUSED, adafactor.UNUSED,
                        (8, 16), 'dense/wo')


@pytest.mark.parametrize('shape,rows,cols', [((8, 16), (0,), (1,)), ((16, 8), (1,), (0,)),
                                             ((3, 8, 16), (1,), (2,)), ((32, 8, 16), (2,), (0,))])
def test_estimate_and_refactor_against_numpy(shape, rows, cols):
  v_row = _positive(*np.delete(shape, cols))
  v_col = _positive(*np.delete(shape, rows))
  slots = adafactor.ParamSlots(v_row, v_col, adafactor.UNUSED, adafactor.UNUSED, rows, cols)
  want = _numpy_estimate(v_row, v_col, rows, cols)
  assert want.shape == shape
  np.testing.assert_allclose(adafactor.estimate(slots), want, rtol=1e-6)
  # A full estimate refactored: v_row / v_col are its means over the columns / rows.
  full = _positive(*shape)
  back = adafactor.refactor(jnp.asarray(full), slots)
  np.testing.assert_allclose(back.v_row, full.mean(axis=cols), rtol=1e-6)
  np.testing.assert_allclose(back.v_col, full.mean(axis=rows), rtol=1e-6)
  # A rank-one estimate (one factored by these axes) survives refactoring exactly.
  np.testing.assert_allclose(adafactor.estimate(adafactor.refactor(jnp.asarray(want), slots)),
                             want, rtol=1e-5)


def test_init_slots_shapes_and_unfactored_estimate():
  slots = adafactor.init_slots((3, 8, 16), (1,), (2,), jnp.bfloat16)
  assert slots.v_row.shape == (3, 8) and slots.v_col.shape == (3, 16)
  assert slots.m.shape == (3, 8, 16) and slots.m.dtype == jnp.bfloat16
  assert adafactor.unused(slots.v) and not np.asarray(slots.v_row).any()
  full = adafactor.init_slots((8,), (), (), None)
  assert full.v.shape == (8,) and adafactor.unused(full.m) and adafactor.unused(full.v_row)
  v = _positive(8)
  np.testing.assert_array_equal(adafactor.estimate(full.replace(v=v)), v)


def test_carry_tiles_the_factors_where_the_layout_only_shifts():
  """Dense [8, 16] (rows 0, cols 1) -> experts [2, 8, 16] (rows 1, cols 2): each factor
  tiled, the momentum tiled like the parameter."""
  v_row, v_col, m = _positive(8), _positive(16), _positive(8, 16)
  source = adafactor.ParamSlots(v_row, v_col, adafactor.UNUSED, m, (0,), (1,))
  fresh = adafactor.init_slots((2, 8, 16), (1,), (2,), jnp.float32)
  got = adafactor.carry(source, fresh, leaf_ops.Tile(2), ndim=2)
  assert (got.rows, got.cols) == ((1,), (2,))
  np.testing.assert_array_equal(got.v_row, np.stack([v_row, v_row]))
  np.testing.assert_array_equal(got.v_col, np.stack([v_col, v_col]))
  np.testing.assert_array_equal(got.m, np.stack([m, m]))
  # A fresh state without momentum keeps its placeholder.
  no_m = adafactor.carry(source, adafactor.init_slots((2, 8, 16), (1,), (2,), None),
                         leaf_ops.Tile(2), ndim=2)
  assert adafactor.unused(no_m.m)


def test_carry_through_the_estimate_where_the_op_reads_a_factored_axis():
  """Two of 8 rows taken from [2, 8, 16] (rows 1, cols 2): the op reads a row axis, so the
  numpy estimate is taken and refactored into the [2, 2, 16] layout (rows 1, cols 2)."""
  v_row, v_col = _positive(2, 8), _positive(2, 16)
  source = adafactor.ParamSlots(v_row, v_col, adafactor.UNUSED, adafactor.UNUSED, (1,), (2,))
  fresh = adafactor.init_slots((2, 2, 16), (1,), (2,), None)
  got = adafactor.carry(source, fresh, leaf_ops.Take(axis=1, index=(5, 2)), ndim=3)
  taken = _numpy_estimate(v_row, v_col, (1,), (2,))[:, [5, 2]]           # [2, 2, 16]
  np.testing.assert_allclose(got.v_row, taken.mean(2), rtol=1e-6)
  np.testing.assert_allclose(got.v_col, taken.mean(1), rtol=1e-6)


def test_carry_of_a_full_moment_applies_the_op_to_v_and_names_a_momentum_misfit():
  v, m = _positive(4, 3), _positive(4, 3)
  source = adafactor.ParamSlots(adafactor.UNUSED, adafactor.UNUSED, v, m)
  fresh = adafactor.init_slots((4, 2), (), (), jnp.float32)
  got = adafactor.carry(source, fresh, leaf_ops.Take(axis=1, index=(2, 0)), ndim=2)
  np.testing.assert_array_equal(got.v, v[:, [2, 0]])
  np.testing.assert_array_equal(got.m, m[:, [2, 0]])
  with pytest.raises(ValueError, match=r'^Adafactor slots of enc/w: the source momentum m '
                     r'\(4, 3\) cannot fill \(4, 3, 5\)\.$'):
    adafactor.carry(source, adafactor.init_slots((4, 3, 5), (), (), jnp.float32),
                    leaf_ops.COPY, ndim=2, where='enc/w')
