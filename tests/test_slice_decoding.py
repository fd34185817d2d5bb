"""`infer` and `eval` over a slice: 2 JAX processes (launch/local.py, each with its own CPU
devices, joined by jax.distributed as a TPU slice's workers are) write what 1 process writes:
the same JSONL rows in the same order, the same metrics."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, byte_t5_argv

ENV = {**os.environ, 'XLA_FLAGS': '--xla_backend_optimization_level=0', 'JAX_PLATFORMS': 'cpu'}


def _launch(module, processes, devices, flags):
  command = [sys.executable, os.path.join(REPO, 'launch', 'local.py'),
             f'--num_processes={processes}', f'--devices_per_process={devices}',
             f'--module={module}', '--'] + flags
  done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
def test_two_processes_decode_the_rows_one_process_decodes(byte_vocab_t5, tmp_path):
  """Parameters split over the model axis across the two processes (each holds half of
  every MLP and of the vocabulary), the batch over data: a real cross-process decode."""
  outputs = {}
  for processes, devices in ((1, 4), (2, 2)):
    model_dir = tmp_path / f'{processes}x{devices}'
    _launch('upcycle.infer', processes, devices, byte_t5_argv(
        'infer', byte_vocab_t5[0], f"--gin.MODEL_DIR='{model_dir}'", '--gin.BATCH_SIZE=4',
        '--gin.INFER_BATCHES=3', '--gin.NUM_MODEL_PARTITIONS=2'))
    inference = model_dir / 'inference'
    (name,) = os.listdir(inference)
    assert re.fullmatch(r'offline_span_corruption-0-greedy-[0-9a-f]{8}\.jsonl', name)
    outputs[processes] = (inference / name).read_text()
  rows = [json.loads(line) for line in outputs[1].splitlines()]
  assert len(rows) == 12 and len({r['inputs'] for r in rows}) == 12
  assert outputs[2] == outputs[1]


@pytest.mark.slow
def test_two_processes_evaluate_as_one_process(byte_vocab_t5, tmp_path):
  """The loss over the whole split (854 examples; each process reads its shard, as T5X's
  evaluator does) and the sequence accuracy of the first 3 batches' decodes."""
  results = {}
  for processes, devices in ((1, 2), (2, 1)):
    out = tmp_path / f'{processes}x{devices}'
    _launch('upcycle.eval', processes, devices, byte_t5_argv(
        'eval', byte_vocab_t5[0], f"--gin.EVAL_OUTPUT_DIR='{out}'", '--gin.BATCH_SIZE=64',
        '--gin.EVAL_DECODE_BATCHES=3'))
    results[processes] = json.loads((out / 'eval_results.json').read_text())
  one, two = results[1], results[2]
  assert one['decoded_examples'] == two['decoded_examples'] == 192
  assert two['sequence_accuracy'] == one['sequence_accuracy']
  assert two['loss'] == pytest.approx(one['loss'], rel=1e-5)
  assert two['accuracy'] == pytest.approx(one['accuracy'], rel=1e-6)
