"""docs/pods.md's commands in sequence, with their gin files and flags, at tiny scale on the 8
simulated CPU devices: a dense T5 pretrained with SCAN_LAYERS=True (the pod default), upcycled
into the scanned MoE of `moe/paper_t5.gin` over 2 expert partitions and trained on, evaluated,
decoded, and exported to T5X's layout with its Adafactor state, which the independent T5X
reader finds whole (tests/checkpoints/t5x_reader.py, T5X's `Checkpointer.restore` rules)."""

import json

import gin
import numpy as np
import pytest

from tests.checkpoints import t5x_reader
from upcycle import checkpoints, export, gin_utils, tree
from upcycle import eval as eval_main
from upcycle import infer as infer_main
from upcycle.train import __main__ as train_main

TINY = ['--gin_file=models/t5_1_1/tiny.gin', '--gin.SCAN_LAYERS=True']
DATA = ['--gin_file=data/offline_span_corruption.gin',
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}", '--gin.BATCH_SIZE=8']
MOE = ['--gin_file=moe/paper_t5.gin', '--gin.NUM_EXPERTS=4']


def _command(entry, argv):
  """One command of the sequence, as its own process would run it: gin starts empty."""
  gin.clear_config(clear_constants=True)
  return gin_utils.run(entry, argv, 'test')


@pytest.mark.slow
def test_the_pod_commands_run_in_sequence_from_a_scanned_dense_run(tmp_path, entry_points):
  dense, moe, t5x = tmp_path / 'dense', tmp_path / 'moe', tmp_path / 't5x'
  _command(train_main.train, TINY + ['--gin_file=runs/pretrain.gin'] + DATA + [
      f"--gin.MODEL_DIR='{dense}'", '--gin.TRAIN_STEPS=2', '--gin.EVAL_STEPS=1'])
  assert 'subblock_0' in checkpoints.load(str(dense / 'checkpoints'), lazy=True).params[
      'encoder']['layers']   # a scanned dense run: one sub-block per period
  # docs/pods.md step 3, the upcycling run (its INITIAL_CHECKPOINT_PATH: the dense run).
  _command(train_main.train, TINY + MOE + ['--gin_file=runs/upcycle.gin'] + DATA + [
      f"--gin.MODEL_DIR='{moe}'", '--gin.TRAIN_STEPS=4', '--gin.EVAL_STEPS=1',
      f"--gin.INITIAL_CHECKPOINT_PATH='{dense}/checkpoints'",
      '--gin.trainer.TrainConfig.num_expert_partitions=2'])
  rows = [json.loads(line) for line in open(moe / 'metrics.jsonl')]
  assert [r['step'] for r in rows if r['split'] == 'train'] == [3, 4]   # the dense step goes on
  last_train = [r for r in rows if r['split'] == 'train'][-1]
  assert 'moe/encoder/layers_1/mlp/expert_usage' in last_train
  # Step 6: evaluate and decode the MoE with every worker's flags.
  results = _command(eval_main.evaluate, TINY + MOE + ['--gin_file=runs/eval.gin'] + DATA + [
      f"--gin.CHECKPOINT_PATH='{moe}/checkpoints'", f"--gin.EVAL_OUTPUT_DIR='{moe}/eval'",
      '--gin.NUM_EXPERT_PARTITIONS=2', '--gin.EVAL_BATCHES=1', '--gin.EVAL_DECODE_BATCHES=1'])
  assert results['step'] == 4 and np.isfinite(results['loss'])
  assert results['decoded_examples'] == 8
  path = _command(infer_main.infer, TINY + MOE + ['--gin_file=runs/infer.gin'] + DATA + [
      f"--gin.CHECKPOINT_PATH='{moe}/checkpoints'", f"--gin.MODEL_DIR='{moe}'",
      '--gin.NUM_EXPERT_PARTITIONS=2', '--gin.INFER_BATCHES=1'])
  assert len(open(path).read().splitlines()) == 8
  # Export to T5X: unrolled layers, each parameter with all four T5X Adafactor slots.
  export.main(['--model_dir', str(moe), '--output_dir', str(t5x)])
  _, state = t5x_reader.read(str(t5x / 'checkpoint_4'))
  params = t5x_reader.by_path(state['target'])
  slots = t5x_reader.by_path(state['state']['param_states'])
  assert 'encoder/layers_3/mlp/expert/wi_0/kernel' in params
  assert set(slots) == {f'{p}/{s}' for p in params for s in ('v_row', 'v_col', 'v', 'm')}
  run = tree.flatten(checkpoints.load(str(moe / 'checkpoints'), lazy=True).params)
  np.testing.assert_array_equal(
      params['decoder/layers_3/mlp/expert/wo/kernel'],
      np.asarray(run['decoder/layers/subblock_1/mlp/expert/wo/kernel'])[1])
