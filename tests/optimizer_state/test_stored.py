"""optimizer_state/stored.py: a stored optimizer state read back as the optax state of the run
(orbax's dict / list form written by hand here), and the errors for states that cannot be."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from upcycle.checkpoints import Checkpoint
from upcycle.optimizer_state import stored

PARAMS = {'w': jnp.zeros((4, 3)), 'b': jnp.zeros((3,))}
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
RNG = np.random.default_rng(0)


def _as_orbax_stores_it():
  """What orbax keeps of OPTIMIZER's state: named tuples as dicts by field, tuples as lists,
  empty states None; numpy leaves."""
  return [None, [{'count': np.int32(7),
                  'mu': {'w': RNG.normal(size=(4, 3)), 'b': RNG.normal(size=(3,))},
                  'nu': {'w': RNG.uniform(size=(4, 3)), 'b': RNG.uniform(size=(3,))}}, None]]


def test_orbax_state_is_restructured_as_the_optimizer_makes_it():
  saved = _as_orbax_stores_it()
  state = stored.as_optax(saved, 'optax', PARAMS, OPTIMIZER)
  assert jax.tree.structure(state) == jax.tree.structure(OPTIMIZER.init(PARAMS))
  adam = state[1][0]
  assert int(adam.count) == 7 and adam.count.dtype == jnp.int32
  for slot in ('mu', 'nu'):
    for name in ('w', 'b'):
      got = getattr(adam, slot)[name]
      assert got.dtype == jnp.float32   # the optimizer's dtype, not the stored float64
      np.testing.assert_allclose(got, saved[1][0][slot][name], rtol=1e-6)


def test_a_stored_state_of_another_optimizer_is_named():
  saved = _as_orbax_stores_it()
  del saved[1][0]['nu']['b']
  with pytest.raises(ValueError, match=r"^The optimizer state stored in /ckpt has no leaf "
                     r"\[1\]\[0\]\.nu\['b'\] that the optimizer has\. Fix: train with the "
                     r"optimizer that wrote the checkpoint"):
    stored.restructure(saved, jax.eval_shape(OPTIMIZER.init, PARAMS), '/ckpt')
  saved = _as_orbax_stores_it()
  saved[1][0]['mu']['w'] = np.zeros((1,))
  with pytest.raises(ValueError, match=r"^The optimizer state stored in /ckpt has "
                     r"\[1\]\[0\]\.mu\['w'\] of shape \(1,\); the optimizer makes \(4, 3\)\. "):
    stored.as_optax(saved, 'optax', PARAMS, OPTIMIZER, '/ckpt')


def _checkpoint(format, optimizer_state):  # pylint: disable=redefined-builtin
  return Checkpoint(params={}, step=None, optimizer_state=optimizer_state, format=format,
                    path='/ckpt')


def test_reusable_states_and_one_line_errors_naming_the_binding():
  state = {'step': 3, 'param_states': {}}
  assert stored.reusable(_checkpoint('t5x', state), 'X.reuse') is state
  fix = r'Fix: set X\.reuse = False'
  for ckpt in (_checkpoint('orbax', None), _checkpoint('t5x_orbax', {'step': 3})):
    with pytest.raises(ValueError, match=rf'^/ckpt \({ckpt.format}\) holds no optimizer state to '
                       rf'reuse\. {fix} \(fresh optimizer state\)'):
      stored.reusable(ckpt, 'X.reuse')
  with pytest.raises(ValueError, match=rf"^/ckpt: optimizer state of format 'hf' cannot be "
                     rf"reused\. {fix}\.$"):
    stored.reusable(_checkpoint('hf', {'a': 1}), 'X.reuse')
