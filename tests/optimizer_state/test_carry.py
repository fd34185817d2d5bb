"""optimizer_state/units.py and carry.py: an optax state as per-parameter units, and a state
carried through leaf ops, checked slot by slot against numpy on a two-parameter tree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from upcycle import leaf_ops, tree
from upcycle.optimizer_state import adafactor, carry, units

DENSE = {'mlp/wi/kernel': (8, 16), 'norm/scale': (8,)}
MOE = {'mlp/expert/wi/kernel': (2, 8, 16), 'mlp/router/kernel': (8, 2), 'norm/scale': (8,)}
OPS = {'mlp/expert/wi/kernel': ('mlp/wi/kernel', leaf_ops.Tile(2)),
       'mlp/router/kernel': ('mlp/wi/kernel', leaf_ops.FRESH),
       'norm/scale': ('norm/scale', leaf_ops.COPY)}
FIX = 'use the same optimizer.'
ADAM = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
ADAFACTOR = optax.adafactor(1e-2, min_dim_size_to_factor=4, momentum=0.9)


def _params(shapes):
  return tree.unflatten({p: jnp.ones(s) for p, s in shapes.items()})


def _trained(optimizer, steps=2):
  """The dense tree's state after `steps` updates with random gradients."""
  params, state = _params(DENSE), optimizer.init(_params(DENSE))
  for step in range(steps):
    grads = tree.unflatten({p: jax.random.normal(jax.random.PRNGKey(step + 10 * i), s)
                            for i, (p, s) in enumerate(DENSE.items())})
    _, state = optimizer.update(grads, state, params)
  return state


def _carry(state, optimizer, ops=OPS, **kwargs):
  return carry.carry_state(units.flatten(state, DENSE), optimizer.init(_params(MOE)), ops=ops,
                           source_shapes=DENSE, shapes=MOE, source_name='the dense', fix=FIX,
                           **kwargs)


def test_units_are_per_parameter_slots_and_unflatten_inverts_flatten():
  for optimizer in (ADAM, ADAFACTOR):
    state = _trained(optimizer)
    flat = units.flatten(state, DENSE)
    assert {path for _, path in flat} == {None} | set(DENSE)
    back = units.unflatten(state, flat)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
      np.testing.assert_array_equal(got, want)
  flat = units.flatten(_trained(ADAFACTOR), DENSE)
  wi = flat[(('[0]',), 'mlp/wi/kernel')]       # optax's v_row [8], v_col [16]
  assert adafactor.is_slots(wi) and (wi.rows, wi.cols) == ((0,), (1,))
  np.testing.assert_array_equal(flat[(('[0]', '.count'), None)], 2)
  np.testing.assert_array_equal(flat[(('[4]', '.ema'), 'norm/scale')],
                                _trained(ADAFACTOR)[4].ema['norm']['scale'])


def test_adam_slots_tiled_copied_or_fresh_and_the_step_kept():
  dense = _trained(ADAM)[1][0]
  moe = _carry(_trained(ADAM), ADAM)[1][0]
  assert int(moe.count) == 2
  for slot in ('mu', 'nu'):
    source, got = getattr(dense, slot), getattr(moe, slot)
    wi = np.asarray(source['mlp']['wi']['kernel'])
    np.testing.assert_array_equal(got['mlp']['expert']['wi']['kernel'], np.stack([wi, wi]))
    np.testing.assert_array_equal(got['norm']['scale'], source['norm']['scale'])
    np.testing.assert_array_equal(got['mlp']['router']['kernel'], np.zeros((8, 2)))
  reset = _carry(_trained(ADAM), ADAM, keep_counts=False)[1][0]
  assert int(reset.count) == 0 and np.asarray(reset.mu['norm']['scale']).any()
  fresh_moments = _carry(_trained(ADAM), ADAM, moments=False)[1][0]
  assert int(fresh_moments.count) == 2
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(fresh_moments.mu))


def test_adafactor_factors_and_momentum_tiled():
  dense = _trained(ADAFACTOR)
  moe = _carry(dense, ADAFACTOR)
  assert int(moe[0].count) == 2 and int(moe[4].count) == 2
  for slot in ('v_row', 'v_col'):
    wi = np.asarray(getattr(dense[0], slot)['mlp']['wi']['kernel'])
    np.testing.assert_array_equal(getattr(moe[0], slot)['mlp']['expert']['wi']['kernel'],
                                  np.stack([wi, wi]))
  np.testing.assert_array_equal(moe[0].v['norm']['scale'], dense[0].v['norm']['scale'])
  ema = np.asarray(dense[4].ema['mlp']['wi']['kernel'])
  np.testing.assert_array_equal(moe[4].ema['mlp']['expert']['wi']['kernel'], np.stack([ema, ema]))


def test_a_slot_the_op_cannot_make_or_the_source_lacks_is_named():
  bad_ops = {**OPS, 'mlp/expert/wi/kernel': ('mlp/wi/kernel', leaf_ops.Tile(3))}
  with pytest.raises(ValueError, match=r"^Optimizer-state slot \[1\]\[0\]\.mu/mlp/expert/wi/kernel "
                     r"\(2, 8, 16\) cannot be made from the dense slot of mlp/wi/kernel \(8, 16\) "
                     r"\(tiled x3 gives \(3, 8, 16\)\)\. Fix: use the same optimizer\.$"):
    _carry(_trained(ADAM), ADAM, ops=bad_ops)
  source = units.flatten(_trained(ADAFACTOR), DENSE)
  del source[(('[0]',), 'mlp/wi/kernel')]
  with pytest.raises(ValueError, match=r'^The Adafactor state \[0\] of mlp/expert/wi/kernel needs '
                     r'the dense slot \[0\]/mlp/wi/kernel, which the dense optimizer state does '
                     r'not have\. Fix: use the same optimizer\.$'):
    carry.carry_state(source, ADAFACTOR.init(_params(MOE)), ops=OPS, source_shapes=DENSE,
                      shapes=MOE, source_name='the dense', fix=FIX)
  with pytest.raises(ValueError, match=r'^Optimizer-state leaf \[0\]\.count needs the dense slot '
                     r'\[0\]\.count, which the dense optimizer state does not have\.'):
    _carry(_trained(ADAM), ADAFACTOR)
