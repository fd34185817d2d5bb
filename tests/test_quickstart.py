"""`python -m upcycle.quickstart` (the README's main job) end to end, at a few steps.

CI does not run the full main job (about 12 minutes here); this runs the same three
`python -m upcycle.train` stages with the same gin files at a handful of steps and checks what
a user gets: the table and the corpus line under it, curves.png and summary.json, and each
stage's run directory.
"""

import json
import os
import subprocess
import sys

import pytest

from upcycle.data import offline_text


@pytest.mark.slow
def test_the_main_job_runs_its_three_stages_and_writes_its_table_and_plot(tmp_path):
  out = tmp_path / 'quickstart'
  command = [sys.executable, '-m', 'upcycle.quickstart', f'--output_dir={out}',
             '--pretrain_steps=4', '--pretrain_batch_size=8', '--extra_steps=2',
             '--extra_steps_batch_size=32',
             '--num_experts=4', '--eval_sequences=64']
  env = {**os.environ, 'XLA_FLAGS': '--xla_backend_optimization_level=0',
         'TF_CPP_MIN_LOG_LEVEL': '3'}
  done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  for stage in ('1/3 pretrain dense', '2/3 continue dense', '3/3 upcycle and train MoE'):
    assert f'=== {stage}: ' in done.stdout
  # Under the table: the corpus the runs read, the pinned one (this machine installs the pins).
  assert (f'corpus: packages, sha256 {offline_text.PACKAGES_DIGEST} (the pinned one): the '
          "README's") in done.stdout.splitlines()
  summary = json.loads((out / 'summary.json').read_text())
  assert list(summary) == ['validation loss ± s.e. at step 4 (start)',
                           'validation loss ± s.e. at step 6', 'validation accuracy at step 6',
                           'train loss, last logged step']
  assert (out / 'curves.png').stat().st_size > 10_000
  moe = [json.loads(line) for line in open(out / 'moe' / 'metrics.jsonl')]
  dense = [json.loads(line) for line in open(out / 'dense_continued' / 'metrics.jsonl')]
  # Both continuations start from the dense step-4 checkpoint, run to step 6 with their batch,
  # and the MoE's 4 experts are in its checkpoint.
  # --eval_sequences=64: every evaluation reads 2 batches of 32 (8 of 8 in the pretraining).
  pretrain = [json.loads(line) for line in open(out / 'dense' / 'metrics.jsonl')]
  assert {r['batches'] for r in pretrain if r['split'] == 'eval'} == {8}
  for rows in (moe, dense):
    assert [r['step'] for r in rows if r['split'] == 'eval'] == [4, 6]
    assert {r['batches'] for r in rows if r['split'] == 'eval'} == {2}
  assert any(k.startswith('moe/encoder/layers_1/mlp/')
             for k in [r for r in moe if r['split'] == 'train'][-1])
  train = [r for r in dense if r['split'] == 'train']
  assert train[-1]['tokens_per_sec'] > 0 and train[-1]['step'] == 6
  config = (out / 'moe' / 'config.gin').read_text()
  assert 'BATCH_SIZE = 32' in config and 'NUM_EXPERTS = 4' in config
  assert 'BATCH_SIZE = 8' in (out / 'dense' / 'config.gin').read_text()
  # The continuations read on from the pretraining's 4 x 8 sequences: 1 batch of 32.
  position = "Reading the data on from the initial checkpoint's position: epoch 0, batch 1 of 32 "
  assert (done.stdout + done.stderr).count(position) == 2, done.stderr[-3000:]
