"""A damaged step of a real training run: `describe --verify` names it, resume sets it aside,
every other reader refuses it.

One tiny T5 run saves steps 2 and 4; each test damages a copy of step 4 the way a bad copy
or a bad disk does (an item gone, a manifest that fails its CRC, flipped bytes inside array
data or in the data position), then resumes in-process with the same trainer (its compiled
step reused): the run must fall back to step 2 and redo steps 3 and 4 exactly as the
undamaged run did. Eval, infer, export, convert and the restore hook refuse changed bytes in
one line unless told not to verify; what export and convert then write carries the digests of
what they wrote.
"""

import dataclasses
import functools
import json
import os
import shutil
import zlib

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from tests.train.helpers import TEXT_LENGTHS, TRAINING_T5, text
from upcycle import console, convert, describe, hf_export
from upcycle import eval as eval_script
from upcycle import infer as infer_script, partitioning
from upcycle.checkpoints import CheckpointError, ocdbt_files, orbax_tree, t5x_export, zarr_leaf
from upcycle.data.text import TextPipeline
from upcycle.decoding import DecodeConfig
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers
from upcycle.train.objectives import Seq2Seq
from upcycle.train.optimizers import Adafactor, rsqrt_schedule
from upcycle.restore import Restore
from upcycle.train.trainer import TrainConfig, Trainer
from upcycle.upcycling import modes

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


def _embedding_as_orbax_reads_it(step_dir):
  return ocp.PyTreeCheckpointer().restore(step_dir / 'params')['token_embedder']['embedding']


def _flip_embedding(step_dir):
  """Flips 16 bytes of the stored embedding's (compressed) data, not its .zarray, so that it
  still decodes and orbax reads NaN in it: the first of 64 windows from the middle on that
  does. Which one does depends on the saved bytes, so on the host's arithmetic."""
  ref = max(ocdbt_files.value_refs(str(step_dir / 'params'), EMBEDDING.replace('/', '.')),
            key=lambda ref: ref.length)   # its data, not its .zarray
  for window in range(64):
    offset = ref.offset + ref.length // 2 + 16 * window
    _flip(ref.path, offset, 16)
    try:
      if np.isnan(_embedding_as_orbax_reads_it(step_dir)).any():
        return
    except Exception:  # pylint: disable=broad-except  (no longer decodes: try the next)
      pass
    _flip(ref.path, offset, 16)   # as it was
  raise AssertionError(f'no 16-byte window of {ref.path} from the middle on reads as NaN')


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
  _flip_embedding(step_dir)
  status, line = _verify(step_dir, capsys)
  assert status == 1
  assert line.startswith(f"error: {step_dir}/params: parameter '{EMBEDDING}' (shard 0:384,0:32): "
                         f'its bytes differ from the digest recorded when the step was saved')
  assert line.endswith('the data changed on disk. Fix: copy the checkpoint again from its source.')
  key = "['token_embedder']['embedding']"   # it still reads, with other values
  assert (_params(step_dir)[key] != _params(run['dir'] / 'checkpoints' / '4')[key]).any()
  moved = _assert_falls_back_to_step_2(
      run, model_dir, capsys, f"/params: parameter '{EMBEDDING}' (shard 0:384,0:32): its bytes "
      f'differ from the digest recorded when the step was saved')
  assert _verify(moved, capsys)[0] == 1


def _drop_digests(step_dir):
  """Makes the step one saved before digests were recorded."""
  shutil.rmtree(step_dir / 'digests')
  marker = step_dir / '_CHECKPOINT_METADATA'
  metadata = json.loads(marker.read_text())
  del metadata['item_handlers']['digests']
  marker.write_text(json.dumps(metadata))


@pytest.mark.slow
def test_a_step_without_digests_holding_nan_is_set_aside_naming_the_parameter(run, tmp_path,
                                                                             capsys):
  """0xFF bytes read as NaN: without digests, resume finds them in the restored parameters
  (not the NaN stop of training, which would blame the learning rate)."""
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  _drop_digests(step_dir)
  _flip_embedding(step_dir)
  assert np.isnan(_embedding_as_orbax_reads_it(step_dir)).any()   # orbax's own reading
  _assert_falls_back_to_step_2(
      run, model_dir, capsys, f"/checkpoints/4/params: parameter '{EMBEDDING}' holds NaN or "
      f'infinite values, which a run never saves (it stops first); the data changed on disk')


@pytest.mark.slow
def test_a_step_saved_before_digests_restores_and_says_so(run, tmp_path, capsys):
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  _drop_digests(step_dir)
  assert _verify(step_dir, capsys) == (0, (
      f'verified: all {_arrays(step_dir)} arrays read back complete. This step carries no '
      f'digests (saved before they were recorded): changed bytes that still decode are not '
      f'found.'))
  result = _resume(run, model_dir)
  assert result['start_step'] == 4 and not (model_dir / 'corrupt_checkpoints').exists()
  saved = _params(run['dir'] / 'checkpoints' / '4')
  for path, leaf in jax.tree_util.tree_leaves_with_path(result['state'].params):
    np.testing.assert_array_equal(np.asarray(leaf), saved[jax.tree_util.keystr(path)])


MOE_T5 = dataclasses.replace(TRAINING_T5, encoder_moe=MoeConfig(num_experts=4),
                             decoder_moe=MoeConfig(num_experts=4, router=routers.TopK()))


def _refused(call, changed, skip='--no_verify'):
  """`call()` raises the one-line refusal of changed bytes: `changed`, the fix and `skip`."""
  with pytest.raises(CheckpointError) as raised:
    call()
  message = str(raised.value)
  assert message.startswith(changed) and '\n' not in message
  assert message.endswith(f'the data changed on disk. Fix: copy the checkpoint again from its '
                          f'source, or pass {skip} to read it as it is.')


def _eval_argv(step_dir):
  """`python -m upcycle.eval`'s flags for a step of the fixture's run: one batch, no decoding."""
  return ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/eval.gin',
          '--gin_file=data/offline_span_corruption.gin', f"--gin.CHECKPOINT_PATH='{step_dir}'",
          f'--gin.TASK_FEATURE_LENGTHS={TEXT_LENGTHS}', '--gin.BATCH_SIZE=8',
          '--gin.EVAL_BATCHES=1', '--gin.upcycle.eval.evaluate.decode_data=None',
          *(f'--gin.models.T5Config.{field}={getattr(TRAINING_T5, field)}' for field in (
              'd_model', 'd_ff', 'num_heads', 'd_kv', 'num_encoder_layers',
              'num_decoder_layers'))]


@pytest.mark.slow
def test_every_reader_refuses_changed_bytes_unless_told_not_to_verify(run, tmp_path, capsys,
                                                                      entry_points):
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  _flip_embedding(step_dir)
  changed = (f"{step_dir}/params: parameter '{EMBEDDING}' (shard 0:384,0:32): its bytes differ "
             f'from the digest recorded when the step was saved')
  refused = functools.partial(_refused, changed=changed)
  damaged = ocp.PyTreeCheckpointer().restore(step_dir / 'params')   # orbax's own reading

  # The command line: one line and exit status 1; --no_verify evaluates it as it is.
  with pytest.raises(SystemExit) as stopped:
    eval_script.main(_eval_argv(step_dir))
  assert str(stopped.value.code).startswith(f'error: {changed}')
  assert str(stopped.value.code).endswith('or pass --no_verify to read it as it is.')
  gin.clear_config(clear_constants=True)
  assert eval_script.main([*_eval_argv(step_dir), '--no_verify'])['step'] == 4   # its loss: NaN
  refused(lambda: infer_script.infer(
      model=T5(TRAINING_T5), infer_data=TextPipeline('offline_span_corruption', 'validation',
                                                     TEXT_LENGTHS, pack=False, shuffle=False),
      checkpoint_path=str(step_dir), output_dir=str(tmp_path / 'infer'), batch_size=8,
      decoding=DecodeConfig(), max_batches=1))

  # The restore hook (`verify`, a gin field), on the run's own abstract state.
  built = run['trainer'].built
  hook = Restore(str(step_dir), modes.Continue(), reuse_optimizer_state=True)
  with partitioning.activate(built.mesh, built.rules):
    refused(lambda: hook(built.abstract, built.optimizer, TRAINING_T5),
            skip='--gin.restore.Restore.verify=False')
    state = dataclasses.replace(hook, verify=False)(built.abstract, built.optimizer, TRAINING_T5)
  np.testing.assert_array_equal(np.asarray(state.params['token_embedder']['embedding']),
                                damaged['token_embedder']['embedding'])

  # Export (both formats) and convert refuse before writing; told not to verify, they write
  # the bytes as read, and their outputs verify against the digests they recorded.
  outputs = {name: tmp_path / name for name in ('t5x', 'hf', 'moe')}
  writers = {
      't5x': lambda **kw: t5x_export.export(str(model_dir), str(outputs['t5x']), **kw),
      'hf': lambda **kw: hf_export.export(str(model_dir), str(outputs['hf']),
                                          model_config=TRAINING_T5, **kw),
      'moe': lambda **kw: convert.convert(str(step_dir), MOE_T5, str(outputs['moe']), **kw)}
  for name, write in writers.items():
    refused(write)
    assert not outputs[name].exists(), name
    write(verify=False)
  capsys.readouterr()
  for name, written in (('t5x', outputs['t5x'] / 'checkpoint_4'), ('moe', outputs['moe'] / '4')):
    when = 'the step was saved' if name == 'moe' else 'it was written'
    assert _verify(written, capsys) == (0, (
        f'verified: all {len(_recorded(written))} arrays read back complete and match the '
        f'digests recorded when {when}.')), name
  t5x_embedding = _t5x_embedding(outputs['t5x'] / 'checkpoint_4')
  np.testing.assert_array_equal(t5x_embedding, damaged['token_embedder']['embedding'])
  # The damaged values hold NaN, which an HF directory's reader refuses wherever it reads them,
  # counting what orbax read.
  nan, inf = (int(f(damaged['token_embedder']['embedding']).sum()) for f in (np.isnan, np.isinf))
  status, line = _verify(outputs['hf'], capsys)
  assert status == 1 and nan and line.endswith(
      "model.safetensors: parameter 'shared.weight': the tensor holds values that are not "
      f'finite. Expected finite values, found {nan} NaN and {inf} Inf among those read. The file '
      'is damaged: re-download or re-export it.')

  # An HF output's digests are the CRC-32 of the tensors the safetensors package reads; a
  # byte flipped in one is then found (the export of the intact step).
  outputs['hf'] = tmp_path / 'hf_intact'
  hf_export.export(str(run['dir']), str(outputs['hf']), model_config=TRAINING_T5)
  assert _verify(outputs['hf'], capsys) == (0, (
      f'verified: all {len(_recorded(outputs["hf"]))} arrays read back complete and match the '
      f'digests recorded when it was written.'))
  tensors = load_file(str(outputs['hf'] / 'model.safetensors'))
  assert _recorded(outputs['hf']) == {
      name: {'dtype': str(t.dtype), 'shards': {','.join(f'0:{n}' for n in t.shape):
                                                zlib.crc32(t.tobytes())}}
      for name, t in tensors.items()}
  _flip(outputs['hf'] / 'model.safetensors', os.path.getsize(outputs['hf'] / 'model.safetensors')
        - 4, 1)
  status, line = _verify(outputs['hf'], capsys)
  assert status == 1 and 'its bytes differ from the digest recorded' in line


def _recorded(directory):
  """{name: entry} of the `params` and `optimizer_state` items an output's digests record."""
  items = json.loads((directory / 'digests' / 'process_0.json').read_text())['items']
  return {f'{item}/{name}' if item != 'params' else name: entry
          for item, entries in items.items() for name, entry in entries.items()}


def _t5x_embedding(checkpoint_dir):
  """The embedding of a T5X checkpoint as its layout stores it (zarr, read by tensorstore)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  store = ts.open({'driver': 'zarr', 'kvstore': {
      'driver': 'file', 'path': str(checkpoint_dir / 'target.token_embedder.embedding')}})
  return np.asarray(store.result().read().result())


@pytest.mark.slow
@pytest.mark.parametrize('change', ['one bit of batch_in_epoch', 'not JSON'])
def test_a_changed_data_position_is_refused_and_set_aside(run, tmp_path, capsys, change):
  model_dir = _copy(run, tmp_path)
  step_dir = model_dir / 'checkpoints' / '4'
  metadata = step_dir / 'dataset' / 'metadata'
  text_before = metadata.read_text()
  assert '"batch_in_epoch": 4,' in text_before
  if change == 'not JSON':
    metadata.write_text(text_before[:-7])
    reason = f'{step_dir}/dataset: the data position is unreadable ('
  else:   # '4' (0x34) -> '5' (0x35): one bit
    metadata.write_text(text_before.replace('"batch_in_epoch": 4,', '"batch_in_epoch": 5,'))
    reason = (f'{step_dir}/dataset: the data position differs from the digest recorded when the '
              f'step was saved (crc32 ')
  status, line = _verify(step_dir, capsys)
  assert status == 1 and line.startswith(f'error: {reason}')
  _assert_falls_back_to_step_2(run, model_dir, capsys, reason.replace(str(model_dir), ''))


def _retention_at_the_first_array_read(monkeypatch, steps):
  """At the first array read (a digest check or a placement on the mesh, after the step was
  opened), the trainer of `steps` (MODEL_DIR/checkpoints) saves step 6 and its retention deletes
  step 4 as orbax's does: its files unlinked, then its directories. Step 6 holds step 2's
  arrays, so what is evaluated tells which step was read."""
  original, reads = zarr_leaf._read, []  # pylint: disable=protected-access

  def read_during_retention(*args, **kwargs):
    reads.append(args)
    if len(reads) == 1:
      shutil.copytree(steps / '2', steps / '6')
      for root, _, names in os.walk(steps / '4', topdown=False):
        for name in names:
          os.unlink(os.path.join(root, name))
        os.rmdir(root)
    return original(*args, **kwargs)

  monkeypatch.setattr(zarr_leaf, '_read', read_during_retention)


def _evaluate(checkpoint_path, **kw):
  return eval_script.evaluate(objective=Seq2Seq(T5(TRAINING_T5)), eval_data=text('validation'),
                              checkpoint_path=str(checkpoint_path), batch_size=8,
                              eval_batches=1, **kw)


@pytest.mark.slow
@pytest.mark.parametrize('reader', ['eval', 'infer --no_verify'])
def test_a_step_retention_deletes_while_it_is_read_is_read_again_at_the_new_latest(
    run, tmp_path, monkeypatch, capsys, reader):
  """Eval and infer of a live run's MODEL_DIR/checkpoints: the step being read is deleted after
  it was opened (eval: during its digest check; infer without it: while its parameters are
  placed on the mesh); the whole read starts again at the new latest step, said on the
  console, instead of a missing chunk being called damage."""
  console.show_progress()   # as the entry points do
  steps = _copy(run, tmp_path) / 'checkpoints'
  _retention_at_the_first_array_read(monkeypatch, steps)
  if reader == 'eval':
    results = _evaluate(steps)
    monkeypatch.undo()
    reference = _evaluate(run['dir'] / 'checkpoints' / '2')   # step 6's arrays, read directly
    assert results['step'] == 6
    assert {k: v for k, v in results.items() if k not in ('checkpoint', 'step')} == {
        k: v for k, v in reference.items() if k not in ('checkpoint', 'step')}
  else:
    path = infer_script.infer(
        model=T5(TRAINING_T5), infer_data=TextPipeline(
            'offline_span_corruption', 'validation', TEXT_LENGTHS, pack=False, shuffle=False),
        checkpoint_path=str(steps), output_dir=str(tmp_path / 'infer'), batch_size=8,
        decoding=DecodeConfig(), max_batches=1, verify=False)
    rows = [json.loads(line) for line in open(path)]
    assert rows and all(row['checkpoint'] == {'path': f'{steps}/6', 'format': 'orbax', 'step': 6}
                        for row in rows)
    assert os.path.basename(path).startswith('offline_span_corruption-6-greedy-')
  said = capsys.readouterr().err.splitlines()
  assert said == [
      f'{steps}/4 was deleted by retention while being read (a running trainer keeps its last '
      'TrainConfig.keep_checkpoints steps); reading the latest step again.',
      f'Read step 6 ({steps}/6), the latest step now.']


@pytest.mark.slow
def test_a_damaged_latest_step_that_stays_is_refused_not_read_again(run, tmp_path, capsys):
  """Eval of MODEL_DIR/checkpoints whose latest step has changed bytes: it is not vanishing, so
  it is refused as damaged (the live-run retry does not hide it, nor fall back)."""
  console.show_progress()
  steps = _copy(run, tmp_path) / 'checkpoints'
  _flip_embedding(steps / '4')
  _refused(lambda: _evaluate(steps), changed=(
      f"{steps}/4/params: parameter '{EMBEDDING}' (shard 0:384,0:32): its bytes differ from the "
      'digest recorded when the step was saved'))
  assert 'deleted by retention' not in capsys.readouterr().err
  assert sorted(os.listdir(steps)) == ['2', '4']
