"""T5X Adafactor state: tiled across experts, read from T5X-written slots, fresh at the dense
step."""

import jax.numpy as jnp
import numpy as np
import pytest

from upcycle.optimizer_state import from_t5x_adafactor
from upcycle.optimizer_state import counts
from upcycle.optimizer_state.carry import carry_optimizer_state
from upcycle.train import optimizers
from upcycle.upcycling.surgery import make_plan

E = 3
DENSE_AXES = {'mlp/wi/kernel': ('embed', 'mlp'), 'mlp/wo/kernel': ('mlp', 'embed'),
              'norm/scale': ('embed',)}
MOE_AXES = {'mlp/expert/wi/kernel': ('expert', 'embed', 'mlp'),
            'mlp/expert/wo/kernel': ('expert', 'mlp', 'embed'),
            'mlp/router/w/kernel': ('embed', 'unmodeled'), 'norm/scale': ('embed',)}


def _params(shapes, seed):
  rng = np.random.default_rng(seed)
  return {'mlp': {k: {'kernel': jnp.asarray(rng.normal(size=s), jnp.float32)}
                  for k, s in shapes.items()}, 'norm': {'scale': jnp.ones((4,))}}


def _trained_dense(min_dim_size_to_factor):
  """A dense T5XAdafactor state after 3 steps of random gradients, and its optimizer."""
  opt = optimizers.T5XAdafactor(min_dim_size_to_factor=min_dim_size_to_factor,
                                beta1=0.9).build(DENSE_AXES)
  params = _params({'wi': (4, 6), 'wo': (6, 4)}, 0)
  state = opt.init(params)
  for seed in range(3):
    grads = _params({'wi': (4, 6), 'wo': (6, 4)}, seed + 1)
    _, state = opt.update(grads, state, params)
  return state


def upcycle_optimizer_state(dense_state, moe, optimizer):
  """The dense state carried through the upcycling plan from the dense params to `moe`."""
  dense = _params({'wi': (4, 6), 'wo': (6, 4)}, 0)
  return carry_optimizer_state(dense_state, make_plan(dense, moe), moe, optimizer)


def _moe_params():
  p = _params({}, 0)
  p['mlp'] = {'expert': {'wi': {'kernel': jnp.zeros((E, 4, 6))},
                         'wo': {'kernel': jnp.zeros((E, 6, 4))}},
              'router': {'w': {'kernel': jnp.zeros((4, E))}}}
  return p


@pytest.mark.slow
def test_expert_slots_are_the_dense_slots_tiled():
  """Dense [4, 6] factored by the heuristic (rows = axis 0); experts (BATCH, ROW, COLUMN)."""
  dense = _trained_dense(min_dim_size_to_factor=4)
  moe_opt = optimizers.T5XAdafactor(min_dim_size_to_factor=4, beta1=0.9).build(MOE_AXES)
  state = upcycle_optimizer_state(dense, _moe_params(), moe_opt)
  assert int(state.count) == 3
  wi, dense_wi = state.param_states['mlp']['expert']['wi']['kernel'], dense.param_states['mlp'][
      'wi']['kernel']
  assert (dense_wi.rows, dense_wi.cols, wi.rows, wi.cols) == ((0,), (1,), (1,), (2,))
  for e in range(E):
    np.testing.assert_array_equal(wi.v_row[e], dense_wi.v_row)
    np.testing.assert_array_equal(wi.v_col[e], dense_wi.v_col)
    np.testing.assert_array_equal(wi.m[e], dense_wi.m)
  router = state.param_states['mlp']['router']['w']['kernel']
  assert not np.asarray(router.v).any()  # fresh
  np.testing.assert_array_equal(state.param_states['norm']['scale'].v,
                                dense.param_states['norm']['scale'].v)


def test_unfactored_dense_moment_is_averaged_into_expert_factors():
  """Dense [6, 4] below min_dim_size_to_factor keeps v in full; its experts are factored."""
  dense = _trained_dense(min_dim_size_to_factor=128)
  moe_opt = optimizers.T5XAdafactor(beta1=0.9).build(MOE_AXES)
  state = upcycle_optimizer_state(dense, _moe_params(), moe_opt)
  v = np.asarray(dense.param_states['mlp']['wo']['kernel'].v)   # [d_ff, d_model]
  wo = state.param_states['mlp']['expert']['wo']['kernel']      # (BATCH, COLUMN, ROW)
  for e in range(E):
    np.testing.assert_allclose(wo.v_row[e], v.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(wo.v_col[e], v.mean(axis=1), rtol=1e-6)


def test_t5x_written_slots_read_as_they_are_and_fresh_state_keeps_the_step():
  dense = _trained_dense(min_dim_size_to_factor=4)
  opt = optimizers.T5XAdafactor(min_dim_size_to_factor=4, beta1=0.9).build(DENSE_AXES)
  stored = {'step': np.asarray(1000, np.int32), 'param_states': {
      'mlp': {k: {'kernel': {s: np.asarray(getattr(dense.param_states['mlp'][k]['kernel'], s))
                             for s in ('v_row', 'v_col', 'v', 'm')}} for k in ('wi', 'wo')},
      'norm': {'scale': {'v': np.asarray(dense.param_states['norm']['scale'].v)}}}}
  params = _params({'wi': (4, 6), 'wo': (6, 4)}, 0)
  state = from_t5x_adafactor(stored, params, opt)
  assert int(state.count) == 1000
  for k in ('wi', 'wo'):
    got, want = state.param_states['mlp'][k]['kernel'], dense.param_states['mlp'][k]['kernel']
    for s in ('v_row', 'v_col', 'v', 'm'):
      np.testing.assert_array_equal(getattr(got, s), getattr(want, s), err_msg=f'{k} {s}')
  fresh = counts.fresh(opt.init(params), 1000)
  assert int(fresh.count) == 1000  # T5X's one count: learning rate and decay.
  assert int(counts.reused(state, 'reset', 0).count) == 0
