"""The package as a wheel: built offline from setup.py, upcycle/ and configs/ alone, installed
(not editable) into a fresh virtualenv, run from outside the repository: the CLIs' --help and
one tiny training step with the gin files the wheel carries."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def _run(argv, **kwargs):
  return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """(python of a fresh virtualenv holding only the wheel, a working directory outside the
  repository, the environment to run it in)."""
  root = tmp_path_factory.mktemp('wheel')
  source = root / 'source'   # the build writes build/ and *.egg-info beside setup.py
  for name in ('upcycle', 'configs'):
    shutil.copytree(os.path.join(REPO, name), source / name,
                    ignore=shutil.ignore_patterns('__pycache__'))
  shutil.copy(os.path.join(REPO, 'setup.py'), source)
  built = _run([sys.executable, '-m', 'pip', 'wheel', '--no-build-isolation', '--no-deps',
                '--no-index', f'--wheel-dir={root / "dist"}', str(source)])
  assert built.returncode == 0, built.stderr
  (wheel,) = (root / 'dist').iterdir()
  venv = root / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
  python = str(venv / 'bin' / 'python')
  site = _run([python, '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'])
  # The pinned dependencies come from the test environment's site-packages, added as a plain
  # path: its .pth files (the editable install of this checkout among them) are not run.
  with open(os.path.join(site.stdout.strip(), 'dependencies.pth'), 'w') as f:
    f.write(sysconfig.get_path('purelib') + '\n')
  install = _run([python, '-m', 'pip', 'install', '--no-deps', '--no-index', '--ignore-installed',
                  str(wheel)])
  assert install.returncode == 0, install.stderr
  work = root / 'work'
  work.mkdir()
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0'
  return python, work, env


@pytest.mark.slow
def test_the_wheel_holds_the_trainer_and_the_gin_files(installed):
  python, work, env = installed
  where = _run([python, '-c', 'import upcycle.train.trainer, upcycle.gin_utils as g; '
                              'print(upcycle.train.trainer.__file__); print(g.CONFIGS_DIR)'],
               cwd=work, env=env)
  assert where.returncode == 0, where.stderr
  trainer, configs = where.stdout.split()
  package = os.path.join(os.path.dirname(os.path.dirname(python)), 'lib')
  assert trainer.startswith(package) and trainer.endswith('upcycle/train/trainer.py')
  assert configs.startswith(package) and configs.endswith('upcycle/configs')
  assert os.path.isfile(os.path.join(configs, 'runs', 'upcycle.gin'))


@pytest.mark.slow
@pytest.mark.parametrize('cli,flag', [('train', '--gin_file'), ('convert', '--source'),
                                      ('eval', '--gin_file'), ('export', '--model_dir')])
def test_cli_help_from_the_wheel(installed, cli, flag):
  python, work, env = installed
  done = _run([python, '-m', f'upcycle.{cli}', '--help'], cwd=work, env=env)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith('usage: ') and flag in done.stdout
  assert 'Traceback' not in done.stderr


@pytest.mark.slow
def test_one_training_step_from_the_wheel(installed):
  python, work, env = installed
  model_dir = work / 'run'
  done = _run([python, '-m', 'upcycle.train', '--gin_file=models/t5_1_1/tiny.gin',
               '--gin_file=runs/pretrain.gin', '--gin_file=data/offline_span_corruption.gin',
               f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=1', '--gin.BATCH_SIZE=8',
               "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
               '--gin.models.T5Config.num_encoder_layers=1',
               '--gin.models.T5Config.num_decoder_layers=1', '--gin.train.eval_data=None'],
              cwd=work, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  (row,) = [json.loads(line) for line in open(model_dir / 'metrics.jsonl')]
  assert row['step'] == 1 and row['split'] == 'train' and 0 < row['loss'] < 10
  assert 'num_encoder_layers = 1' in (model_dir / 'operative_config.gin').read_text()
