"""The vision recipe through the trainer and the restore hook on a tiny ViT: big_vision's
Adafactor, the dense optimizer state reused, the dense run's schedule continued."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.train.helpers import TRAINING_VIT
from upcycle import partitioning, tree
from upcycle.data.images import DIGITS, ImagePipeline
from upcycle.models import ViT
from upcycle.moe import MoeConfig, routers
from upcycle.optimizer_state import counts
from upcycle.train.objectives import Classification
from upcycle.train.optimizers import BigVisionAdafactor, big_vision_schedule
from upcycle.restore import Restore
from upcycle.train.trainer import TrainConfig, Trainer
from upcycle.upcycling import modes

DENSE_STEPS, BUDGET = 6, 12   # the schedule runs over the whole budget, dense + upcycled
OPTIMIZER = BigVisionAdafactor(
    big_vision_schedule(BUDGET, 'rsqrt', warmup_steps=3, cooldown_steps=4, timescale=3),
    learning_rate=3e-3, weight_decay=1e-4, min_dim_size_to_factor=32)
MOE_VIT = dataclasses.replace(TRAINING_VIT, moe=MoeConfig(
    num_experts=4, router=routers.ExpertsChoose(), train_capacity_factor=2.0,
    normalize_combine_weights=True))


def _trainer(model_dir, config, steps, initializer=None):
  images = lambda split, train: ImagePipeline(DIGITS, split, image_size=16, train=train,
                                              random_flip=False)
  train_config = TrainConfig(str(model_dir), train_steps=steps, batch_size=8, log_every=1,
                             checkpoint_every=1000, async_checkpoints=False)
  return Trainer(Classification(ViT(config)), OPTIMIZER, train_config, images('train', True),
                 None, initializer=initializer)


def test_big_vision_schedule_closed_form():
  s = big_vision_schedule(BUDGET, 'rsqrt', warmup_steps=3, cooldown_steps=4, timescale=3)
  want = {0: 0.0, 1: 1 / 3, 3: 1.0, 6: 1 / np.sqrt(2), 9: 1 / np.sqrt(3) * 3 / 4, 12: 0.0}
  for step, value in want.items():
    np.testing.assert_allclose(float(s(step)), value, rtol=1e-6, err_msg=step)


@pytest.mark.slow
def test_upcycled_vit_reuses_the_state_and_continues_the_learning_rate(tmp_path):
  dense = _trainer(tmp_path / 'dense', TRAINING_VIT, DENSE_STEPS).run()
  hook = Restore(str(tmp_path / 'dense' / 'checkpoints'), modes.Upcycle(),
                 reuse_optimizer_state=True)
  moe = _trainer(tmp_path / 'moe', MOE_VIT, DENSE_STEPS + 2, hook)

  # The reused state: the dense second moments and momentum, tiled over the experts.
  with partitioning.activate(moe.built.mesh):
    state = hook(moe.built.abstract, moe.built.optimizer)
  dense_rms, dense_ema = dense['state'].opt_state[1], dense['state'].opt_state[3]
  rms, ema = state.opt_state[1], state.opt_state[3]
  assert isinstance(rms, optax.FactoredState) and int(rms.count) == DENSE_STEPS
  block = 'Transformer/encoderblock_1/MlpBlock_0'
  for name, slots, dense_slots in (('v_row', rms.v_row, dense_rms.v_row),
                                   ('v_col', rms.v_col, dense_rms.v_col),
                                   ('ema', ema.ema, dense_ema.ema)):
    got = tree.flatten(slots)[f'{block}/expert/Dense_0/kernel']
    want = tree.flatten(dense_slots)[f'{block}/Dense_0/kernel']
    assert np.asarray(want).any(), name
    for e in range(4):
      np.testing.assert_array_equal(np.asarray(got[e]), np.asarray(want), err_msg=name)
  assert int(state.opt_state[-2].count) == DENSE_STEPS   # scale_by_schedule: the dense step

  # The first MoE step's learning rate is the dense schedule's at that step, 3e-3 / sqrt(2).
  result = moe.run()
  first = result['history'][0]
  assert result['start_step'] == DENSE_STEPS and first['step'] == DENSE_STEPS + 1
  np.testing.assert_allclose(first['learning_rate'], float(OPTIMIZER.schedule(DENSE_STEPS)),
                             rtol=1e-6)
  np.testing.assert_allclose(first['learning_rate'], 3e-3 / np.sqrt(2), rtol=1e-6)
  dense_lrs = [h['learning_rate'] for h in dense['history']]
  np.testing.assert_allclose(dense_lrs, [float(OPTIMIZER.schedule(s)) for s in range(6)],
                             rtol=1e-6)
  assert np.isfinite(first['loss'])
  jax.clear_caches()


@pytest.mark.slow
def test_weight_decay_is_decoupled_scheduled_and_on_kernels_only():
  """Zero gradients: the update is -decay_schedule(t) * weight_decay * p for kernels (not x lr)."""
  opt = OPTIMIZER.build()
  params = {'a': {'kernel': jnp.full((2, 3), 2.0), 'bias': jnp.ones((3,))}}
  state = counts.fresh(opt.init(params), DENSE_STEPS)
  updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), state, params)
  np.testing.assert_allclose(np.asarray(updates['a']['kernel']), -2e-4 / np.sqrt(2), rtol=1e-6)
  assert not np.asarray(updates['a']['bias']).any()
