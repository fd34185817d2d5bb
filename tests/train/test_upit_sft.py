"""UpIT end to end from SFT, as docs/upcycling.md's command sequence runs it, at tiny scale: a
dense Llama pretrained, instruction-tuned on the offline set with a checkpoint at every
interval, those checkpoints and their DARE merges as the experts of an MoE whose routers alone
are trained on whole samples, then the MoE instruction-tuned."""

import json

import gin
import numpy as np
import pytest

from upcycle import checkpoints, gin_utils, tree
from upcycle.train import __main__ as train_main

TINY = ['--gin_file=models/llama/tiny.gin', '--gin.models.LlamaConfig.num_layers=2']
SMALL = ['--gin.BATCH_SIZE=8', "--gin.TASK_FEATURE_LENGTHS={'targets': 64}",
         '--gin.EVAL_STEPS=1', '--gin.trainer.TrainConfig.log_every=1']
MOE = ['--gin_file=moe/mixtral.gin', '--gin.NUM_EXPERTS=4']


def _train(argv):
  """One command of the sequence, as its own process would run it: gin starts empty."""
  gin.clear_config(clear_constants=True)
  return gin_utils.run(train_main.train, argv, 'test')


def _rows(model_dir):
  return [json.loads(line) for line in open(model_dir / 'metrics.jsonl')]


@pytest.mark.slow
def test_upit_runs_from_sft_checkpoints_to_a_trained_moe(tmp_path, entry_points):
  dense, sft, routers, moe = (tmp_path / name for name in ('dense', 'sft', 'routers', 'moe'))
  _train(TINY + ['--gin_file=runs/llm_pretrain.gin', '--gin_file=data/offline_stdlib_lm.gin']
         + SMALL + [f"--gin.MODEL_DIR='{dense}'", '--gin.TRAIN_STEPS=2'])
  # 1. Dense SFT from the pretrained step, a checkpoint every 2 steps, all kept.
  _train(TINY + ['--gin_file=runs/llm_sft.gin', '--gin_file=data/offline_sft.gin'] + SMALL + [
      f"--gin.MODEL_DIR='{sft}'", '--gin.TRAIN_STEPS=6', '--gin.CHECKPOINT_PERIOD=2',
      f"--gin.INITIAL_CHECKPOINT_PATH='{dense}/checkpoints/2'", '--gin.LEARNING_RATE=1e-3',
      '--gin.WARMUP_STEPS=1'])
  steps = sorted(int(p.name) for p in (sft / 'checkpoints').iterdir() if p.name.isdigit())
  assert steps == [2, 4, 6]
  sources = [f'{sft}/checkpoints/{s}' for s in steps]
  # 2. UpIT: three intermediate checkpoints and one DARE merge around the pretrained model;
  #    the routers alone trained on whole samples (one per row).
  _train(TINY + MOE + ['--gin_file=runs/llm_upcycle.gin', '--gin_file=data/offline_sft.gin',
                       '--gin_file=upcycling/upit.gin', '--gin_file=runs/upit_router_stage.gin']
         + SMALL + [f"--gin.MODEL_DIR='{routers}'", '--gin.ROUTER_STAGE_STEPS=3',
                    f'--gin.INITIAL_CHECKPOINT_PATH={sources}',
                    f"--gin.DARE_BASE='{dense}/checkpoints/2'"])
  moe_params = tree.flatten(checkpoints.load(str(routers / 'checkpoints'), lazy=True).params)
  for source, index in zip(sources, range(3)):   # experts 0-2: the checkpoints' MLPs
    dense_params = tree.flatten(checkpoints.load(source, lazy=True).params)
    np.testing.assert_array_equal(
        np.asarray(moe_params['decoder/layers_1/mlp/expert/wi_0/kernel'])[index],
        np.asarray(dense_params['decoder/layers_1/mlp/wi_0/kernel']))
  train_rows = [r for r in _rows(routers) if r['split'] == 'train']
  assert [r['step'] for r in train_rows] == [1, 2, 3]
  assert all(0.0 <= r['accuracy'] <= 1.0 and np.isfinite(r['loss']) for r in train_rows)
  # 3. The MoE instruction-tuned from the router stage's last step.
  _train(TINY + MOE + ['--gin_file=runs/llm_sft.gin', '--gin_file=data/offline_sft.gin'] + SMALL
         + [f"--gin.MODEL_DIR='{moe}'", '--gin.TRAIN_STEPS=2',
            f"--gin.INITIAL_CHECKPOINT_PATH='{routers}/checkpoints'"])
  rows = _rows(moe)
  assert [r['step'] for r in rows if r['split'] == 'train'] == [1, 2]
  assert 'moe/decoder/layers_0/mlp/expert_usage' in next(r for r in rows if r['split'] == 'train')
