"""The train step: microbatching changes memory, not results; a non-finite loss stops the run."""

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.models.helpers import MODEL_T5, tokens
from upcycle.data.images import DIGITS, ImagePipeline
from upcycle.models import T5, ViT, ViTConfig
from upcycle.moe import MoeConfig, routers
from upcycle.train import trainer
from upcycle.train.objectives import Classification, Seq2Seq
from upcycle.train.optimizers import AdamW
from upcycle.train_state import TrainState
from upcycle.train.step import make_train_step


@pytest.mark.slow
def test_microbatches_give_the_same_update():
  cfg = dataclasses.replace(MODEL_T5, decoder_moe=MoeConfig(
      num_experts=2, router=routers.TopK(k=1), eval_capacity_factor=2.0))
  objective = Seq2Seq(T5(cfg))
  batch = {'encoder_input_tokens': tokens(0, (4, 8), 64),
           'decoder_input_tokens': tokens(1, (4, 6), 64),
           'decoder_target_tokens': tokens(2, (4, 6), 64).at[:, -2:].set(0)}
  params = nn.meta.unbox(objective.model.init(jax.random.PRNGKey(0), batch['encoder_input_tokens'],
                                              batch['decoder_input_tokens'])['params'])
  optimizer = optax.sgd(1.0)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  results = [jax.jit(make_train_step(objective, optimizer, lambda s: 1.0, n))(
      state, batch, jax.random.PRNGKey(0)) for n in (1, 2)]
  (one, m1), (two, m2) = results
  np.testing.assert_allclose(m1['loss'], m2['loss'], rtol=1e-5)
  np.testing.assert_allclose(m1['accuracy'], m2['accuracy'], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               one.params, two.params)
  assert float(m1['moe/total']) > 0


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  vit = ViT(ViTConfig(num_classes=10, image_size=(8, 8), patch_size=(4, 4), width=16, depth=1,
                      mlp_dim=16, num_heads=2))
  exploding = lambda step: jnp.where(step < 3, 1e-3, 1e30)   # params overflow from step 4 on
  config = trainer.TrainConfig(str(tmp_path), train_steps=12, batch_size=16, log_every=1,
                               checkpoint_every=2, async_checkpoints=False)
  data = ImagePipeline(DIGITS, 'train', image_size=8, train=False)
  run = trainer.Trainer(Classification(vit), AdamW(schedule=exploding, grad_clip_norm=None),
                        config, data)
  with pytest.raises(trainer.NonFiniteLossError, match='NaN or infinite') as error:
    run.run()
  steps = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert steps and max(steps) <= 4
  assert f'last good checkpoint is step {max(steps)}' in str(error.value)
