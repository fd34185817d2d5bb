"""launch/tpu_vm.py: the gcloud commands a dry run prints for Cloud TPU VM slices."""

import ast
import importlib.metadata
import importlib.util
import os
import shlex

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
import pytest

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location('tpu_vm', os.path.join(REPO, 'launch', 'tpu_vm.py'))
tpu_vm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu_vm)
WHERE = ['--name=moe', '--zone=us-central2-b', '--project=proj']


def commands(capsys, *argv):
  assert tpu_vm.main(list(argv)) == 0
  return [shlex.split(line[2:]) for line in capsys.readouterr().out.splitlines()
          if line.startswith('+ ')]


@pytest.mark.parametrize('size,workers', [(8, 1), (16, 2), (32, 4), (64, 8), (128, 16),
                                          (256, 32), (512, 64)])
def test_create_slices(capsys, size, workers):
  (create,) = commands(capsys, 'create', *WHERE, f'--accelerator_type=v4-{size}', '--spot',
                       '--dry_run')
  assert create == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'moe',
                    '--zone=us-central2-b', '--project=proj', f'--accelerator-type=v4-{size}',
                    '--version=tpu-ubuntu2204-base', '--spot']
  assert tpu_vm.num_workers(f'v4-{size}') == workers


def test_queued_resources(capsys):
  (create,) = commands(capsys, 'create', *WHERE, '--accelerator_type=v4-128', '--queued',
                       '--spot', '--dry_run')
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'moe']
  assert {'--node-id=moe', '--accelerator-type=v4-128', '--runtime-version=tpu-ubuntu2204-base',
          '--spot'} <= set(create)
  (delete,) = commands(capsys, 'delete', *WHERE, '--queued', '--dry_run')
  assert delete[3:5] == ['queued-resources', 'delete'] and '--force' in delete


@pytest.mark.parametrize('bad', ['v4-12', 'v4-4', 'v4-8192', 'v3-8x', 'tpu-8'])
def test_bad_accelerator_types_are_refused(bad):
  with pytest.raises(SystemExit, match=bad):
    tpu_vm.main(['create', *WHERE, f'--accelerator_type={bad}', '--dry_run'])


def test_train_runs_one_command_on_every_worker_at_once(capsys):
  flags = ['--gin_file=models/t5_1_1/base.gin', '--gin_file=moe/paper_t5.gin',
           "--gin.MODEL_DIR='gs://bucket/run'", '--gin.TRAIN_STEPS=1000']
  (ssh,) = commands(capsys, 'train', *WHERE, '--accelerator_type=v4-64', '--dry_run', '--',
                    *flags)
  assert ssh[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'moe']
  assert '--worker=all' in ssh
  remote = shlex.split(next(a for a in ssh if a.startswith('--command='))[len('--command='):])
  start = remote.index('.venv/bin/python')
  assert remote[start:start + 4 + len(flags)] == ['.venv/bin/python', '-m', 'upcycle.train',
                                                   *flags, '--multi_host=yes']
  # each worker logs to its own disk
  assert remote[start + 4 + len(flags):start + 6 + len(flags)] == [
      '>>', '$HOME/upcycle_logs/moe.log']


@pytest.mark.parametrize('verb,module', [('eval', 'upcycle.eval'), ('infer', 'upcycle.infer')])
def test_eval_and_infer_run_one_command_on_every_worker_at_once(capsys, verb, module):
  flags = ['--gin_file=models/t5_1_1/base.gin', f'--gin_file=runs/{verb}.gin',
           "--gin.CHECKPOINT_PATH='gs://bucket/run/checkpoints/1000'"]
  (ssh,) = commands(capsys, verb, *WHERE, '--accelerator_type=v4-32', '--run=ev', '--dry_run',
                    '--', *flags)
  assert '--worker=all' in ssh
  remote = shlex.split(next(a for a in ssh if a.startswith('--command='))[len('--command='):])
  start = remote.index('.venv/bin/python')
  assert remote[start:start + 4 + len(flags)] == ['.venv/bin/python', '-m', module, *flags,
                                                   '--multi_host=yes']
  assert '$HOME/upcycle_logs/ev.log' in remote


def test_train_with_retries_shows_how_a_preempted_vm_is_replaced(capsys):
  run = commands(capsys, 'train', *WHERE, '--accelerator_type=v4-32', '--spot', '--retries=2',
                 '--git_url=https://example.org/upcycle.git', '--git_ref=v1', '--dry_run', '--',
                 '--gin_file=models/t5_1_1/base.gin')
  verbs = [argv[3:5] for argv in run]
  assert verbs == [['tpu-vm', 'ssh'], ['tpu-vm', 'delete'], ['tpu-vm', 'create'],
                   ['tpu-vm', 'ssh']]
  assert '--spot' in run[2]
  setup = run[3][-1]
  assert 'git clone --quiet https://example.org/upcycle.git ~/upcycle' in setup
  assert "pip install -q 'jax[tpu]==0.10.2'" in setup


def test_setup_copies_this_checkout_to_every_worker(capsys):
  archive, scp, install = commands(capsys, 'setup', *WHERE, f'--source={REPO}', '--dry_run')
  assert archive[:3] == ['git', '-C', REPO] and 'HEAD' in archive
  assert scp[3:5] == ['tpu-vm', 'scp'] and '--worker=all' in scp
  assert '--worker=all' in install and '.venv/bin/pip install -q -e .' in install[-1]


def _setup_keywords():
  """The literal keyword arguments of setup.py's `setuptools.setup(...)` call."""
  tree = ast.parse(open(os.path.join(REPO, 'setup.py')).read())
  call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call))
  return {k.arg: ast.literal_eval(k.value) for k in call.keywords
          if k.arg in ('python_requires', 'install_requires')}


def test_the_workers_python_is_one_every_pin_accepts():
  keywords = _setup_keywords()
  assert tpu_vm.PYTHON in SpecifierSet(keywords['python_requires'])
  assert '3.10' not in SpecifierSet(keywords['python_requires'])   # tpu-ubuntu2204-base's
  for pin in keywords['install_requires']:
    requires = importlib.metadata.metadata(Requirement(pin).name).get('Requires-Python')
    assert tpu_vm.PYTHON in SpecifierSet(requires or ''), (pin, requires)


@pytest.mark.parametrize('accelerator', ['v4-8', 'v4-64'])
def test_setup_installs_that_python_on_every_worker_and_train_runs_it(capsys, accelerator):
  where = [*WHERE, f'--accelerator_type={accelerator}', '--dry_run']
  *_, install = commands(capsys, 'setup', *where, f'--source={REPO}')
  assert '--worker=all' in install
  steps = install[-1][len('--command='):].split(' && ')
  assert steps[steps.index('cd ~/upcycle'):] == [
      'cd ~/upcycle', 'python3 -m pip install -q --user uv==0.13.8',
      '~/.local/bin/uv venv -q --seed --python=3.11 .venv', '.venv/bin/pip install -q -e .',
      ".venv/bin/pip install -q 'jax[tpu]==0.10.2'"]
  (train,) = commands(capsys, 'train', *where, '--', '--gin_file=models/t5_1_1/base.gin')
  remote = shlex.split(train[-1][len('--command='):])
  assert remote[remote.index('cd') + 1] == '~/upcycle' and '.venv/bin/python' in remote


def test_train_without_flags_says_what_to_give():
  with pytest.raises(SystemExit, match='after `--`'):
    tpu_vm.main(['train', *WHERE, '--dry_run'])


def test_logs_and_ssh(capsys):
  (logs,) = commands(capsys, 'logs', *WHERE, '--worker=3', '--follow', '--dry_run')
  assert '--worker=3' in logs and logs[-1] == '--command=tail -n 100 -F $HOME/upcycle_logs/moe.log'
  (ssh,) = commands(capsys, 'ssh', *WHERE, '--dry_run')
  assert ssh[-1] == '--worker=0'
