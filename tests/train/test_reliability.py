"""One trainer per MODEL_DIR, resume checks, corrupt checkpoints, config checks,
stalled runs, metrics on resume. Cases 1-3 run `python -m upcycle.train` as real processes."""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
import pytest

from tests.helpers import REPO, refusal
from tests.train.helpers import ONE_DEVICE_ENV, TRAINING_T5, text, train_command
from upcycle import console, describe, fields
from upcycle.checkpoints import CheckpointError
from upcycle.checkpoints.orbax import CheckpointManager
from upcycle.locks.file_lock import FileLock
from upcycle.models import T5, T5Config, ViTConfig
from upcycle.moe import MoeConfig, grouping, routers
from upcycle.train import __main__ as train_main
from upcycle.train import logger as logger_lib
from upcycle.train import resume, stall
from upcycle.train.objectives import Seq2Seq
from upcycle.train.optimizers import Adafactor, rsqrt_schedule
from upcycle.train.trainer import NonFiniteLossError, TrainConfig, Trainer

EVERY_2 = '--gin.trainer.TrainConfig.checkpoint_every=2'


def _train(model_dir, steps, *extra, timeout=300):
  return subprocess.run(train_command(model_dir, steps, EVERY_2, *extra), cwd=REPO,
                        env=ONE_DEVICE_ENV, capture_output=True, text=True, timeout=timeout)


def _rows(model_dir, split='train'):
  return [r for r in map(json.loads, open(os.path.join(model_dir, 'metrics.jsonl')))
          if r['split'] == split]


@pytest.fixture(scope='module')
def run_4_steps(tmp_path_factory):
  """MODEL_DIR of a 4-step run of the tiny gin T5 with checkpoints at steps 2 and 4."""
  model_dir = tmp_path_factory.mktemp('reliability') / 'run'
  done = _train(model_dir, 4)
  assert done.returncode == 0, done.stderr[-3000:]
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4']
  return model_dir


def _copy(run_dir, tmp_path):
  copy = tmp_path / 'run'
  shutil.copytree(run_dir, copy)
  return copy


def _largest_params_file(model_dir, step):
  files = glob.glob(str(model_dir / 'checkpoints' / str(step) / 'params' / '**' / 'd' / '*'),
                    recursive=True)
  return max(files, key=os.path.getsize)


@pytest.mark.slow
def test_a_second_trainer_on_a_model_dir_is_refused_naming_the_holder(tmp_path):
  model_dir = tmp_path / 'run'
  first = subprocess.Popen(train_command(model_dir, 100000, EVERY_2), cwd=REPO,
                           env=ONE_DEVICE_ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None:
      if os.path.exists(model_dir / 'metrics.jsonl') and _rows(model_dir):
        break   # Training: the lock is held.
      time.sleep(0.2)
    assert first.poll() is None and _rows(model_dir), 'the first trainer did not start'
    holder = json.loads((model_dir / 'run.lock').read_text())
    assert holder['pid'] == first.pid and holder['host'] == socket.gethostname()

    second = _train(model_dir, 100000)
    assert second.returncode == 1
    assert 'train step' not in second.stdout
    message, = [line for line in second.stderr.splitlines() if line.startswith('error:')]
    assert message.startswith(f'error: MODEL_DIR {model_dir} is in use by another trainer')
    assert f'pid {first.pid} on host {socket.gethostname()}, since {holder["since"]}' in message
    assert first.poll() is None   # The first one trains on, untouched.
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  with FileLock(model_dir / 'run.lock'):   # A killed trainer leaves the directory free.
    pass


@pytest.mark.slow
def test_resuming_with_a_different_model_fails_in_one_message(run_4_steps, tmp_path):
  model_dir = _copy(run_4_steps, tmp_path)
  config_before = (model_dir / 'config.gin').read_text()
  done = _train(model_dir, 6, '--gin.models.T5Config.d_model=32')
  assert done.returncode == 1
  assert 'Traceback' not in done.stderr and 'Event loop' not in done.stderr
  error = [line for line in done.stderr.splitlines() if line.startswith('error:')]
  assert len(error) == 1
  assert (f"Cannot resume from {model_dir}/checkpoints/4/params (found) with the model this "
          f"config builds (expected): parameter 'decoder/decoder_norm/scale': shape does not "
          f"match the model config. Expected (32,), found (64,).") in error[0]
  assert f'({model_dir}/config.gin), or train this model in a new MODEL_DIR' in error[0]
  assert (model_dir / 'config.gin').read_text() == config_before
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4']
  assert [r['step'] for r in _rows(model_dir)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(run_4_steps, tmp_path):
  model_dir = _copy(run_4_steps, tmp_path)
  broken = _largest_params_file(model_dir, 4)
  os.truncate(broken, 1000)
  done = _train(model_dir, 6)
  assert done.returncode == 0, done.stderr[-3000:]
  warning = [line for line in done.stderr.splitlines() if 'is corrupt' in line]
  assert len(warning) == 1
  assert warning[0].startswith('WARNING: Checkpoint step 4 is corrupt and was moved to '
                               f'{model_dir}/corrupt_checkpoints/4-')
  assert ("parameter '" in warning[0] and
          f'data file {broken} is truncated (1000 bytes' in warning[0])
  assert warning[0].endswith('Falling back to the previous checkpoint, step 2.')
  assert 'Resuming from' in done.stdout and 'at step 2.' in done.stdout
  assert 'Traceback' not in done.stderr and 'Exception ignored' not in done.stderr
  # Steps 3 and 4 are redone exactly and logged once.
  before = {r['step']: r['loss'] for r in _rows(run_4_steps)}
  after = _rows(model_dir)
  assert [r['step'] for r in after] == [1, 2, 3, 4, 5, 6]
  assert [r['loss'] for r in after[:4]] == [before[s] for s in (1, 2, 3, 4)]
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4', '6']
  assert [d[:2] for d in os.listdir(model_dir / 'corrupt_checkpoints')] == ['4-']


@pytest.mark.slow
def test_a_changed_optimizer_stops_without_touching_the_checkpoints(run_4_steps, tmp_path,
                                                                   entry_points, capsys):
  """An intact checkpoint whose optimizer state another optimizer wrote is a configuration
  mismatch, not damage: nothing is set aside; 'fresh' keeps the parameters, step and data.
  The refusal is train's main in this process, the run with 'fresh' a real process."""
  model_dir = _copy(run_4_steps, tmp_path)
  momentum = '--gin.optimizers.T5XAdafactor.beta1=0.9'
  error = refusal(train_main.main, train_command(model_dir, 6, EVERY_2, momentum)[3:], capsys)
  assert error.startswith(f'error: Cannot resume the optimizer state of {model_dir}/checkpoints/4 '
                          f"with this config's optimizer: The optimizer state stored in ")
  assert 'of shape (1,); the optimizer makes (' in error
  assert "--gin.trainer.TrainConfig.on_optimizer_mismatch='fresh'" in error
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4']
  assert not (model_dir / 'corrupt_checkpoints').exists()
  assert [r['step'] for r in _rows(model_dir)] == [1, 2, 3, 4]
  done = _train(model_dir, 6, momentum, "--gin.trainer.TrainConfig.on_optimizer_mismatch='fresh'")
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'starts fresh at that step' in done.stderr and 'at step 4.' in done.stdout
  assert [r['step'] for r in _rows(model_dir)] == [1, 2, 3, 4, 5, 6]
  assert sorted(os.listdir(model_dir / 'checkpoints')) == ['2', '4', '6']


@pytest.mark.slow
def test_a_run_whose_checkpoints_were_all_set_aside_is_not_started_over(
    run_4_steps, tmp_path, entry_points, capsys):
  model_dir = _copy(run_4_steps, tmp_path)
  (model_dir / 'corrupt_checkpoints').mkdir()
  for step in ('2', '4'):
    os.rename(model_dir / 'checkpoints' / step, model_dir / 'corrupt_checkpoints' / f'{step}-x')
  # `_train`'s command, its main in this process (without `python -m upcycle.train`).
  error = refusal(train_main.main, train_command(model_dir, 6, EVERY_2)[3:], capsys)
  assert error == (f'error: {model_dir} has no checkpoint in checkpoints/ but earlier ones set '
                   f'aside in {model_dir}/corrupt_checkpoints (damaged when a restart found '
                   f'them). Not starting this run over from scratch. Fix: move a step you trust '
                   f'back into {model_dir}/checkpoints/, or delete {model_dir}/corrupt_checkpoints '
                   f'to start the run over.')
  assert os.listdir(model_dir / 'checkpoints') == []
  assert [r['step'] for r in _rows(model_dir)] == [1, 2, 3, 4]


# The failed orbax restore leaves an unawaited tensorstore future behind.
@pytest.mark.slow
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_no_restorable_checkpoint_stops_naming_each_step(run_4_steps, tmp_path):
  model_dir = _copy(run_4_steps, tmp_path)
  shutil.rmtree(model_dir / 'checkpoints' / '2')
  missing = _largest_params_file(model_dir, 4)
  os.remove(missing)
  manager = CheckpointManager(model_dir / 'checkpoints', async_save=False)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  from upcycle.checkpoints import orbax_tree   # pylint: disable=g-import-not-at-top
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        orbax_tree.read(model_dir / 'checkpoints' / '4' / 'params'))
  with pytest.raises(CheckpointError) as raised:
    resume.restore(manager, types.SimpleNamespace(params=params, opt_state=None), str(model_dir))
  manager.close()
  message = str(raised.value)
  assert message.startswith(f'No checkpoint in {model_dir}/checkpoints can be restored')
  assert f"step 4: {model_dir}/checkpoints/4/params: parameter '" in message
  assert f'data file {missing} is missing' in message
  assert f'delete {model_dir} to start the run over' in message


def _stored_arrays(step_dir) -> int:
  """How many arrays orbax's own metadata lists under the params and optimizer items."""
  handler = ocp.PyTreeCheckpointHandler()
  return sum(len(jax.tree.leaves(handler.metadata(epath.Path(step_dir / item)).tree))
             for item in ('params', 'optimizer_state'))


def test_inspect_verify_reads_every_array(run_4_steps, tmp_path, capsys):
  step_dir = run_4_steps / 'checkpoints' / '4'
  assert describe.main([str(step_dir), '--verify']) == 0
  expected = _stored_arrays(step_dir)
  assert expected > 100
  assert (f'verified: all {expected} arrays read back complete and match the digests recorded '
          f'when the step was saved.') in capsys.readouterr().err
  model_dir = _copy(run_4_steps, tmp_path)
  broken = _largest_params_file(model_dir, 4)
  os.remove(broken)
  step_dir = model_dir / 'checkpoints' / '4'
  assert describe.main([str(step_dir)]) == 0   # Metadata alone looks fine.
  capsys.readouterr()
  assert describe.main([str(step_dir), '--verify']) == 1
  err = capsys.readouterr().err
  assert err.startswith(f"error: {step_dir}/params: parameter '")
  assert f'data file {broken} is missing' in err


@pytest.mark.parametrize('make, binding', [
    (lambda: TrainConfig('d', 10, 8, checkpoint_every='ten'),
     "trainer.TrainConfig.checkpoint_every = 'ten': expected an integer >= 1"),
    (lambda: TrainConfig('d', 10, 8, log_every=0),
     'trainer.TrainConfig.log_every = 0: expected an integer >= 1'),
    (lambda: TrainConfig('d', 10, 8, async_checkpoints='no'),
     "trainer.TrainConfig.async_checkpoints = 'no': expected True or False"),
    (lambda: TrainConfig('d', 10, 8, stall_warning_steps=-1),
     'trainer.TrainConfig.stall_warning_steps = -1: expected an integer >= 0'),
    (lambda: MoeConfig(train_capacity_factor=-1.0),
     'moe.MoeConfig.train_capacity_factor = -1.0: expected a number > 0.0'),
    (lambda: MoeConfig(eval_capacity_factor=0),
     'moe.MoeConfig.eval_capacity_factor = 0: expected a number > 0.0'),
    (lambda: MoeConfig(num_experts=2.5),
     'moe.MoeConfig.num_experts = 2.5: expected an integer >= 1'),
    (lambda: MoeConfig(router=routers.TopK(k=5), num_experts=4),
     'routers.TopK.k = 5: Top-K needs k <= the number of experts (4)'),
    (lambda: MoeConfig(router='tokens_choose'),
     "moe.MoeConfig.router = 'tokens_choose': expected a routers.Router object, "
     '@routers.ExpertsChoose() or @routers.TopK() in gin'),
    (lambda: MoeConfig(capacity_convention='t5x'),
     "moe.MoeConfig.capacity_convention = 't5x': expected a capacity.Convention object, "
     '@capacity.Vmoe() or @capacity.T5X() in gin'),
    (lambda: MoeConfig(grouping=grouping.Flaxformer(max_group_size=0)),
     'grouping.Flaxformer.max_group_size = 0: expected an integer >= 1'),
    (lambda: T5Config(encoder_moe_layers='every_third'),
     "models.T5Config.encoder_moe_layers: MoE placement 'every_third' is not understood"),
    (lambda: ViTConfig(depth=4, moe_layers='last_6'),
     "models.ViTConfig.moe_layers: MoE placement 'last_6' asks for 6 layers; the stack has 4."),
    (lambda: MoeConfig(jitter_noise=1.5),
     'moe.MoeConfig.jitter_noise = 1.5: expected a number in [0, 1)'),
    (lambda: T5Config(d_model='64'), "models.T5Config.d_model = '64': expected an integer >= 1"),
    (lambda: T5Config(dtype='float64'),
     "models.T5Config.dtype = 'float64': expected one of ('float32', 'bfloat16', 'float16')"),
    (lambda: T5Config(encoder_moe=MoeConfig),
     "models.T5Config.encoder_moe = <class 'upcycle.moe.config.MoeConfig'>: expected None or a "
     'MoeConfig such as @moe.MoeConfig()'),
    (lambda: T5Config(decoder_moe=MoeConfig(router=routers.ExpertsChoose())),
     'models.T5Config.decoder_moe.router = ExpertsChoose(): Expert Choice lets each expert'),
    (lambda: T5Config(decoder_moe=MoeConfig(router=routers.TopK(batch_priority=True))),
     'models.T5Config.decoder_moe.router = TopK(k=2, batch_priority=True): batch_priority = '
     'True cannot be used in a causal decoder'),
    (lambda: ViTConfig(patch_size=16),
     'models.ViTConfig.patch_size = 16: expected 2 integers >= 1'),
    (lambda: ViTConfig(pool_type='cls'),
     "models.ViTConfig.pool_type = 'cls': expected one of ('token', 'gap', 'map')"),
    (lambda: ViTConfig(width=100),
     'models.ViTConfig.width = 100: not divisible by num_heads = 12'),
    (lambda: ViTConfig(layer_norm_epsilon=0),
     'models.ViTConfig.layer_norm_epsilon = 0: expected a number > 0.0'),
    (lambda: TrainConfig('unused', train_steps=1, batch_size=1, keep_checkpoints=0),
     'trainer.TrainConfig.keep_checkpoints = 0: expected an integer >= 1, or None (every '
     'checkpoint is kept).'),
])
def test_config_fields_are_checked_at_construction(make, binding):
  with pytest.raises(fields.ConfigError) as raised:
    make()
  assert str(raised.value).startswith(binding)


def test_keep_checkpoints_none_keeps_every_checkpoint(tmp_path):
  """T5X's default (`SaveCheckpointConfig.keep = None`): 4 checkpoints stay, not the last 3."""
  config = TrainConfig(str(tmp_path), train_steps=4, batch_size=8, checkpoint_every=1,
                       keep_checkpoints=None, eval_every=0, async_checkpoints=False)
  tiny = dataclasses.replace(TRAINING_T5, num_encoder_layers=1, num_decoder_layers=1)
  Trainer(Seq2Seq(T5(tiny)), Adafactor(schedule=rsqrt_schedule(1.0, 100)), config,
          text('train'), None).run()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1', '2', '3', '4']


def test_a_wrong_gin_binding_fails_before_any_work(tmp_path, entry_points, capsys):
  model_dir = tmp_path / 'run'
  argv = train_command(model_dir, 4, "--gin.trainer.TrainConfig.checkpoint_every='ten'")[3:]
  assert refusal(train_main.main, argv, capsys) == (
      "error: trainer.TrainConfig.checkpoint_every = 'ten': expected an integer >= 1.")
  assert not model_dir.exists()


def test_watch_reports_each_stall_once():
  watch = stall.Watch(('loss',), steps=3)
  reports = {}
  for step, value in enumerate([5.0, 4.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0], start=1):
    watch.update({'loss': np.float32(value)})
    reports[step] = watch.warnings(step)
  assert [s for s, r in reports.items() if r] == [5, 9]
  (message, details), = reports[5]
  assert message.startswith('loss has been exactly 2 for 3 consecutive steps (steps 3 to 5)')
  assert details == {'metric': 'loss', 'value': 2.0, 'steps': 3, 'since_step': 3}
  assert reports[9][0][1]['since_step'] == 7
  assert stall.Watch(('loss',), steps=0).warnings(9) == []


def test_a_gradient_norm_of_exactly_0_warns_after_3_steps_not_50():
  """Saturated by too large a learning rate (report E18: from step 2 every gradient is 0)."""
  watch = stall.Watch(('grad_norm',), steps=50)
  first = None
  for step, value in enumerate([4.8, 0.0, 0.0, 0.0, 0.0], start=1):
    watch.update({'grad_norm': np.float32(value)})
    if watch.warnings(step) and first is None:
      first = step
  assert first == 4   # steps 2, 3, 4


def _run_tiny(model_dir, learning_rate, steps, checkpoint_every=1000, schedule=None,
              **train_kwargs):
  config = TrainConfig(str(model_dir), train_steps=steps, batch_size=8, log_every=1,
                       checkpoint_every=checkpoint_every, async_checkpoints=False,
                       **train_kwargs)
  optimizer = Adafactor(schedule=schedule or rsqrt_schedule(learning_rate, 100))
  return Trainer(Seq2Seq(T5(TRAINING_T5)), optimizer, config, text('train'),
                 devices=jax.devices()[:1]).run()


@pytest.mark.slow
def test_a_stalled_run_warns_on_the_console_and_in_the_metrics(tmp_path, capsys):
  console.show_progress()   # as the entry points do
  _run_tiny(tmp_path, 1e8, steps=6, stall_warning_steps=3)
  warnings = _rows(tmp_path, 'warning')
  assert warnings, [r['grad_norm'] for r in _rows(tmp_path)]
  first = warnings[0]
  assert first['metric'] in ('loss', 'grad_norm') and first['steps'] == 3
  assert first['step'] == first['since_step'] + 2
  grad_norms = {r['step']: r['grad_norm'] for r in _rows(tmp_path)}
  if first['metric'] == 'grad_norm':
    assert {grad_norms[s] for s in range(first['since_step'], first['step'] + 1)} == {
        first['value']}
  assert f"WARNING at step {first['step']}: {first['metric']} has been exactly" in (
      capsys.readouterr().err)


@pytest.mark.slow
def test_a_nan_before_the_first_checkpoint_says_what_to_do(tmp_path):
  with pytest.raises(NonFiniteLossError) as raised:
    _run_tiny(tmp_path, float('inf'), steps=4)
  message = str(raised.value)
  assert 'step None' not in message
  assert 'no checkpoint has been written yet, so a restart starts this run over from step 0' in (
      message)


@pytest.mark.slow
def test_a_nan_at_the_first_step_after_resuming_names_the_restored_step(tmp_path):
  """Round 5's Dg5b: the step resumed from is the likely cause, not a good checkpoint to
  resume from again. Its second update multiplies the weights by about 1e30: step 2 is saved
  finite, and the loss of step 3, the first after resuming, is not."""
  overflow = lambda step: jnp.where(step < 1, 1e-2, 1e30)
  _run_tiny(tmp_path, None, steps=2, checkpoint_every=2, schedule=overflow)
  with pytest.raises(NonFiniteLossError) as raised:
    _run_tiny(tmp_path, 1e-2, steps=4, checkpoint_every=2)
  assert str(raised.value) == (
      'The training loss or gradients became NaN or infinite at step 3, the first step after '
      f'resuming from step 2 in {tmp_path}/checkpoints; stopped without saving. The values '
      'restored from step 2 may be the cause, and a restart would resume from them again. '
      'Fix: move step 2 aside (a restart then resumes from an earlier step); else lower the '
      'learning rate or check the data.')


def test_truncate_log_keeps_rows_through_the_resume_step(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  rows = [{'step': s, 'split': 'train'} for s in (1, 2, 3, 4)] + [{'step': 2, 'split': 'eval'}]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 5, "spl')
  assert logger_lib.truncate_log(str(path), 2) == 3
  assert [json.loads(line) for line in open(path)] == [rows[0], rows[1], rows[4]]
  assert logger_lib.truncate_log(str(path), None) == 3
  assert path.read_text() == ''


@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_the_save_in_one_line(run_4_steps, small_disk):
  model_dir = small_disk / 'run'
  done = _train(model_dir, 8)
  assert done.returncode == 1
  errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1, errors[:5]
  noise = [line for line in done.stderr.splitlines()
           if 'ERROR:absl' in line or 'Error:' in line or 'Traceback' in line]
  assert not noise, noise[:5]
  # Found before writing (less free space than step 2 took), or while writing step 4.
  assert errors[0].startswith((
      f'error: Not enough space to save step 4 in {model_dir}/checkpoints: it needs about ',
      f'error: Saving step 4 to {model_dir}/checkpoints failed: ')), errors[0]
  assert 'the last good checkpoint, step 2, is kept' in errors[0]
  assert 'no space left on device' in errors[0] or '(the size of step 2)' in errors[0]
  assert 'Traceback' not in done.stderr
  assert os.listdir(model_dir / 'checkpoints') == ['2']
  assert [r['step'] for r in _rows(model_dir)][-1] == 4   # stopped at the save, not later


def test_a_live_runs_latest_step_deleted_while_read_is_read_again_at_the_new_latest(
    run_4_steps, tmp_path, monkeypatch, caplog):
  """What eval, infer and describe meet on a run whose trainer saves and prunes while they read:
  the step being read is removed by retention (here: step 6 lands, step 4 goes, as orbax does
  it) and the reader moves on to the new latest step instead of calling the step damaged.
  Evaluation opens no optimizer state."""
  from upcycle import checkpoints  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import orbax_tree  # pylint: disable=g-import-not-at-top
  run = _copy(run_4_steps, tmp_path)
  steps = run / 'checkpoints'
  original, calls = orbax_tree.read, []

  def read_during_retention(directory):
    calls.append(directory)
    if len(calls) == 1:   # the trainer saves step 6 and retention deletes step 4 meanwhile
      shutil.copytree(steps / '4', steps / '6')
      shutil.rmtree(steps / '4')
    return original(directory)

  monkeypatch.setattr(orbax_tree, 'read', read_during_retention)
  ckpt = checkpoints.load(str(steps), with_optimizer_state=False)
  assert ckpt.step == 6 and ckpt.optimizer_state is None
  assert calls == [f'{steps}/4/params', f'{steps}/6/params']   # no optimizer_state opened
  assert f'{steps}/4 was deleted by retention while being read' in caplog.text
  # A step that stays damaged is an error, not a retry.
  shutil.rmtree(steps / '6' / 'params' / 'ocdbt.process_0')
  with pytest.raises(CheckpointError):
    checkpoints.load(str(steps))


def test_a_live_run_whose_every_step_is_deleted_while_read_says_so(tmp_path):
  """Each step lives shorter than a read: the trainer saves the next and retention deletes the
  one being read, every time. After the attempts, one line says that, not that a chunk is
  missing from a damaged step."""
  from upcycle.checkpoints import orbax  # pylint: disable=g-import-not-at-top
  steps = tmp_path / 'checkpoints'

  def save(step):   # what makes a finished step for the readers: orbax's two metadata files
    (steps / str(step) / 'params').mkdir(parents=True)
    (steps / str(step) / '_CHECKPOINT_METADATA').write_text('{}')
    (steps / str(step) / 'params' / '_METADATA').write_text('{}')

  def read_outlived(step_dir):
    save(orbax.step_of(step_dir) + 2)
    shutil.rmtree(step_dir)
    raise CheckpointError(f'{step_dir}/params: a zarr chunk or array file is missing.')

  save(2)
  with pytest.raises(CheckpointError) as raised:
    orbax.read_live(str(steps), read_outlived)
  assert str(raised.value) == (
      f'{steps}: retention deleted each of the 3 latest steps read, the last {steps}/6, before '
      'its read ended: a running trainer keeps its last TrainConfig.keep_checkpoints steps, and '
      'each lived shorter than a read. Read a copy of a step, or a run that saves less often or '
      'keeps more steps.')


@pytest.mark.slow
def test_a_disk_that_fills_during_the_save_stops_the_run_in_one_line(roomy_disk):
  """The free-space check passes, then another writer fills the disk while step 4 is written:
  one error line, none of the background writers' echoes (orbax's closed event loop, its
  orphaned tasks and file-write futures), and the run resumes from step 2 once there is
  room."""
  model_dir = roomy_disk / 'run'
  filler = roomy_disk / 'filler'

  def fill_when_step_4_is_written():
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
      if glob.glob(str(model_dir / 'checkpoints' / '4.orbax-checkpoint-tmp*')):
        try:
          with open(filler, 'wb') as f:
            while True:
              f.write(b'\0' * 65536)
        except OSError:
          return
      time.sleep(0.005)

  thread = threading.Thread(target=fill_when_step_4_is_written, daemon=True)
  thread.start()
  done = _train(model_dir, 6)
  thread.join()
  assert done.returncode == 1 and filler.exists()
  errors = [line for line in done.stderr.splitlines() if line.startswith('error:')]
  # The file whose write failed is named when the writer's error says it (tensorstore's
  # does, a plain write's not): which one fails first depends on timing.
  assert len(errors) == 1 and re.fullmatch(
      re.escape(f'error: Saving step 4 to {model_dir}/checkpoints failed: no space left on '
                f'device') + rf'( writing {re.escape(str(model_dir))}/checkpoints/\S+)?' +
      re.escape('; the last good checkpoint, step 2, is kept as it is. Fix: free space there '
                '(or the cause above) and restart: the run resumes from its last checkpoint.'),
      errors[0]), done.stderr[-3000:]
  for echo in ('Traceback', 'Event loop is closed', 'exception was never retrieved'):
    assert echo not in done.stderr, done.stderr[-3000:]
  filler.unlink()
  resumed = _train(model_dir, 6)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'Resuming from {model_dir}/checkpoints at step 2.' in resumed.stdout + resumed.stderr


def test_a_save_that_fails_midway_is_one_error_naming_the_step(small_disk):
  manager = CheckpointManager(small_disk / 'checkpoints', async_save=True)
  manager._check_space = lambda *args: None   # pylint: disable=protected-access  (as if unknown)
  big = {'w': np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)}  # 4 MiB
  with pytest.raises(CheckpointError) as raised:
    manager.save(7, big)
    manager.wait()
  message = str(raised.value)
  assert message.startswith(f'Saving step 7 to {small_disk}/checkpoints failed: ')
  assert 'failed: no space left on device writing ' in message and '\n' not in message
  assert 'no checkpoint was written' in message
  assert manager.all_steps() == []
