"""A damaged step of a real training run: `describe --verify` names it, resume sets it aside.

One tiny T5 run saves steps 2 and 4; each test damages a copy of step 4 the way a bad copy
or a bad disk does (an item gone, a manifest that fails its CRC, flipped bytes inside array
data), then resumes in-process with the same trainer (its compiled step reused): the run must
fall back to step 2 and redo steps 3 and 4 exactly as the undamaged run did.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from tests.train.helpers import TRAINING_T5, text
from upcycle import console, describe
from upcycle.checkpoints import ocdbt_files, orbax_tree
from upcycle.models import T5
from upcycle.train.objectives import Seq2Seq
from upcycle.train.optimizers import Adafactor, rsqrt_schedule
from upcycle.train.trainer import TrainConfig, Trainer

EMBEDDING = 'token_embedder/embedding'


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """{'trainer', 'config', 'dir': MODEL_DIR, 'losses': {step: loss}} of 4 steps with
  checkpoints at steps 2 and 4."""
  model_dir = tmp_path_factory.mktemp('damaged') / 'run'
  config = TrainConfig(str(model_dir), train_steps=4, batch_size=8, log_every=1,
                       checkpoint_every=2, async_checkpoints=False, tensorboard=False)
  # Later runs of this trainer (other MODEL_DIRs, same shapes) reuse its compiled step.
  trainer = Trainer(Seq2Seq(T5(TRAINING_T5)), Adafactor(schedule=rsqrt_schedule(1.0, 100)),
                    config, text('train'), devices=jax.devices()[:1])
  result = trainer.run()
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4']
  return {'trainer': trainer, 'config': config, 'dir': model_dir,
          'losses': {h['step']: h['loss'] for h in result['history']}}


def _copy(run, tmp_path):
  copy = tmp_path / 'run'
  shutil.copytree(run['dir'], copy)
  return copy


def _resume(run, model_dir, **config):
  """The same trainer's run in `model_dir`, with these TrainConfig fields changed."""
  run['trainer'].config = dataclasses.replace(run['config'], model_dir=str(model_dir), **config)
  return run['trainer'].run()


def _params(step_dir):
  """{key path: array} of a step's stored parameters."""
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
      orbax_tree.read(os.path.join(step_dir, 'params')))}


def _arrays(step_dir):
  """How many parameter and optimizer-state arrays the step stores."""
  return sum(len(jax.tree.leaves(orbax_tree.read(os.path.join(step_dir, item))))
             for item in ('params', 'optimizer_state'))


def _verify(step_dir, capsys):
  """(exit status, last stderr line) of `describe --verify`."""
  status = describe.main([str(step_dir), '--verify'])
  return status, capsys.readouterr().err.strip().splitlines()[-1]


def _flip(path, offset, count):
  with open(path, 'r+b') as f:
    f.seek(offset)
    data = f.read(count)
    f.seek(offset)
    f.write(bytes(b ^ 0xFF for b in data))


def _assert_falls_back_to_step_2(run, model_dir, capsys, reason, **config):
  """Resumes `model_dir` (its step 4 damaged): step 4 is set aside with one warning naming
  `reason`, steps 3 and 4 are redone as the undamaged run did them, bit for bit."""
  console.show_progress()   # as the entry points do
  result = _resume(run, model_dir, **config)
  out = capsys.readouterr()
  warning, = [line for line in out.err.splitlines() if line.startswith('WARNING: Checkpoint')]
  moved, = os.listdir(model_dir / 'corrupt_checkpoints')
  assert moved.startswith('4-')
  assert warning.startswith(f'WARNING: Checkpoint step 4 is corrupt and was moved to '
                            f'{model_dir}/corrupt_checkpoints/{moved}. {model_dir}/checkpoints/4')
  assert reason in warning
  assert warning.endswith('Falling back to the previous checkpoint, step 2.')
  assert 'starts fresh' not in out.err
  assert f'Resuming from {model_dir}/checkpoints at step 2.' in out.out
  assert result['start_step'] == 2
  assert {h['step']: h['loss'] for h in result['history']} == {
      3: run['losses'][3], 4: run['losses'][4]}
  redone = _params(model_dir / 'checkpoints' / '4')
  saved = _params(run['dir'] / 'checkpoints' / '4')
  assert redone.keys() == saved.keys()
  for path in saved:
    np.testing.assert_array_equal(redone[path], saved[path], err_msg=path)
  return model_dir / 'corrupt_checkpoints' / moved


@pytest.mark.slow
@pytest.mark.parametrize('item, config', [
    ('optimizer_state', {'on_optimizer_mismatch': 'fresh'}),   # not a mismatch: damage
    ('dataset', {}),
    ('params', {}),
])
def test_a_step_missing_an_item_is_set_aside(run, tmp_path, capsys, item, config):
  model_dir = _copy(run, tmp_path)
  shutil.rmtree(model_dir / 'checkpoints' / '4' / item)
  if item != 'params':   # without params/ it is no step: describe says so
    assert _verify(model_dir / 'checkpoints' / '4', capsys) == (1, (
        f'error: {model_dir}/checkpoints/4: damaged: {item}/ is missing, saved with the step. '
        f'The checkpoint copy is incomplete; copy the step again from its source.'))
  moved = _assert_falls_back_to_step_2(
      run, model_dir, capsys, f'no {item}/ (every step the trainer saves has it)', **config)
  assert not (moved / item).exists()


@pytest.mark.slow
def test_a_manifest_that_fails_its_crc_is_set_aside(run, tmp_path, capsys):
  model_dir = _copy(run, tmp_path)
  _flip(model_dir / 'checkpoints' / '4' / 'params' / 'manifest.ocdbt', 60, 8)
  _assert_falls_back_to_step_2(
      run, model_dir, capsys, f'{model_dir}/checkpoints/4/params: the OCDBT index is unreadable '
      f'(DATA_LOSS: Error decoding local file "{model_dir}/checkpoints/4/params/manifest.ocdbt": '
      f'Error decoding manifest: CRC-32C checksum verification failed')


@pytest.mark.slow
def test_flipped_bytes_in_array_data_are_found_and_set_aside(run, tmp_path, capsys):
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  assert _verify(step_dir, capsys) == (0, (
      f'verified: all {_arrays(step_dir)} arrays read back complete and match the digests '
      f'recorded when the step was saved.'))
  ref = max(ocdbt_files.value_refs(str(step_dir / 'params'), EMBEDDING.replace('/', '.')),
            key=lambda ref: ref.length)   # its data, not its .zarray
  _flip(ref.path, ref.offset + ref.length // 2, 16)
  status, line = _verify(step_dir, capsys)
  assert status == 1
  assert line.startswith(f"error: {step_dir}/params: parameter '{EMBEDDING}' (shard 0:384,0:32): "
                         f'its bytes differ from the digest recorded when the step was saved')
  key = "['token_embedder']['embedding']"   # it still reads, with other values
  assert (_params(step_dir)[key] != _params(run['dir'] / 'checkpoints' / '4')[key]).any()
  moved = _assert_falls_back_to_step_2(
      run, model_dir, capsys, f"/params: parameter '{EMBEDDING}' (shard 0:384,0:32): its bytes "
      f'differ from the digest recorded when the step was saved')
  assert _verify(moved, capsys)[0] == 1


@pytest.mark.slow
def test_a_step_saved_before_digests_restores_and_says_so(run, tmp_path, capsys):
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  shutil.rmtree(step_dir / 'digests')
  marker = step_dir / '_CHECKPOINT_METADATA'
  metadata = json.loads(marker.read_text())
  del metadata['item_handlers']['digests']
  marker.write_text(json.dumps(metadata))
  assert _verify(step_dir, capsys) == (0, (
      f'verified: all {_arrays(step_dir)} arrays read back complete. This step carries no '
      f'digests (saved before they were recorded): changed bytes that still decode are not '
      f'found.'))
  result = _resume(run, model_dir)
  assert result['start_step'] == 4 and not (model_dir / 'corrupt_checkpoints').exists()
  saved = _params(run['dir'] / 'checkpoints' / '4')
  for path, leaf in jax.tree_util.tree_leaves_with_path(result['state'].params):
    np.testing.assert_array_equal(np.asarray(leaf), saved[jax.tree_util.keystr(path)])
