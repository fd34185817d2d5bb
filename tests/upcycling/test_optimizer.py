"""Optimizer-state upcycling: optax Adam / Adafactor / SGD, and T5X Adafactor conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from upcycle import tree
from upcycle.optimizer_state import adafactor, from_t5x_adafactor
from upcycle.optimizer_state.carry import carry_optimizer_state
from upcycle.upcycling import experts
from upcycle.upcycling.surgery import make_plan, upcycle

MLP = 'encoder/layers_1/mlp'
ROUTER = f'{MLP}/router/router_weights/w/kernel'


def schedule(step):
  return 0.1 / jnp.sqrt(1.0 + step)  # inverse square root, as the dense run


def _matrices(params):
  return jax.tree.map(lambda x: x.ndim >= 2, params)


OPTIMIZERS = {
    'adam': lambda: optax.adam(schedule),
    'adafactor': lambda: optax.adafactor(schedule, min_dim_size_to_factor=4, momentum=0.9),
    # Adafactor on the matrices only (the vectors' updates are their gradients), and
    # Adafactor for matrices beside Adam for vectors: slots of parameters a branch does not
    # update are optax.MaskedNode.
    'masked adafactor': lambda: optax.masked(
        optax.adafactor(schedule, min_dim_size_to_factor=4), _matrices),
    'multi_transform': lambda: optax.multi_transform(
        {True: optax.adafactor(schedule, min_dim_size_to_factor=4), False: optax.adam(schedule)},
        _matrices),
}


def _grads(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                      for k, x in zip(keys, leaves)])


def upcycle_optimizer_state(dense, dense_state, moe, optimizer, experts='copy', **kwargs):
  """The dense state carried through the upcycling plan from `dense` to `moe`."""
  plan = make_plan(dense, moe, experts=experts)
  return carry_optimizer_state(dense_state, plan, moe, optimizer, **kwargs)


def _train_dense(t5, optimizer, steps=3):
  params = jax.tree.map(jnp.asarray, t5(d_model=8, d_ff=16))
  state = optimizer.init(params)
  for step in range(steps):
    updates, state = optimizer.update(_grads(params, step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _moe_grads(dense_grads, moe_params, num_experts):
  """Copies and shared experts get the dense gradient, experts the dense gradient tiled,
  routers noise."""
  flat_dense = tree.flatten(dense_grads)
  out = {}
  for path, role in tree.classify(tree.flatten(moe_params)).items():
    if role.kind in ('copy', 'shared_expert'):
      out[path] = flat_dense[role.source]
    elif role.kind == 'expert':
      out[path] = jnp.broadcast_to(flat_dense[role.source],
                                   (num_experts,) + flat_dense[role.source].shape)
    else:
      out[path] = jnp.ones(tree.flatten(moe_params)[path].shape)
  return tree.unflatten(out)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_first_moe_update_equals_the_dense_update(name, t5, target):
  """Tiled moments + carried step: each expert, shared expert and copy moves exactly as the
  dense param would."""
  optimizer = OPTIMIZERS[name]()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 2, shared_d_ff=16), rng=0)
  moe_state = upcycle_optimizer_state(dense, dense_state, moe, optimizer)
  assert jax.tree.structure(moe_state) == jax.tree.structure(optimizer.init(moe))
  grads = _grads(dense, 10)
  dense_updates = tree.flatten(optimizer.update(grads, dense_state, dense)[0])
  moe_updates = tree.flatten(optimizer.update(_moe_grads(grads, moe, 2), moe_state, moe)[0])
  for path, role in tree.classify(moe_updates).items():
    if role.kind == 'router':
      continue
    want = dense_updates[role.source]
    got = moe_updates[path]
    for e in range(2 if role.kind == 'expert' else 1):
      np.testing.assert_allclose(got[e] if role.kind == 'expert' else got, want, rtol=2e-5,
                                 atol=1e-7, err_msg=path)


def test_adam_moments_tiled_router_fresh_step_kept(t5, target):
  optimizer = OPTIMIZERS['adam']()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 3), experts=experts.Drop(0.5), rng=0)
  state = upcycle_optimizer_state(dense, dense_state, moe, optimizer)
  adam, dense_adam = state[0], dense_state[0]
  assert int(adam.count) == 3
  for slot in ('mu', 'nu'):
    flat, flat_dense = tree.flatten(getattr(adam, slot)), tree.flatten(getattr(dense_adam, slot))
    np.testing.assert_array_equal(flat[f'{MLP}/expert/wo/kernel'],
                                  np.broadcast_to(flat_dense[f'{MLP}/wo/kernel'], (3, 16, 8)))
    np.testing.assert_array_equal(flat['token_embedder/embedding'],
                                  flat_dense['token_embedder/embedding'])
    assert not np.asarray(flat[ROUTER]).any()
  lr_count = state[1].count
  assert int(lr_count) == 3


def test_adafactor_factored_moments_tiled(t5, target):
  optimizer = OPTIMIZERS['adafactor']()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 2), rng=0)
  state = upcycle_optimizer_state(dense, dense_state, moe, optimizer)
  fs, dense_fs = state[0], dense_state[0]
  assert int(fs.count) == 3
  v_row, dense_v_row = tree.flatten(fs.v_row), tree.flatten(dense_fs.v_row)
  v_col, dense_v_col = tree.flatten(fs.v_col), tree.flatten(dense_fs.v_col)
  # wo [16, 8]: v_row drops the largest axis (16) -> [8]; experts [2, 16, 8] -> [2, 8].
  assert dense_v_row[f'{MLP}/wo/kernel'].shape == (8,)
  np.testing.assert_array_equal(v_row[f'{MLP}/expert/wo/kernel'],
                                np.broadcast_to(dense_v_row[f'{MLP}/wo/kernel'], (2, 8)))
  np.testing.assert_array_equal(v_col[f'{MLP}/expert/wi_0/kernel'],
                                np.broadcast_to(dense_v_col[f'{MLP}/wi_0/kernel'], (2, 16)))
  ema = tree.flatten(state[4].ema)
  np.testing.assert_array_equal(ema[f'{MLP}/expert/wi_1/kernel'][1],
                                tree.flatten(dense_state[4].ema)[f'{MLP}/wi_1/kernel'])
  assert not np.asarray(tree.flatten(fs.v)[ROUTER]).any()


def test_adafactor_layout_change_rebuilds_the_estimate(t5, target):
  """E = 32 is the largest axis of [32, 8, 16]: optax factors it over axes 2 and 0, not the
  dense [8, 16]'s 0 and 1, so the factors are rebuilt from the dense estimate, not tiled.

  In numpy, optax's convention (`scale_by_factored_rms`): d0 the largest axis, d1 the second;
  v_row lacks d0, v_col lacks d1, and the preconditioner is v_row / mean(v_row, d1) x v_col.
  """
  optimizer = OPTIMIZERS['adafactor']()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 32), rng=0)
  fs = upcycle_optimizer_state(dense, dense_state, moe, optimizer)[0]
  slot = lambda state, k, path: np.asarray(tree.flatten(getattr(state, k))[path], np.float64)
  dense_row = slot(dense_state[0], 'v_row', f'{MLP}/wi_0/kernel')     # [8]: d0 = 1 dropped
  dense_col = slot(dense_state[0], 'v_col', f'{MLP}/wi_0/kernel')     # [16]: d1 = 0 dropped
  want = np.outer(dense_row / dense_row.mean(), dense_col)             # [8, 16]
  v_row = slot(fs, 'v_row', f'{MLP}/expert/wi_0/kernel')                # d0 = 0 dropped
  v_col = slot(fs, 'v_col', f'{MLP}/expert/wi_0/kernel')                # d1 = 2 dropped
  assert v_row.shape == (8, 16) and v_col.shape == (32, 8)
  # The means of the dense estimate tiled 32 times, over the experts and over d_ff.
  np.testing.assert_allclose(v_row, want, rtol=1e-5)
  np.testing.assert_allclose(v_col, np.broadcast_to(want.mean(1), (32, 8)), rtol=1e-5)
  got = v_row[None] / v_row.mean(1, keepdims=True)[None] * v_col[:, :, None]
  np.testing.assert_allclose(got, np.broadcast_to(want, (32, 8, 16)), rtol=1e-5)


def test_lr_at_first_moe_step_is_the_dense_schedule_at_that_step(t5, target):
  optimizer = optax.sgd(schedule)
  dense, dense_state = _train_dense(t5, optimizer, steps=5)
  moe, _ = upcycle(dense, target(dense, [MLP], 2), rng=0)
  ones = jax.tree.map(jnp.ones_like, moe)
  for keep_step, step in ((True, 5), (False, 0)):
    state = upcycle_optimizer_state(dense, dense_state, moe, optimizer, keep_step=keep_step)
    updates = tree.flatten(optimizer.update(ones, state, moe)[0])
    np.testing.assert_allclose(updates['token_embedder/embedding'], -schedule(step), rtol=1e-6)
    np.testing.assert_allclose(updates[f'{MLP}/expert/wo/kernel'], -schedule(step), rtol=1e-6)


def test_fresh_moments_keep_the_step(t5, target):
  optimizer = OPTIMIZERS['adam']()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 2), rng=0)
  state = upcycle_optimizer_state(dense, dense_state, moe, optimizer, tile_moments=False)
  assert int(state[0].count) == 3
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(state[0].mu))


def test_shape_changing_experts_need_fresh_moments(t5, target):
  optimizer = OPTIMIZERS['adam']()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 4, expert_d_ff=8), experts=experts.Granular(2),
                   rng=0)
  with pytest.raises(ValueError, match=r'slot .*expert/wi_0/kernel \(4, 8, 8\) cannot be made from '
                     r'the dense slot of encoder/layers_1/mlp/wi_0/kernel \(8, 16\)'
                     r'.*tile_moments=False'):
    upcycle_optimizer_state(dense, dense_state, moe, optimizer, experts=experts.Granular(2))
  upcycle_optimizer_state(dense, dense_state, moe, optimizer, experts=experts.Granular(2),
                          tile_moments=False)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_narrower_shared_expert_takes_the_moments_of_its_units(name, t5, target):
  """A shared expert of the first 4 of 16 d_ff units gets those units' moments: Adam's are
  per entry, so they are the dense ones sliced; Adafactor's are rebuilt for its shape."""
  optimizer = OPTIMIZERS[name]()
  dense, dense_state = _train_dense(t5, optimizer)
  moe, _ = upcycle(dense, target(dense, [MLP], 2, shared_d_ff=4), rng=0)
  state = upcycle_optimizer_state(dense, dense_state, moe, optimizer)
  assert jax.tree.structure(state) == jax.tree.structure(optimizer.init(moe))
  if name != 'adam':
    return
  for slot in ('mu', 'nu'):
    flat = tree.flatten(getattr(state[0], slot))
    flat_dense = tree.flatten(getattr(dense_state[0], slot))
    np.testing.assert_array_equal(flat[f'{MLP}/shared_expert/wi_0/kernel'],
                                  flat_dense[f'{MLP}/wi_0/kernel'][:, :4])
    np.testing.assert_array_equal(flat[f'{MLP}/shared_expert/wo/kernel'],
                                  flat_dense[f'{MLP}/wo/kernel'][:4])


def test_dense_state_of_another_optimizer_is_an_error(t5, target):
  dense, dense_state = _train_dense(t5, OPTIMIZERS['adam']())
  moe, _ = upcycle(dense, target(dense, [MLP], 2), rng=0)
  with pytest.raises(ValueError, match='Adafactor state .* needs the dense slot'):
    upcycle_optimizer_state(dense, dense_state, moe, OPTIMIZERS['adafactor']())


def _t5x_reference_step(param, grad, slots, step, lr, beta1=0.9, min_dim=4):
  """T5X `Adafactor.apply_param_gradient` (t5x/adafactor.py), heuristic factoring, in numpy.

  Hyperparameters: decay_rate 0.8, step_offset 0, multiply_by_parameter_scale,
  clipping_threshold 1.0, epsilon1 1e-30, epsilon2 1e-3, no weight decay.
  """
  decay = 1.0 - (step + 1.0) ** -0.8
  update_scale = lr * max(np.sqrt(np.mean(param * param)), 1e-3)
  grad_sqr = grad * grad + 1e-30
  shape = param.shape
  if len(shape) >= 2 and shape[np.argsort(shape)[-2]] >= min_dim:
    d1, d0 = int(np.argsort(shape)[-2]), int(np.argsort(shape)[-1])
    v_row = decay * slots['v_row'] + (1 - decay) * grad_sqr.mean(d0)
    v_col = decay * slots['v_col'] + (1 - decay) * grad_sqr.mean(d1)
    reduced_d1 = d1 - 1 if d1 > d0 else d1
    row_factor = (v_row / v_row.mean(reduced_d1, keepdims=True)) ** -0.5
    y = grad * np.expand_dims(row_factor, d0) * np.expand_dims(v_col ** -0.5, d1)
  else:
    y = grad * (decay * slots['v'] + (1 - decay) * grad_sqr) ** -0.5
  y = y / max(1.0, np.sqrt(np.mean(y * y)))
  m = beta1 * slots['m'] + (1 - beta1) * update_scale * y
  return param - m


def _t5x_state(params, step, factored_kernels=True):
  rng = np.random.default_rng(0)
  states = {}
  for path, x in tree.flatten(params).items():
    shape = x.shape
    slot = {k: np.zeros((1,), np.float32) for k in ('v_row', 'v_col', 'v')}
    if factored_kernels and len(shape) >= 2:
      d1, d0 = adafactor.factored_dims(shape)
      slot['v_row'] = rng.uniform(0.5, 2, np.delete(shape, d0)).astype(np.float32)
      slot['v_col'] = rng.uniform(0.5, 2, np.delete(shape, d1)).astype(np.float32)
    else:
      slot['v'] = rng.uniform(0.5, 2, shape).astype(np.float32)
    slot['m'] = rng.normal(0, 0.01, shape).astype(np.float32)
    states[path] = slot
  return {'step': np.int32(step), 'param_states': tree.unflatten(
      {f'{p}/{k}': v for p, slot in states.items() for k, v in slot.items()})}


def test_t5x_adafactor_converts_to_optax_and_steps_like_t5x(t5):
  params = jax.tree.map(jnp.asarray, t5(d_model=8, d_ff=16))
  t5x = _t5x_state(params, step=7)
  optimizer = optax.adafactor(0.01, min_dim_size_to_factor=4, momentum=0.9)
  state = from_t5x_adafactor(t5x, params, optimizer)
  fs = state[0]
  assert int(fs.count) == 7 and int(state[4].count) == 7
  flat_t5x = tree.flatten(t5x['param_states'])
  np.testing.assert_array_equal(tree.flatten(fs.v_row)[f'{MLP}/wo/kernel'],
                                flat_t5x[f'{MLP}/wo/kernel/v_row'])
  np.testing.assert_array_equal(tree.flatten(state[4].ema)[f'{MLP}/wo/kernel'],
                                flat_t5x[f'{MLP}/wo/kernel/m'])
  grads = _grads(params, 3)
  updates, _ = optimizer.update(grads, state, params)
  new = tree.flatten(optax.apply_updates(params, updates))
  flat_grads = tree.flatten(grads)
  for path, x in tree.flatten(params).items():
    slots = {k: flat_t5x[f'{path}/{k}'] for k in ('v_row', 'v_col', 'v', 'm')}
    want = _t5x_reference_step(np.asarray(x), np.asarray(flat_grads[path]), slots, 7, 0.01)
    np.testing.assert_allclose(new[path], want, rtol=1e-5, atol=1e-7, err_msg=path)


def test_t5x_unfactored_moments_are_refactored_for_optax(t5):
  params = jax.tree.map(jnp.asarray, t5(d_model=8, d_ff=16))
  t5x = _t5x_state(params, step=2, factored_kernels=False)
  optimizer = optax.adafactor(0.01, min_dim_size_to_factor=4)
  fs = from_t5x_adafactor(t5x, params, optimizer)[0]
  v = tree.flatten(t5x['param_states'])[f'{MLP}/wi_0/kernel/v']        # [8, 16]
  np.testing.assert_allclose(tree.flatten(fs.v_row)[f'{MLP}/wi_0/kernel'], v.mean(1), rtol=1e-6)
  np.testing.assert_allclose(tree.flatten(fs.v_col)[f'{MLP}/wi_0/kernel'], v.mean(0), rtol=1e-6)


def test_t5x_state_then_upcycled(t5, target):
  params = jax.tree.map(jnp.asarray, t5(d_model=8, d_ff=16))
  optimizer = optax.adafactor(0.01, min_dim_size_to_factor=4, momentum=0.9)
  dense_state = from_t5x_adafactor(_t5x_state(params, step=4), params, optimizer)
  moe, _ = upcycle(params, target(params, [MLP], 2), rng=0)
  state = upcycle_optimizer_state(params, dense_state, moe, optimizer)
  assert int(state[0].count) == 4
  np.testing.assert_array_equal(tree.flatten(state[4].ema)[f'{MLP}/expert/wo/kernel'][1],
                                tree.flatten(dense_state[4].ema)[f'{MLP}/wo/kernel'])
  with pytest.raises(ValueError, match="expected 'param_states' and 'step'"):
    from_t5x_adafactor({'v': 1}, params, optimizer)
