"""Upcycled training starts where the dense model is, when the configuration preserves it."""

import dataclasses

import numpy as np
import pytest

from tests.train.helpers import TRAINING_T5, text
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers
from upcycle.train.objectives import Seq2Seq
from upcycle.train.optimizers import Adafactor, rsqrt_schedule
from upcycle.restore import Restore
from upcycle.train.trainer import TrainConfig, Trainer
from upcycle.upcycling import modes


def continue_run(model_dir, config, initializer, steps):
  train_config = TrainConfig(str(model_dir), train_steps=steps, batch_size=8, log_every=1,
                             checkpoint_every=1000, eval_batches=2, async_checkpoints=False,
                             eval_at_start=True)
  return Trainer(Seq2Seq(T5(config)), Adafactor(schedule=rsqrt_schedule(1.0, 100)),
                 train_config, text('train'), text('validation'), initializer=initializer).run()


@pytest.mark.slow
def test_function_preserving_upcycling_starts_from_the_dense_loss(tmp_path, dense_t5_run):
  checkpoint = str(dense_t5_run[0] / 'checkpoints')
  preserving = dataclasses.replace(
      TRAINING_T5,
      encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose(),
                            train_capacity_factor=4.0,
                            eval_capacity_factor=4.0, normalize_combine_weights=True),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2),
                            train_capacity_factor=2.0, eval_capacity_factor=2.0,
                            normalize_combine_weights=True))
  dense = continue_run(tmp_path / 'dense_more', TRAINING_T5,
                       Restore(checkpoint, modes.Continue(), reuse_optimizer_state=True), steps=32)
  moe = continue_run(tmp_path / 'moe', preserving,
                     Restore(checkpoint, modes.Upcycle(experts='copy'), reuse_optimizer_state=True),
                     steps=32)
  assert dense['start_step'] == moe['start_step'] == 30
  np.testing.assert_allclose(moe['initial_eval']['loss'], dense['initial_eval']['loss'],
                             rtol=1e-5)
  # The first step sees the same batch: same cross-entropy before any update.
  np.testing.assert_allclose(moe['history'][0]['cross_entropy'],
                             dense['history'][0]['cross_entropy'], rtol=1e-5)
  assert moe['history'][0]['learning_rate'] == dense['history'][0]['learning_rate']
  # Copies: the first row logs each MoE layer's experts exactly 0 apart (the dense run has no
  # MoE layer to log); the routing health keeps it beside the trained experts' spread.
  layers = moe['routing_health']['layers']
  assert {k for k in moe['history'][0] if k.endswith('/expert_spread')} == {
      f'moe/{layer}/expert_spread' for layer in layers}
  assert not any(k.endswith('/expert_spread') for k in dense['history'][0])
  for layer, h in layers.items():
    assert moe['history'][0][f'moe/{layer}/expert_spread'] == h['expert_spread_at_init'] == 0.0
    assert h['expert_spread'] > 0.0
