"""`python -m upcycle.describe`: what it prints of a checkpoint, and its --verify."""

import json
import os
import shutil
import threading

import numpy as np
import pytest

from tests.checkpoints import helpers, t5x_writer
from upcycle import describe, tree
from upcycle.checkpoints import verify
from upcycle.checkpoints.orbax import CheckpointManager


def test_json_summary_of_a_t5x_checkpoint(tmp_path, capsys):
  params = helpers.random_params(helpers.CHECKPOINT_T5)
  t5x_writer.write(str(tmp_path), 6, params, t5x_writer.adafactor_states(params))
  assert describe.main([str(tmp_path), '--json']) == 0
  info = json.loads(capsys.readouterr().out)
  assert info['format'] == 't5x' and info['step'] == 6 and info['optimizer_state']
  assert info['num_parameters'] == sum(p.size for p in tree.flatten(params).values())
  assert info['num_bytes'] == 4 * info['num_parameters']
  assert {'path': 'token_embedder/embedding', 'shape': [32, 8], 'dtype': 'float32'} in info[
      'params']
  assert info['model'] == ('T5 v1.1: 2+2 layers, d_model 8, 2 heads (d_kv 4), d_ff 12, '
                           'vocab 32, dense')


def test_text_output_and_errors(tmp_path, capsys):
  assert describe.main([helpers.T5X_FIXTURE]) == 0
  out = capsys.readouterr().out
  assert 'format:          t5x' in out and 'step:            1' in out
  assert 'optimizer state: yes' in out
  assert describe.main([str(tmp_path)]) == 1
  assert 'unknown checkpoint format' in capsys.readouterr().err


def _orbax_step(directory, step):
  """directory/<step>/ written by the trainer's CheckpointManager: 2 parameter arrays, 2
  optimizer arrays."""
  params = {'a': {'w': np.ones((64, 64), np.float32)}, 'b': np.zeros((8,), np.float32)}
  manager = CheckpointManager(directory, async_save=False)
  manager.save(step, params, {'m': params})
  manager.close()
  return directory / str(step)


def test_a_step_set_aside_by_resume_is_inspected_as_any_step(tmp_path, capsys):
  set_aside = tmp_path / 'corrupt_checkpoints' / '4-20261201-120000'
  os.makedirs(set_aside.parent)
  os.rename(_orbax_step(tmp_path / 'checkpoints', 4), set_aside)
  assert describe.main([str(set_aside), '--verify']) == 0
  captured = capsys.readouterr()
  assert f'path:            {set_aside}\nformat:          orbax\nstep:            4\n' in (
      captured.out)
  assert ('verified: all 4 arrays read back complete and match the digests recorded when the '
          'step was saved.') in captured.err
  assert 'verify: 4/4 arrays (100%)' in captured.err   # progress, off the report's stdout


@pytest.mark.parametrize('deleting', ['deleted', 'being deleted'])
def test_a_step_deleted_by_retention_while_verified_is_not_damage(tmp_path, capsys,
                                                                   monkeypatch, deleting):
  step_dir = _orbax_step(tmp_path / 'checkpoints', 2)
  read = verify.verify
  finish = threading.Timer(0.3, shutil.rmtree, args=(step_dir,))

  def retention_deletes_the_step(ckpt, recorded):
    files = sorted(p for p in step_dir.rglob('*') if p.is_file())
    for f in files[:len(files) // 2]:
      f.unlink()
    finish.start()
    if deleting == 'deleted':
      finish.join()
    return read(ckpt, recorded)

  monkeypatch.setattr(verify, 'verify', retention_deletes_the_step)
  capsys.readouterr()   # the save's own line ('Saved step 2 ...') is not describe's
  assert describe.main([str(step_dir), '--verify']) == 0
  assert capsys.readouterr().err == (
      f'note: {step_dir} was deleted by retention while being read (a running trainer keeps '
      f'its last TrainConfig.keep_checkpoints steps); that is not damage. Inspect a newer '
      f'step.\n')
  finish.join()
