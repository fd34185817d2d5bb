"""`python -m upcycle.export` and `TrainConfig.export_t5x`: a trained run in T5X's layout, read
back with our T5X reader and the independent one (tests/checkpoints/t5x_reader.py)."""

import dataclasses
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from tests.checkpoints import helpers, t5x_reader
from tests.helpers import REPO
from tests.train.helpers import TRAINING_T5, text
from upcycle import checkpoints, console, export, fields, optimizer_state, tree
from upcycle.checkpoints import t5x_export, t5x_writer
from upcycle.checkpoints.orbax import CheckpointManager
from upcycle.locks.file_lock import FileLock
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers
from upcycle.train import optimizers
from upcycle.train.objectives import Seq2Seq
from upcycle.train.trainer import TrainConfig, Trainer

E = 2
MOE = dataclasses.replace(TRAINING_T5, encoder_moe=MoeConfig(num_experts=E),
                          decoder_moe=MoeConfig(num_experts=E, router=routers.TopK()))
EXPERT = 'encoder/layers_1/mlp/expert/wi_0/kernel'


def _train(model_dir):
  """2 steps of a tiny MoE T5 with T5X's Adafactor (momentum: `m` is a full slot), exported by
  the trainer; -> (trainer, result)."""
  config = TrainConfig(str(model_dir), train_steps=2, batch_size=8, log_every=1,
                       checkpoint_every=1000, async_checkpoints=False, tensorboard=False,
                       export_t5x=True)
  trainer = Trainer(Seq2Seq(T5(MOE)), optimizers.T5XAdafactor(beta1=0.9), config, text('train'),
                    devices=jax.devices()[:1])
  return trainer, trainer.run()


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """The run's MODEL_DIR, its final params and T5X slots (references), and its optimizer."""
  console.show_progress()
  model_dir = tmp_path_factory.mktemp('t5x_adafactor_run')
  trainer, result = _train(model_dir)
  state = jax.device_get(result['state'])
  return dict(model_dir=str(model_dir), params=state.params, opt_state=state.opt_state,
              slots=t5x_writer.adafactor_param_states(state.opt_state),
              optimizer=trainer.built.optimizer)


def _assert_t5x(directory, step, params, slots):
  """Both readers find exactly `params`, `slots` (None: no param_states) and `step`."""
  raw, state = t5x_reader.read(directory)
  stored_step = raw['optimizer']['state']['step']
  assert isinstance(stored_step, np.int32) and stored_step == step
  want = {'target': tree.flatten(params),
          'param_states': tree.flatten(slots) if slots is not None else {}}
  got = {'target': t5x_reader.by_path(state['target']),
         'param_states': t5x_reader.by_path(state['state']['param_states'])
                         if state['state']['param_states'] else {}}
  ckpt = checkpoints.load(directory)
  assert (ckpt.format, ckpt.step, ckpt.path) == ('t5x', step, directory)
  ours = {'target': tree.flatten(ckpt.params),
          'param_states': tree.flatten((ckpt.optimizer_state or {}).get('param_states', {}))}
  for found in (got, ours):
    for part in want:
      assert found[part].keys() == want[part].keys(), part
      for path, value in want[part].items():
        assert found[part][path].dtype == np.asarray(value).dtype, path
        np.testing.assert_array_equal(found[part][path], value, err_msg=f'{part}/{path}')


@pytest.mark.slow
def test_export_writes_params_and_t5x_adafactor_slots(run, tmp_path, capsys):
  before = helpers.snapshot(os.path.join(run['model_dir'], 'checkpoints'))
  out = t5x_export.export(run['model_dir'], str(tmp_path / 'out'))
  assert out == str(tmp_path / 'out' / 'checkpoint_2')
  printed = capsys.readouterr().out
  assert f'Wrote {out} (T5X, step 2, with T5X Adafactor state).' in printed
  arrays = 5 * len(tree.flatten(run['params'])) + 1   # params, 4 slots each, the step
  assert f'checkpoint_2: {arrays}/{arrays} arrays (100%)' in printed   # progress
  _assert_t5x(out, 2, run['params'], run['slots'])
  # Flaxformer's MoE names; each expert has its own factored second moment, momentum in full.
  assert tree.flatten(run['params'])[EXPERT].shape == (E, 32, 64)
  slots = tree.flatten(run['slots'])
  assert slots[f'{EXPERT}/v_row'].shape == (E, 32) and slots[f'{EXPERT}/m'].shape == (E, 32, 64)
  assert np.abs(slots[f'{EXPERT}/m']).max() > 0
  # T5X's Adafactor state read back is the run's optimizer state, count included.
  ckpt = checkpoints.load(out)
  restored = optimizer_state.from_t5x_adafactor(ckpt.optimizer_state, run['params'],
                                            run['optimizer'])
  assert int(restored.count) == int(run['opt_state'].count) == 2
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(run['opt_state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert helpers.snapshot(os.path.join(run['model_dir'], 'checkpoints')) == before


def test_trainer_flag_writes_the_final_step_and_a_restart_keeps_it(run, capsys):
  t5x_dir = os.path.join(run['model_dir'], 't5x')
  assert os.listdir(t5x_dir) == ['checkpoint_2']
  _assert_t5x(os.path.join(t5x_dir, 'checkpoint_2'), 2, run['params'], run['slots'])
  before = helpers.snapshot(t5x_dir)
  capsys.readouterr()
  _, result = _train(run['model_dir'])          # the finished run restarted: nothing to train
  assert result['start_step'] == 2
  assert 'T5X export kept: ' in capsys.readouterr().out
  assert helpers.snapshot(t5x_dir) == before
  with pytest.raises(fields.ConfigError, match=r'trainer\.TrainConfig\.export_t5x = 1: '):
    TrainConfig('/tmp/x', 1, 8, export_t5x=1)
  with pytest.raises(fields.ConfigError, match='T5X writer writes local directories'):
    TrainConfig('gs://bucket/run', 1, 8, export_t5x=True)


def test_cli_params_only(run, tmp_path, capsys):
  out = tmp_path / 'params_only'
  capsys.readouterr()
  assert export.main([f'--model_dir={run["model_dir"]}', f'--output_dir={out}',
                      '--no_optimizer_state']) == 0
  assert 'Exporting the parameters only (no optimizer state asked for).' in (
      capsys.readouterr().out)
  assert os.listdir(out) == ['checkpoint_2']
  _assert_t5x(str(out / 'checkpoint_2'), 2, run['params'], None)


@pytest.mark.parametrize('optimizer', [
    optax.adafactor(1e-2, min_dim_size_to_factor=4),
    optax.adamw(1e-3)], ids=['optax_adafactor', 'adamw'])
def test_other_optimizers_export_params_only(optimizer, tmp_path, capsys):
  """A run's checkpoint as the trainer saves it, with an optax optimizer's state."""
  console.show_progress()
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=3)
  state = optimizer.init(params)
  with CheckpointManager(str(tmp_path / 'run' / 'checkpoints'), async_save=False) as manager:
    manager.save(5, params, state)
  capsys.readouterr()
  out = t5x_export.export(str(tmp_path / 'run'), str(tmp_path / 'out'))
  assert out == str(tmp_path / 'out' / 'checkpoint_5')
  lines = capsys.readouterr().out.splitlines()
  assert [line for line in lines if 'parameters only' in line] == [
      f"{tmp_path / 'run' / 'checkpoints' / '5'} holds an optimizer state that is not "
      f"optimizers.T5XAdafactor's, whose slots T5X could not use: exporting the parameters "
      f"only."]
  _assert_t5x(out, 5, params, None)


def test_refusals_name_the_path_and_write_nothing(run, tmp_path, capsys):
  model_dir, out = run['model_dir'], str(tmp_path / 'out')
  source = helpers.snapshot(model_dir)
  t5x_export.export(model_dir, out)
  written = helpers.snapshot(out)
  assert export.main([f'--model_dir={model_dir}', f'--output_dir={out}']) == 1
  assert capsys.readouterr().err == (
      f'error: {out}/checkpoint_2 already exists; an export never overwrites. Fix: delete it, '
      f'or pass another --output_dir.\n')
  assert export.main([f'--model_dir={model_dir}', '--step=1', f'--output_dir={out}/b']) == 1
  assert capsys.readouterr().err == (
      f'error: {model_dir}/checkpoints: no finished checkpoint for step 1; the run has steps '
      f'[2]. Fix: pass one of them as --step, or none for the latest (2).\n')
  with pytest.raises(t5x_export.ExportError, match=rf"^{tmp_path}: no finished checkpoint of a run "
                     rf"here\. Expected checkpoints/<step>/ .* found \['out'\]\. Fix: pass"):
    t5x_export.export(str(tmp_path), str(tmp_path / 'c'))
  with pytest.raises(t5x_export.ExportError, match="lies inside the run's checkpoints"):
    t5x_export.export(model_dir, os.path.join(model_dir, 'checkpoints', 't5x'))
  with pytest.raises(t5x_export.ExportError, match='writes local directories'):
    t5x_export.export(model_dir, 'gs://bucket/t5x')
  assert helpers.snapshot(out) == written and not os.path.exists(f'{out}/b')
  assert helpers.snapshot(model_dir) == source


def _killed_export(final):
  """What an export of `final` killed while writing leaves: its lock file (no longer held) and
  its partial `<final>.tmp-<time>-<pid>/`."""
  code = ('import os, signal, sys; from upcycle.locks.file_lock import FileLock; '
          'FileLock(sys.argv[1] + ".tmp.lock").acquire(); '
          'os.makedirs(f"{sys.argv[1]}.tmp-1700000000-{os.getpid()}/target.x"); '
          'os.kill(os.getpid(), signal.SIGKILL)')
  killed = subprocess.run([sys.executable, '-c', code, str(final)], cwd=REPO)
  assert killed.returncode == -9
  partial, = [p for p in os.listdir(os.path.dirname(final)) if '.tmp-' in p]
  return os.path.join(os.path.dirname(final), partial)


def test_an_export_removes_what_a_killed_one_left_and_refuses_a_running_one(run, tmp_path,
                                                                          capsys, caplog):
  out = tmp_path / 'out'
  args = [f"--model_dir={run['model_dir']}", f'--output_dir={out}']
  with FileLock(str(out / 'checkpoint_2.tmp.lock')):   # an export of step 2 is running
    assert export.main(args) == 1
  assert capsys.readouterr().err.startswith(
      f'error: Another write of {out}/checkpoint_2 is running: {out}/checkpoint_2.tmp.lock is '
      f'locked by pid {os.getpid()} on host ')
  partial = _killed_export(out / 'checkpoint_2')   # its lock file names it, not the one above
  caplog.set_level('INFO')
  assert export.main(args) == 0
  pid = partial.rsplit('-', 1)[1]
  assert (f'Removed {partial}, left by a write of checkpoint_2 that was killed (pid {pid} on '
          f'host ') in caplog.text
  assert os.listdir(out) == ['checkpoint_2']
  _assert_t5x(str(out / 'checkpoint_2'), 2, run['params'], run['slots'])


def test_an_export_onto_a_full_disk_stops_in_one_line_and_leaves_nothing(run, small_disk,
                                                                        capsys):
  filler = small_disk / 'filler'
  filler.write_bytes(b'\0' * (shutil.disk_usage(small_disk).free - 64 * 1024))
  out = small_disk / 'out'
  assert export.main([f"--model_dir={run['model_dir']}", f'--output_dir={out}']) == 1
  err = capsys.readouterr().err
  assert err.startswith(f'error: Exporting step 2 to {out}/checkpoint_2 failed: no space left '
                        f'on device; the partial checkpoint was removed. It needs up to ')
  assert err.endswith(' MiB (the arrays uncompressed). Fix: free space there, or pass another '
                      '--output_dir.\n')
  assert os.listdir(out) == []


@pytest.mark.slow
def test_a_scanned_run_exports_unrolled_as_t5x_models_read_it(tmp_path):
  """SCAN_LAYERS=True stores `layers/subblock_{j}` with the layer axis first; T5X's models are
  unrolled: the export writes `layers_{i}` (params and T5X Adafactor slots), which the
  unrolled model reads with the scanned run's logits; inspect describes both alike."""
  from upcycle import describe as describe_command  # pylint: disable=g-import-not-at-top
  unrolled = dataclasses.replace(MOE, num_encoder_layers=4, num_decoder_layers=4)
  scanned = dataclasses.replace(unrolled, scan_layers=True)   # every other layer MoE: period 2
  config = TrainConfig(str(tmp_path / 'run'), train_steps=2, batch_size=8, log_every=1,
                       checkpoint_every=1000, async_checkpoints=False, tensorboard=False)
  trainer = Trainer(Seq2Seq(T5(scanned)), optimizers.T5XAdafactor(beta1=0.9), config,
                    text('train'), devices=jax.devices()[:1])
  state = jax.device_get(trainer.run()['state'])
  assert 'subblock_1' in state.params['encoder']['layers']
  out = t5x_export.export(str(tmp_path / 'run'), str(tmp_path / 't5x'))
  exported = checkpoints.load(out)
  assert 'layers_1' in exported.params['encoder'] and 'layers' not in exported.params['encoder']
  np.testing.assert_allclose(helpers.t5_logits(exported.params, unrolled),
                             helpers.t5_logits(state.params, scanned), rtol=1e-6, atol=1e-6)
  # Layer i = 2k + j of a period of 2: layer 3 is sub-block 1's entry 1.
  slots = tree.flatten(t5x_writer.adafactor_param_states(state.opt_state))
  got = tree.flatten(exported.optimizer_state['param_states'])
  for slot in ('v_row', 'v_col', 'm'):
    np.testing.assert_array_equal(
        got[f'encoder/layers_3/mlp/expert/wi_0/kernel/{slot}'],
        slots[f'encoder/layers/subblock_1/mlp/expert/wi_0/kernel/{slot}'][1])
  # Every unrolled parameter has T5X's four slots (T5X's restore needs them all); an unused
  # one is T5X's placeholder [1] in every layer, as in the scanned run.
  raw, state_read = t5x_reader.read(out)   # the independent reader
  assert 'layers_1' in raw['optimizer']['target']['encoder']
  read = t5x_reader.by_path(state_read['state']['param_states'])
  params = tree.flatten(exported.params)
  assert set(read) == {f'{p}/{slot}' for p in params for slot in ('v_row', 'v_col', 'v', 'm')}
  for slot in ('v_row', 'v_col', 'v', 'm'):
    for i, (k, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
      scanned_slot = slots[f'decoder/layers/subblock_{j}/pre_mlp_layer_norm/scale/{slot}']
      layer_slot = read[f'decoder/layers_{i}/pre_mlp_layer_norm/scale/{slot}']
      if scanned_slot.shape == (1,):
        np.testing.assert_array_equal(layer_slot, np.zeros((1,), np.float32))
      else:
        np.testing.assert_array_equal(layer_slot, scanned_slot[k])
  assert read['encoder/layers_2/attention/query/kernel/v'].shape == (1,)   # factored
  run_model = describe_command.summary(checkpoints.load(str(tmp_path / 'run' / 'checkpoints'),
                                               lazy=True))['model']
  assert run_model == describe_command.summary(checkpoints.load(out, lazy=True))['model'] + (
      '; layers stored scanned')
