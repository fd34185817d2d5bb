"""Where `python -m upcycle.infer` writes, when several decodes share one MODEL_DIR: the method
is in the file's name, a second decode of the same output is refused in one line while the
first runs, and the file a run reports holds its own predictions, byte for byte a clean run's
(real processes, the first one stopped with SIGSTOP while its partial file is open, so the
runs overlap every time)."""

import ast
import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import gin
import numpy as np
import pytest

from tests.helpers import BYTE_T5_LENGTHS, byte_t5_argv, with_flags
from upcycle import infer as infer_main
from upcycle.decoding import DecodeConfig

BEAM = "--gin.decoding.DecodeConfig.method='beam'"


def _argv(checkpoint, model_dir, *flags):
  return byte_t5_argv('infer', checkpoint, *with_flags([
      f"--gin.MODEL_DIR='{model_dir}'", '--gin.BATCH_SIZE=2', '--gin.INFER_BATCHES=3'], *flags))


def _infer_here(argv):
  """`python -m upcycle.infer argv` in this process; returns the path written."""
  try:
    return infer_main.main(argv)
  finally:
    gin.clear_config(clear_constants=True)


def _infer(argv):
  return subprocess.Popen([sys.executable, '-m', 'upcycle.infer', *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _errors(stderr):
  """stderr without the native libraries' start-up lines."""
  return [line for line in stderr.splitlines()
          if line.strip() and not line.startswith(('WARNING', 'I0000', 'W0000', 'E0000'))]


def _written(stdout):
  """The path of the 'Wrote N predictions ... to PATH' line."""
  return next(line for line in stdout.splitlines() if line.startswith('Wrote ')).split(' to ')[-1]


@contextlib.contextmanager
def _stopped_while_writing(argv, inference):
  """An infer process, stopped once its partial file exists and resumed when the block ends;
  yields the process."""
  process = _infer(argv)
  try:
    while not glob.glob(os.path.join(inference, '*.tmp-*')):
      assert process.poll() is None, process.communicate()
      time.sleep(0.01)
    process.send_signal(signal.SIGSTOP)
    yield process
  finally:
    process.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_concurrent_decodes_of_one_output_are_refused_and_of_two_methods_both_written(
    byte_vocab_t5, entry_points, tmp_path):
  checkpoint, _ = byte_vocab_t5
  clean = {name: _infer_here(_argv(checkpoint, tmp_path / name, *flags))
           for name, flags in (('greedy', ()), ('beam', (BEAM,)))}
  model_dir = tmp_path / 'shared'
  inference = str(model_dir / 'inference')
  with _stopped_while_writing(_argv(checkpoint, model_dir), inference) as greedy:
    again, beam = _infer(_argv(checkpoint, model_dir)), _infer(_argv(checkpoint, model_dir, BEAM))
    (again_out, again_err), (beam_out, beam_err) = (p.communicate(timeout=300)
                                                    for p in (again, beam))
  greedy_out, greedy_err = greedy.communicate(timeout=300)
  assert greedy.returncode == 0, greedy_err
  assert beam.returncode == 0, beam_err
  assert again.returncode == 1 and again_out == ''
  target = clean['greedy'].replace(str(tmp_path / 'greedy'), str(model_dir))
  message = _errors(again_err)
  assert len(message) == 1 and message[0].startswith(
      f'error: Another decode is writing {target}: {target}.lock is locked by pid '
      f'{greedy.pid} on host '), message
  assert message[0].endswith('. Fix: wait for it to finish, or decode into another MODEL_DIR.')
  assert _written(greedy_out) == target
  assert _written(beam_out) == clean['beam'].replace(str(tmp_path / 'beam'), str(model_dir))
  assert re.fullmatch(r'offline_span_corruption-0-beam4-alpha0\.6-[0-9a-f]{8}\.jsonl',
                      os.path.basename(_written(beam_out)))
  for out, name in ((greedy_out, 'greedy'), (beam_out, 'beam')):
    with open(_written(out), 'rb') as mine, open(clean[name], 'rb') as reference:
      assert mine.read() == reference.read(), name
  assert sorted(os.listdir(inference)) == sorted(map(os.path.basename, clean.values()))


def test_a_killed_decodes_partial_file_is_removed_by_the_next(byte_vocab_t5, entry_points,
                                                              tmp_path):
  """The decode's name is the one its data and checkpoint give (`decode_identity`)."""
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.data.text import TextPipeline  # pylint: disable=g-import-not-at-top
  checkpoint, _ = byte_vocab_t5
  pipeline = TextPipeline('offline_span_corruption', 'validation',
                          ast.literal_eval(BYTE_T5_LENGTHS), pack=False, shuffle=False)
  name = infer_main.output_name('offline_span_corruption', 0, DecodeConfig(), 0,
                                infer_main.decode_identity(
                                    pipeline, pretrained.load(checkpoint, lazy=True),
                                    max_decode_length=8, max_batches=1, seed=0))
  inference = tmp_path / 'inference'
  inference.mkdir()
  killed = inference / f'{name}.tmp-4242-0a1b2c3d'
  other = inference / 'offline_span_corruption-0-beam4-alpha0.6-0a1b2c3d.jsonl.tmp-4243-0a1b2c3d'
  killed.write_text('{"partial": ')
  other.write_text('{"partial": ')
  path = _infer_here(_argv(checkpoint, tmp_path, '--gin.INFER_BATCHES=1'))
  assert path == str(inference / name)
  assert sorted(os.listdir(inference)) == sorted([name, other.name])


def test_the_output_name_holds_what_changes_the_predictions():
  identity = {'data': {'task': 'task'}, 'seed': 0}
  digest = hashlib.sha256(b'{"data": {"task": "task"}, "seed": 0}').hexdigest()[:8]
  name = lambda seed=0, **kwargs: infer_main.output_name('task', 20, DecodeConfig(**kwargs), seed,
                                                         identity)[:-len(f'-{digest}.jsonl')]
  assert infer_main.output_name('task', 20, DecodeConfig(), 0, identity) == (
      f'task-20-greedy-{digest}.jsonl')
  assert name() == 'task-20-greedy'
  assert name(rescale_log_probs=True) == 'task-20-greedy-rescaled'
  assert name(method='beam', num_beams=8, alpha=0.0) == 'task-20-beam8-alpha0'
  assert name(method='sample') == 'task-20-sample-t1-seed0'
  assert (name(3, method='sample', temperature=0.7, topk=40) ==
          'task-20-sample-t0.7-top40-seed3')
  assert name(method='sample', topp=0.9) == 'task-20-sample-t1-topp0.9-seed0'
  assert name(method='sample', topp=1.0) == 'task-20-sample-t1-seed0'   # all tokens
  t5x = lambda mode, **kwargs: infer_main.output_name('task', 20, DecodeConfig(**kwargs), 0,
                                                     identity, t5x_mode=mode)
  assert t5x('predict') == f'task-20-greedy-t5x_predict-{digest}.jsonl'
  assert t5x('predict_with_aux', method='beam') == (
      f'task-20-beam4-alpha0.6-t5x_predict_with_aux-{digest}.jsonl')
  assert t5x('score', method='beam') == f'task-20-t5x_score-{digest}.jsonl'   # nothing decoded


def _names(pairs, max_decode_length=8, max_batches=0):
  """The output name of a greedy decode of each (prompts file, checkpoint directory) pair."""
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data.prompts import Prompts  # pylint: disable=g-import-not-at-top
  names = []
  for prompts_file, checkpoint in pairs:
    prompts = Prompts('offline_stdlib_text', 'validation', {'targets': 16},
                      tokenizer.OFFLINE_BPE, prompts_file=str(prompts_file))
    ckpt = pretrained.load(str(checkpoint), lazy=True)
    names.append(infer_main.output_name(prompts.name, ckpt.step or 0, DecodeConfig(), 0,
                                        infer_main.decode_identity(
                                            prompts, ckpt, max_decode_length=max_decode_length,
                                            max_batches=max_batches, seed=0)))
  return names


def test_decodes_of_other_prompts_or_checkpoints_are_named_apart(byte_vocab_t5, tmp_path):
  """Two prompts files of one name with other prompts, two HF directories (both 'step 0'),
  and a training step rewritten in place (its recorded digests change) name other files;
  copies of one prompts file name the same one."""
  from upcycle.checkpoints.orbax import CheckpointManager  # pylint: disable=g-import-not-at-top
  for folder, prompt in (('a', 'def f():'), ('b', 'import os'), ('copy', 'def f():')):
    os.makedirs(tmp_path / folder)
    (tmp_path / folder / 'prompts.jsonl').write_text(json.dumps({'prompt': prompt}) + '\n')
  hf_dir, _ = byte_vocab_t5
  copy = tmp_path / 'hf_copy'
  shutil.copytree(hf_dir, copy)
  a, b, same, other_dir = _names([(tmp_path / 'a' / 'prompts.jsonl', hf_dir),
                                  (tmp_path / 'b' / 'prompts.jsonl', hf_dir),
                                  (tmp_path / 'copy' / 'prompts.jsonl', hf_dir),
                                  (tmp_path / 'a' / 'prompts.jsonl', copy)])
  assert a.startswith('prompts-0-greedy-') and same == a
  assert len({a, b, other_dir}) == 3
  assert _names([(tmp_path / 'a' / 'prompts.jsonl', hf_dir)], max_batches=1) != [a]

  steps = tmp_path / 'run' / 'checkpoints'
  step_names = []
  for value in (1.0, 2.0):
    manager = CheckpointManager(str(steps), async_save=False)
    manager.save(4, {'w': np.full((2, 2), value, np.float32)}, None)
    manager.close()
    step_names += _names([(tmp_path / 'a' / 'prompts.jsonl', steps / '4')])
    shutil.rmtree(steps / '4')
  assert step_names[0].startswith('prompts-4-greedy-') and step_names[0] != step_names[1]
