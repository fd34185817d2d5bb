"""T5X's Adafactor against a numpy transcription of `t5x/adafactor.py` (Adafactor._parse_rule,
_factored_dims, _decay_rate_pow, apply_param_gradient), written here from T5X's code; and its
state through the trainer, orbax and the upcycling hook."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.train.helpers import TRAINING_T5, text
from upcycle import partitioning, tree
from upcycle.models import T5, T5Config
from upcycle.moe import MoeConfig, routers
from upcycle.optimizer_state import counts
from upcycle.train import optimizers
from upcycle.train.objectives import Seq2Seq
from upcycle.restore import Restore
from upcycle.train.t5x_adafactor import FactorDim, factor_rules, moe_logical_factor_rules
from upcycle.train.t5x_adafactor import t5x_adafactor
from upcycle.train.trainer import TrainConfig, Trainer
from upcycle.upcycling import modes

ROW, COL, BATCH, NONE = FactorDim.ROW, FactorDim.COLUMN, FactorDim.BATCH, FactorDim.NONE
HEURISTIC = 'heuristic'


# The numpy reference (float64), T5X's code transcribed.

def ref_parse_rule(rule, shape, fallback_to_heuristics=True):
  ndim = len(shape)
  if rule == HEURISTIC:
    return tuple(range(ndim)), HEURISTIC
  rows = tuple(i for i, d in enumerate(rule) if d == ROW)
  cols = tuple(i for i, d in enumerate(rule) if d == COL)
  batch = tuple(i for i, d in enumerate(rule) if d == BATCH)
  averaging = tuple(int(i) for i in np.delete(np.arange(ndim), batch))
  factor_dims = None if (rows, cols) == ((), ()) else (rows, cols)
  if fallback_to_heuristics and ndim <= 2 and not batch:
    return tuple(range(ndim)), HEURISTIC
  return averaging, factor_dims


def ref_factored_dims(shape, min_dim_size_to_factor):
  if len(shape) < 2:
    return None
  order = np.argsort(shape)
  if shape[order[-2]] < min_dim_size_to_factor:
    return None
  return (int(order[-2]),), (int(order[-1]),)


def ref_init(shape, rule, hp, fallback=True):
  _, dims = ref_parse_rule(rule, shape, fallback)
  if dims == HEURISTIC:
    dims = ref_factored_dims(shape, hp['min_dim_size_to_factor'])
  state = {k: np.zeros((1,)) for k in ('v_row', 'v_col', 'v', 'm')}
  if dims is not None:
    d1, d0 = dims
    state['v_row'], state['v_col'] = np.zeros(np.delete(shape, d0)), np.zeros(np.delete(shape, d1))
  else:
    state['v'] = np.zeros(shape)
  if hp.get('beta1') is not None:
    state['m'] = np.zeros(shape)
  return state


def ref_apply(step, lr, param, state, grad, rule, hp, fallback=True):
  """-> (new param, new state): T5X's `apply_param_gradient`."""
  averaging, dims = ref_parse_rule(rule, param.shape, fallback)
  decay_rate = 1.0 - (step - hp.get('step_offset', 0) + 1.0) ** -0.8
  param_scale = np.maximum(np.sqrt(np.mean(param * param, axis=averaging, keepdims=True)), 1e-3)
  update_scale = lr * param_scale
  mixing_rate = 1.0 - decay_rate
  grad_sqr = grad * grad + 1e-30
  new = dict(state)
  if dims == HEURISTIC:
    dims = ref_factored_dims(param.shape, hp['min_dim_size_to_factor'])
  if dims is not None:
    d1, d0 = dims
    new['v_row'] = decay_rate * state['v_row'] + mixing_rate * np.mean(grad_sqr, axis=d0)
    new['v_col'] = decay_rate * state['v_col'] + mixing_rate * np.mean(grad_sqr, axis=d1)
    reduced_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
    row_col_mean = np.mean(new['v_row'], axis=reduced_d1, keepdims=True)
    row_factor = (new['v_row'] / row_col_mean) ** -0.5
    col_factor = new['v_col'] ** -0.5
    y = grad * np.expand_dims(row_factor, d0) * np.expand_dims(col_factor, d1)
  else:
    new['v'] = decay_rate * state['v'] + mixing_rate * grad_sqr
    y = grad * new['v'] ** -0.5
  y = y / np.maximum(1.0, np.sqrt(np.mean(y * y, axis=averaging, keepdims=True)) / 1.0)
  subtrahend = update_scale * y
  if hp.get('beta1') is not None:
    new['m'] = hp['beta1'] * state['m'] + (1.0 - hp['beta1']) * subtrahend
    subtrahend = new['m']
  if hp.get('weight_decay_rate') is not None:
    return (1.0 - hp['weight_decay_rate']) * param - subtrahend, new
  return param - subtrahend, new


def schedule(step):
  return 0.05 / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), 2.0))


def run_ours(param, grads, rule, first_step=0, **hp):
  """Our transformation on {'w': param} for len(grads) steps -> [param after each step]."""
  opt = t5x_adafactor(schedule, {} if rule == HEURISTIC else {'w': rule}, **hp)
  params = {'w': jnp.asarray(param, jnp.float32)}
  state = counts.fresh(opt.init(params), first_step)
  out = []
  for g in grads:
    updates, state = opt.update({'w': jnp.asarray(g, jnp.float32)}, state, params)
    params = optax.apply_updates(params, updates)
    out.append(np.asarray(params['w'], np.float64))
  return out, state


def run_ref(param, grads, rule, first_step=0, fallback=True, **hp):
  state, out = ref_init(param.shape, rule, hp, fallback), []
  for i, g in enumerate(grads):
    step = first_step + i
    param, state = ref_apply(step, float(schedule(step)), param, state, g, rule, hp, fallback)
    out.append(param)
  return out, state


def _data(shape, steps, seed):
  rng = np.random.default_rng(seed)
  return rng.normal(size=shape), [rng.normal(size=shape) for _ in range(steps)]


@pytest.mark.slow
def test_expert_kernel_updates_are_each_experts_own():
  """[E, d, f], expert 0 ten times larger: experts 1, 2 move as their own [d, f] would."""
  param, grads = _data((3, 4, 6), 4, seed=0)
  param[0] *= 10.0
  ours, _ = run_ours(param, grads, (BATCH, ROW, COL))
  ref, _ = run_ref(param, grads, (BATCH, ROW, COL))
  for got, want in zip(ours, ref):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  for e in range(3):
    alone, _ = run_ref(param[e], [g[e] for g in grads], (ROW, COL), fallback=False)
    for got, want in zip(ours, alone):
      np.testing.assert_allclose(got[e], want, rtol=2e-5, atol=1e-7, err_msg=f'expert {e}')
  # optax.adafactor treats the tensor as one: expert 0 sets the others' parameter scale.
  whole = optax.adafactor(schedule, min_dim_size_to_factor=4)
  params = {'w': jnp.asarray(param, jnp.float32)}
  updates, _ = whole.update({'w': jnp.asarray(grads[0], jnp.float32)}, whole.init(params), params)
  first_alone = run_ref(param[1], [grads[0][1]], (ROW, COL), fallback=False)[0][0] - param[1]
  assert np.abs(np.asarray(updates['w'][1]) - first_alone).max() > 2 * np.abs(first_alone).max()


def test_units_without_gradient_get_no_update_not_nan():
  """A fresh state after upcycling (step 200), an expert whose gradient is zero but for one
  row: the second-moment factors of the zero rows and columns are ~1e-32, their product
  underflows in float32; T5X's factor order keeps the update finite (0 where g is 0)."""
  param, _ = _data((2, 64, 256), 1, seed=3)
  grad = np.zeros_like(param)
  grad[0] = np.random.default_rng(4).normal(size=(64, 256))
  grad[1, 0] = 1e-3 * np.random.default_rng(5).normal(size=256)   # one embed row of expert 1
  ours, _ = run_ours(param, [grad], (BATCH, ROW, COL), first_step=200)
  ref, _ = run_ref(param, [grad], (BATCH, ROW, COL), first_step=200)
  assert np.isfinite(ours[0]).all()
  np.testing.assert_allclose(ours[0], ref[0], rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(ours[0][1, 1:], param[1, 1:].astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize('shape,rule,hp', [
    ((6, 5), HEURISTIC, dict(min_dim_size_to_factor=4)),          # factored, rows = axis 1
    ((6, 5), (ROW, COL), dict(min_dim_size_to_factor=4)),         # rank 2: the heuristic
    ((6, 5), (ROW, COL), dict(min_dim_size_to_factor=128)),       # not factored
    ((7,), (NONE,), dict(min_dim_size_to_factor=128)),            # vector
    ((2, 5, 3), (BATCH, COL, ROW), dict(min_dim_size_to_factor=128, beta1=0.9,
                                        weight_decay_rate=1e-3)),
])
def test_matches_t5x_over_several_steps(shape, rule, hp):
  param, grads = _data(shape, 5, seed=1)
  ours, state = run_ours(param, grads, rule, **hp)
  ref, ref_state = run_ref(param, grads, rule, **hp)
  for got, want in zip(ours, ref):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  slots = state.param_states['w']
  for k in ('v_row', 'v_col', 'v', 'm'):
    np.testing.assert_allclose(np.asarray(getattr(slots, k)), ref_state[k], rtol=2e-5, err_msg=k)
  assert int(state.count) == 5


def test_decay_and_learning_rate_run_on_the_global_step():
  """A fresh state at step 1000 (after upcycling) decays as T5X's at step 1000, not at 0."""
  param, grads = _data((6, 5), 3, seed=2)
  ours, state = run_ours(param, grads, HEURISTIC, first_step=1000, min_dim_size_to_factor=4)
  ref, _ = run_ref(param, grads, HEURISTIC, first_step=1000, min_dim_size_to_factor=4)
  from_zero, _ = run_ref(param, grads, HEURISTIC, min_dim_size_to_factor=4)
  for got, want in zip(ours, ref):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  assert np.abs(ours[-1] - from_zero[-1]).max() > 1e-3
  assert int(state.count) == 1003


def test_factor_rules_of_an_moe_t5_follow_t5x_moe_rules():
  config = T5Config(vocab_size=32, d_model=8, num_heads=2, d_kv=4, d_ff=12, num_encoder_layers=2,
                    num_decoder_layers=2,
                    encoder_moe=MoeConfig(num_experts=2, router=routers.ExpertsChoose()),
                    decoder_moe=MoeConfig(num_experts=2, router=routers.TopK(k=2)))
  boxed = jax.eval_shape(T5(config).init, jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                         jnp.ones((1, 4), jnp.int32))['params']
  axes = partitioning.logical_axes(boxed)
  rules = factor_rules(axes, moe_logical_factor_rules())
  assert rules['encoder/layers_1/mlp/expert/wi_0/kernel'] == (BATCH, ROW, COL)
  assert rules['encoder/layers_1/mlp/expert/wo/kernel'] == (BATCH, COL, ROW)
  assert rules['encoder/layers_1/mlp/router/router_weights/w/kernel'] == (NONE, NONE)
  assert rules['encoder/layers_0/attention/query/kernel'] == (ROW, COL)
  assert rules['encoder/relpos_bias/rel_embedding'] == (NONE, NONE)  # 'heads' COL alone
  opt = optimizers.T5XAdafactor().build(axes)
  slots = opt.init(tree.zeros_for(boxed))
  wo = slots.param_states['encoder']['layers_1']['mlp']['expert']['wo']['kernel']
  assert (wo.rows, wo.cols) == ((2,), (1,)) and wo.v_row.shape == (2, 8)
  with pytest.raises(ValueError, match=r"'classes' has no factor rule.*logical_factor_rules"):
    factor_rules({'head/kernel': ('embed', 'classes')}, moe_logical_factor_rules())
  with pytest.raises(ValueError, match=r'needs the params\' logical axis names'):
    optimizers.T5XAdafactor().build()


@pytest.mark.slow
def test_trainer_saves_resumes_and_upcycles_the_t5x_state(tmp_path):
  """Through the trainer, orbax and the restore hook: fresh state at the dense step, reuse."""
  optimizer = optimizers.T5XAdafactor(schedule=optimizers.rsqrt_schedule(1.0, 100))

  def trainer(name, config, steps, initializer=None):
    cfg = TrainConfig(str(tmp_path / name), train_steps=steps, batch_size=8, log_every=1,
                      checkpoint_every=1000, async_checkpoints=False)
    return Trainer(Seq2Seq(T5(config)), optimizer, cfg, text('train'), None,
                   initializer=initializer)

  trainer('dense', TRAINING_T5, 2).run()
  dense = trainer('dense', TRAINING_T5, 3).run()   # resumes from step 2: the state through orbax
  assert dense['start_step'] == 2 and int(dense['state'].opt_state.count) == 3
  moe_config = dataclasses.replace(
      TRAINING_T5, encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose()),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2)))
  checkpoint = str(tmp_path / 'dense' / 'checkpoints')
  moe = trainer('moe', moe_config, 4)
  with partitioning.activate(moe.built.mesh):
    abstract = moe.built.abstract
    fresh = Restore(checkpoint, modes.Upcycle())(abstract, moe.built.optimizer)
    reused = Restore(checkpoint, modes.Upcycle(), reuse_optimizer_state=True)(abstract,
                                                                      moe.built.optimizer)
  assert int(fresh.opt_state.count) == int(reused.opt_state.count) == 3
  expert = reused.opt_state.param_states['encoder']['layers_1']['mlp']['expert']['wi_0']['kernel']
  source = dense['state'].opt_state.param_states['encoder']['layers_1']['mlp']['wi_0']['kernel']
  assert (expert.rows, expert.cols) == ((1,), (2,)) and not source.rows  # d_ff 64 < 128
  for e in range(4):
    np.testing.assert_allclose(np.asarray(expert.v_row[e]), np.asarray(source.v).mean(axis=1),
                               rtol=1e-6)
