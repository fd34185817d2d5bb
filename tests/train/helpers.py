"""Shared by the training tests: the models they train, their data, the trainer on a mesh, and
the `python -m upcycle.train` command line of the subprocess runs."""

import os
import sys

from tests.helpers import with_flags
from upcycle.data.text import TextPipeline
from upcycle.models import T5, T5Config, ViTConfig
from upcycle.train.built_run import build_run
from upcycle.train.objectives import Seq2Seq
from upcycle.train.optimizers import Adafactor, rsqrt_schedule
from upcycle.train.trainer import Trainer, TrainConfig

TEXT_LENGTHS = {'inputs': 64, 'targets': 16}
# What the training tests train: large enough to learn the offline span corruption (its 384
# ids) and the digits in a few dozen steps. The model tests' T5 and ViT are smaller
# (tests/models/helpers.py), the checkpoint tests' smaller still (tests/checkpoints/helpers.py).
TRAINING_T5 = T5Config(vocab_size=384, d_model=32, num_heads=2, d_kv=16, d_ff=64,
                       num_encoder_layers=2, num_decoder_layers=2)
TRAINING_VIT = ViTConfig(num_classes=10, image_size=(16, 16), patch_size=(4, 4), width=32,
                         depth=2, mlp_dim=64, num_heads=2)

# One CPU device, XLA unoptimized: the subprocess runs of `train_command`.
ONE_DEVICE_XLA_FLAGS = ('--xla_force_host_platform_device_count=1 '
                        '--xla_backend_optimization_level=0')
ONE_DEVICE_ENV = {**os.environ, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS}


def text(split):
  """The offline span corruption task's `split`, at TEXT_LENGTHS."""
  return TextPipeline('offline_span_corruption', split, TEXT_LENGTHS)


def losses(result):
  """The training losses of a `Trainer.run` result, step by step."""
  return [h['loss'] for h in result['history']]


def run_t5(tmp_path, config=TRAINING_T5, devices=None, steps=30, **train_kwargs):
  """`steps` steps of `config` on `text`, batches of 8, into `tmp_path`: the run's result."""
  train_config = TrainConfig(str(tmp_path), train_steps=steps, batch_size=8, log_every=1,
                             checkpoint_every=1000, eval_batches=2, async_checkpoints=False,
                             **train_kwargs)
  return Trainer(Seq2Seq(T5(config)), Adafactor(schedule=rsqrt_schedule(1.0, 100)),
                 train_config, text('train'), text('validation'), devices=devices).run()


def mesh_run(objective, optimizer, batch):
  """(the `BuiltRun`, its abstract state) on a 2x2x2 mesh (data x expert x model) of
  simulated devices, for `batch` (4 rows)."""
  config = TrainConfig(model_dir='unused', train_steps=1, batch_size=4,
                       num_expert_partitions=2, num_model_partitions=2)
  built = build_run(objective=objective, optimizer=optimizer, config=config, host_batch=batch)
  return built, built.abstract


def train_command(model_dir, steps, *flags):
  """`python -m upcycle.train` of the tiny T5 gin file at 2+2 layers on the offline task, for
  `steps` steps (batches of 8, a checkpoint every 4, no evaluation), and `flags` (`with_flags`:
  a binding of `flags` replaces the command's own)."""
  return with_flags([sys.executable, '-m', 'upcycle.train',
          '--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/pretrain.gin',
          '--gin_file=data/offline_span_corruption.gin',
          f"--gin.MODEL_DIR='{model_dir}'", f'--gin.TRAIN_STEPS={steps}',
          '--gin.BATCH_SIZE=8', "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
          '--gin.trainer.TrainConfig.log_every=1', '--gin.trainer.TrainConfig.checkpoint_every=4',
          '--gin.models.T5Config.num_encoder_layers=2',
          '--gin.models.T5Config.num_decoder_layers=2',
          '--gin.__main__.train.eval_data=None'], *flags)
