"""launch/local.py: 2 processes x 4 CPU devices train, upcycle and resume as 1 process x 8."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from upcycle.checkpoints import digests

ENV = {**os.environ, 'XLA_FLAGS': '--xla_backend_optimization_level=0', 'JAX_PLATFORMS': 'cpu'}
# Run files first: data/offline_span_corruption.gin overrides their task.
DATA = '--gin_file=data/offline_span_corruption.gin'
COMMON = ['--gin_file=models/t5_1_1/tiny.gin', '--gin.BATCH_SIZE=8',
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
          '--gin.models.T5Config.num_encoder_layers=2',
          '--gin.models.T5Config.num_decoder_layers=2', '--gin.__main__.train.eval_data=None',
          '--gin.trainer.TrainConfig.log_every=1', '--gin.trainer.TrainConfig.tensorboard=False']


def _upcycle_flags(model_dir, dense_dir):
  return COMMON + [
      '--gin_file=moe/experts_choose.gin', '--gin_file=moe/decoder_top2.gin',
      '--gin_file=runs/upcycle.gin', DATA, '--gin.NUM_EXPERTS=4',
      f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=10',
      f"--gin.INITIAL_CHECKPOINT_PATH='{dense_dir}/checkpoints'",
      '--gin.trainer.TrainConfig.checkpoint_every=5', '--gin.trainer.TrainConfig.data_shards=2',
      '--gin.trainer.TrainConfig.num_expert_partitions=2',
      '--gin.trainer.TrainConfig.num_model_partitions=2']


def _launch(flags, processes, devices):
  return [sys.executable, os.path.join(REPO, 'launch', 'local.py'),
          f'--num_processes={processes}', f'--devices_per_process={devices}',
          '--grace_seconds=5', '--'] + flags


def _losses(model_dir):
  rows = [json.loads(line) for line in open(os.path.join(model_dir, 'metrics.jsonl'))]
  return [(r['step'], r['loss']) for r in rows if r['split'] == 'train']


def _run(command):
  done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done


@pytest.fixture(scope='module')
def dense(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp('dense')
  _run(_launch(COMMON + ['--gin_file=runs/pretrain.gin', DATA, f"--gin.MODEL_DIR='{model_dir}'",
                         '--gin.TRAIN_STEPS=2'], 1, 1))
  return model_dir


@pytest.mark.slow
def test_two_processes_upcycle_train_and_resume_as_one_process(tmp_path, dense):
  single = tmp_path / 'single'
  _run(_launch(_upcycle_flags(single, dense), 1, 8))
  multi = tmp_path / 'multi'
  launcher = subprocess.Popen(_launch(_upcycle_flags(multi, dense), 2, 4), cwd=REPO, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  pids = {}
  for line in launcher.stderr:
    m = re.match(r'launch/local.py: process (\d) is pid (\d+)', line)
    if m:
      pids[int(m.group(1))] = int(m.group(2))
    if len(pids) == 2:
      break
  deadline = time.time() + 300
  while time.time() < deadline and launcher.poll() is None:
    if os.path.exists(multi / 'metrics.jsonl') and max(
        [s for s, _ in _losses(multi)], default=0) >= 7:
      os.kill(pids[1], signal.SIGKILL)   # process 1 dies after the step-5 checkpoint
      killed_at = time.time()
      break
    time.sleep(0.05)
  rest = launcher.stderr.read()
  launcher.wait(timeout=60)
  # Process 0 fails too when its collective loses the peer; the launcher names the first.
  assert 'launch/local.py: process 1 was killed by SIGKILL; stopping the other' in rest, (
      rest[-2000:])
  assert 'process 0 exited' not in rest
  assert launcher.returncode == 128 + signal.SIGKILL
  assert time.time() - killed_at < 30       # process 0 did not wait in a collective forever
  assert max(s for s, _ in _losses(multi)) < 10
  saved = json.load(open(multi / 'checkpoints' / '5' / 'dataset' / 'metadata'))
  assert sorted(saved['shards']) == ['0', '1'] and {
      s['shard_index'] for s in saved['shards'].values()} == {0, 1}
  # Each process recorded the digests of the shards it holds: together, all 4 blocks of an
  # expert kernel split over expert x model = 2 x 2.
  step_dir = str(multi / 'checkpoints' / '5')
  assert {'process_0.json', 'process_1.json'} <= set(os.listdir(os.path.join(step_dir,
                                                                              'digests')))
  kernel = digests.read(step_dir)['params']['encoder/layers_1/mlp/expert/wi_0/kernel']
  assert len(kernel['shards']) == 4
  _run(_launch(_upcycle_flags(multi, dense), 2, 4))
  expected, resumed = _losses(single), _losses(multi)
  assert [s for s, _ in resumed] == list(range(3, 11)) == [s for s, _ in expected]
  for (step, a), (_, b) in zip(expected, resumed):
    assert b == pytest.approx(a, rel=1e-5), step
