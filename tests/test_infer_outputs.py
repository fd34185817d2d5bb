"""Where `python -m upcycle.infer` writes, when several decodes share one MODEL_DIR: the method
is in the file's name, a second decode of the same output is refused in one line while the
first runs, and the file a run reports holds its own predictions, byte for byte a clean run's
(real processes, the first one stopped with SIGSTOP while its partial file is open, so the
runs overlap every time)."""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

import gin
import pytest

from tests.helpers import byte_t5_argv
from upcycle import infer as infer_main
from upcycle.decoding import DecodeConfig

BEAM = "--gin.decoding.DecodeConfig.method='beam'"


def _argv(checkpoint, model_dir, *flags):
  return byte_t5_argv('infer', checkpoint, f"--gin.MODEL_DIR='{model_dir}'",
                      '--gin.BATCH_SIZE=2', '--gin.INFER_BATCHES=3', *flags)


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
  target = os.path.join(inference, 'offline_span_corruption-0-greedy.jsonl')
  message = _errors(again_err)
  assert len(message) == 1 and message[0].startswith(
      f'error: Another decode is writing {target}: {target}.lock is locked by pid '
      f'{greedy.pid} on host '), message
  assert message[0].endswith('. Fix: wait for it to finish, or decode into another MODEL_DIR.')
  assert _written(greedy_out) == target
  assert _written(beam_out) == os.path.join(inference,
                                            'offline_span_corruption-0-beam4-alpha0.6.jsonl')
  for out, name in ((greedy_out, 'greedy'), (beam_out, 'beam')):
    with open(_written(out), 'rb') as mine, open(clean[name], 'rb') as reference:
      assert mine.read() == reference.read(), name
  assert sorted(os.listdir(inference)) == sorted(map(os.path.basename, clean.values()))


def test_a_killed_decodes_partial_file_is_removed_by_the_next(byte_vocab_t5, entry_points,
                                                              tmp_path):
  checkpoint, _ = byte_vocab_t5
  inference = tmp_path / 'inference'
  inference.mkdir()
  killed = inference / 'offline_span_corruption-0-greedy.jsonl.tmp-4242-0a1b2c3d'
  other = inference / 'offline_span_corruption-0-beam4-alpha0.6.jsonl.tmp-4243-0a1b2c3d'
  killed.write_text('{"partial": ')
  other.write_text('{"partial": ')
  path = _infer_here(_argv(checkpoint, tmp_path, '--gin.INFER_BATCHES=1'))
  assert sorted(os.listdir(inference)) == sorted([os.path.basename(path), other.name])


def test_the_output_name_holds_what_changes_the_predictions():
  name = lambda seed=0, **kwargs: infer_main.output_name('task', 20, DecodeConfig(**kwargs), seed)
  assert name() == 'task-20-greedy.jsonl'
  assert name(rescale_log_probs=True) == 'task-20-greedy-rescaled.jsonl'
  assert name(method='beam', num_beams=8, alpha=0.0) == 'task-20-beam8-alpha0.jsonl'
  assert name(method='sample') == 'task-20-sample-t1-seed0.jsonl'
  assert (name(3, method='sample', temperature=0.7, topk=40) ==
          'task-20-sample-t0.7-top40-seed3.jsonl')
  assert name(method='sample', topp=0.9) == 'task-20-sample-t1-topp0.9-seed0.jsonl'
  assert name(method='sample', topp=1.0) == 'task-20-sample-t1-seed0.jsonl'   # all tokens
