"""A run that fails before its first step ends in one line and leaves no MODEL_DIR it created
behind: train's main in this process, or a real `python -m upcycle.train` process where the
whole process matters (a failed initializer's background threads; TFDS, which reads
TFDS_DATA_DIR at import)."""

import os
import shutil
import subprocess

import pytest

from tests.helpers import REPO, refusal
from tests.train.helpers import ONE_DEVICE_ENV, train_command
from upcycle.train import __main__ as train_main
from upcycle.train import run_lock


def _stderr_lines(done):
  """stderr without the native libraries' start-up lines (oneDNN, CUDA probing)."""
  return [line for line in done.stderr.splitlines()
          if line.strip() and not line.startswith(('I0000', 'E0000', 'W0000', 'WARNING'))]


@pytest.mark.parametrize('binding, error', [
    ("--gin.models.T5Config.d_model='64'",
     "error: models.T5Config.d_model = '64': expected an integer >= 1."),
    ('--gin.models.T5Config.dropout_rate=1.5',
     'error: models.T5Config.dropout_rate = 1.5: expected a number in [0, 1).'),
])
def test_a_wrong_model_binding_names_it_in_one_line_and_creates_no_model_dir(
    tmp_path, binding, error, entry_points, capsys):
  """train's main in this process (`refusal`: one line, no traceback)."""
  model_dir = tmp_path / 'run'
  argv = train_command(model_dir, 2)[3:] + [binding]   # without `python -m upcycle.train`
  assert refusal(train_main.main, argv, capsys) == error
  assert not model_dir.exists()


@pytest.mark.slow
def test_a_failed_initializer_ends_in_one_line_and_leaves_no_model_dir(tmp_path):
  model_dir = tmp_path / 'run'
  command = [arg.replace('runs/pretrain.gin', 'runs/upcycle.gin')
             for arg in train_command(model_dir, 2)] + [
      '--gin_file=moe/paper_t5.gin', '--gin.NUM_EXPERTS=2',
      f"--gin.INITIAL_CHECKPOINT_PATH='{tmp_path}/missing'"]
  done = subprocess.run(command, cwd=REPO, env=ONE_DEVICE_ENV, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 1
  lines = _stderr_lines(done)
  assert lines[0].startswith(f'error: {tmp_path}/missing: unknown checkpoint format.'), lines
  # Nothing after it (the orbax thread's 35-line traceback was), but gin's note at most.
  assert all(line.startswith("  In call to configurable 'train'") for line in lines[1:]), lines
  assert not model_dir.exists()


def test_a_failed_start_keeps_a_model_dir_it_did_not_create(tmp_path):
  mine = tmp_path / 'mine'
  mine.mkdir()
  for model_dir in (mine, tmp_path / 'new' / 'run'):
    with pytest.raises(RuntimeError), run_lock.hold(str(model_dir)):
      os.makedirs(model_dir / 'checkpoints')
      raise RuntimeError('the initializer failed')
  assert sorted(os.listdir(mine)) == ['checkpoints', run_lock.LOCK_FILE]
  assert sorted(os.listdir(tmp_path)) == ['mine']   # new/run/ and new/ were this run's


@pytest.mark.slow
def test_a_gin_order_that_picks_c4_names_the_task_and_where_it_reads(tmp_path):
  """data/ before runs/: runs/pretrain.gin sets MIXTURE_OR_TASK_NAME back to C4."""
  model_dir = tmp_path / 'run'
  command = train_command(model_dir, 2)
  data = command.index('--gin_file=data/offline_span_corruption.gin')
  command.insert(data - 1, command.pop(data))   # before --gin_file=runs/pretrain.gin
  done = subprocess.run(command, cwd=REPO,
                        env={**ONE_DEVICE_ENV, 'TFDS_DATA_DIR': str(tmp_path / 'tfds')},
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 1
  error = _stderr_lines(done)[-1]   # after TFDS's own Beam warning
  assert error.startswith(f'error: task c4_span_corruption reads TFDS c4/en:3.1.0 from '
                          f'TFDS_DATA_DIR={tmp_path}/tfds, which failed to load ('), error
  assert error.endswith(
      f'Fix: it is built with Apache Beam (`tfds build c4/en:3.1.0 --data_dir={tmp_path}/tfds` '
      "where apache-beam and TFDS's extras for c4 are installed; C4 downloads ~7 TB of Common "
      f"Crawl), or pass --tfds_data_dir=<where it is prepared>; or use the offline task "
      f"'offline_span_corruption' (--gin.MIXTURE_OR_TASK_NAME=\"'offline_span_corruption'\", "
      f'or --gin_file=data/offline_span_corruption.gin after the runs/ file: the last gin file '
      f'that sets MIXTURE_OR_TASK_NAME decides the task).')
  assert 'Traceback' not in done.stderr
  assert not model_dir.exists()


@pytest.mark.slow
def test_a_train_steps_below_the_saved_step_is_refused_and_the_config_kept(dense_t5_run,
                                                                          tmp_path):
  # pylint: disable=g-import-not-at-top
  from upcycle import fields
  from upcycle.models import T5
  from upcycle.train.objectives import Seq2Seq
  from upcycle.train.optimizers import Adafactor
  from upcycle.train.trainer import Trainer, TrainConfig
  from tests.train.helpers import TRAINING_T5, text
  # pylint: enable=g-import-not-at-top
  source, _ = dense_t5_run   # 30 steps
  run = tmp_path / 'run'
  shutil.copytree(source, run)
  config = TrainConfig(str(run), train_steps=10, batch_size=8, async_checkpoints=False)
  trainer = Trainer(Seq2Seq(T5(TRAINING_T5)), Adafactor(), config, text('train'))
  with pytest.raises(fields.ConfigError, match=r'is at step 30, past TRAIN_STEPS = 10 .*'
                                               r'Fix: --gin.TRAIN_STEPS=30 or more'):
    trainer.run(on_start=lambda: (run / 'config.gin').write_text('rewritten'))
  assert not (run / 'config.gin').exists()   # on_start (config.gin's writer) never ran
