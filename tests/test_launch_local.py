"""launch/local.py's process environments, and the entry point's reading of them."""

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from upcycle import distributed

_spec = importlib.util.spec_from_file_location('local', os.path.join(REPO, 'launch', 'local.py'))
local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(local)


def test_dry_run_prints_one_command_per_process(capsys):
  assert local.main(['--num_processes=3', '--devices_per_process=2', '--dry_run', '--',
                     '--gin_file=x.gin']) == 0
  lines = [shlex.split(l[2:]) for l in capsys.readouterr().out.splitlines()]
  assert len(lines) == 3
  for i, words in enumerate(lines):
    env = dict(w.split('=', 1) for w in words if '=' in w and not w.startswith('-'))
    assert env['UPCYCLE_PROCESS_ID'] == str(i) and env['UPCYCLE_NUM_PROCESSES'] == '3'
    assert env['XLA_FLAGS'] == '--xla_force_host_platform_device_count=2'
    assert env['UPCYCLE_COORDINATOR_ADDRESS'].startswith('127.0.0.1:')
    assert words[-3:] == ['-m', 'upcycle.train', '--gin_file=x.gin']


def test_distributed_settings_from_the_environment():
  assert distributed.settings({}) is None
  assert distributed.settings({
      'UPCYCLE_COORDINATOR_ADDRESS': '127.0.0.1:5', 'UPCYCLE_NUM_PROCESSES': '2',
      'UPCYCLE_PROCESS_ID': '1'}) == {'coordinator_address': '127.0.0.1:5', 'num_processes': 2,
                                      'process_id': 1}
  with pytest.raises(SystemExit, match='only UPCYCLE_PROCESS_ID are set'):
    distributed.settings({'UPCYCLE_PROCESS_ID': '1'})


# A stand-in for `python -m upcycle.train` (launch/local.py --module). 'killed': process 1 is
# SIGKILLed and process 0, in a collective with it, fails with status 1 right after it.
# 'crashes': process 1 fails at start and process 0 waits for it until stopped, then dies with
# a fatal-error stack, as JAX does.
WORKER = r'''
import fcntl, os, signal, sys, time
here = lambda name: os.path.join(os.environ['LOCK_DIR'], name)
def wait_for(name):
  while not os.path.exists(here(name)):
    time.sleep(0.01)
lock = open(here('peer.lock'), 'a+')
if os.environ['UPCYCLE_PROCESS_ID'] == '1':
  fcntl.flock(lock, fcntl.LOCK_EX)
  open(here('1'), 'w').close()
  wait_for('0')
  print('process 1 started', flush=True)
  if os.environ['HOW'] == 'killed':
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
  print('error: process 1 cannot read its data shard', flush=True)
  os._exit(1)
signal.signal(signal.SIGTERM, lambda *_: sys.exit('F0000 fatal-error stack of process 0'))
wait_for('1')
print('process 0 started', flush=True)
open(here('0'), 'w').close()
if os.environ['HOW'] == 'killed':
  fcntl.flock(lock, fcntl.LOCK_EX)   # free the moment process 1 is dead, reaped or not
  time.sleep(0.05)   # JAX's time to fail a collective (the launcher polled every 0.2 s)
  os._exit(1)
time.sleep(60)
'''


@pytest.mark.parametrize('how, status, said', [
    ('killed', 128 + 9, 'process 1 was killed by SIGKILL'),
    ('crashes', 1, 'process 1 exited with status 1'),
])
def test_the_first_process_to_fail_is_named_and_the_others_stop_quietly(tmp_path, how, status,
                                                                       said):
  (tmp_path / 'worker.py').write_text(WORKER)
  env = {**os.environ, 'PYTHONPATH': str(tmp_path), 'LOCK_DIR': str(tmp_path), 'HOW': how}
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--num_processes=2',
       '--module=worker', f'--log_dir={tmp_path}/logs', '--grace_seconds=5'],
      env=env, capture_output=True, text=True, timeout=60)
  assert done.returncode == status
  assert done.stderr.splitlines()[-1] == (
      f'launch/local.py: {said}; stopping the other 1 process(es) so that none waits for it '
      f'forever.')
  assert '[process 0] process 0 started' in done.stdout
  assert 'F0000' not in done.stdout + done.stderr   # the others were stopped quietly
  if how == 'crashes':
    assert done.stdout.splitlines()[-1] == '[process 1] error: process 1 cannot read its data shard'
    assert 'F0000 fatal-error stack' in (tmp_path / 'logs' / 'process_0.log').read_text()


# A stand-in for a training process: gloo's connection report, then, on SIGTERM, what
# train/preemption.py says of the step it saved.
SAVING_WORKER = r'''
import os, signal, sys, time
index = os.environ['UPCYCLE_PROCESS_ID']
def saved(*_):
  print(f'Stopped at step 4 on SIGTERM, with step 4 saved (process {index})', flush=True)
  sys.exit(143)
signal.signal(signal.SIGTERM, saved)
print(f'[Gloo] Rank {index} is connected to 1 peer ranks. Expected number of connected peer '
      'ranks is : 1', flush=True)
# two threads' reports, their words mixed (as a real run printed them)
print(f'[Gloo] Rank {index} is connected to [Gloo] Rank {index}1 is connected to  peer ranks. '
      '1Expected number of connected peer ranks is :  peer ranks. 1Expected number of connected '
      'peer ranks is : \n1', flush=True)
open(os.path.join(os.environ['LOCK_DIR'], index), 'w').close()
if os.environ.get('HOW') == 'one is stopped' and index == '1':
  while not os.path.exists(os.path.join(os.environ['LOCK_DIR'], '0')):
    time.sleep(0.01)
  os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
'''


@pytest.mark.parametrize('how, status, said', [
    ('the launcher is stopped', 130, 'interrupted; stopped every process.'),
    ('one is stopped', 143, 'process 1 stopped on SIGTERM (exit status 143); stopped the other 1 '
                            'process(es) too.'),
])
def test_a_stop_shows_each_process_s_saved_step_and_logs_gloo_only(tmp_path, how, status, said):
  """As a preemption: SIGTERM to the launcher, or to one process (JAX's preemption service
  then stops every process at one step)."""
  (tmp_path / 'worker.py').write_text(SAVING_WORKER)
  env = {**os.environ, 'PYTHONPATH': str(tmp_path), 'LOCK_DIR': str(tmp_path), 'HOW': how}
  launcher = subprocess.Popen(
      [sys.executable, os.path.join(REPO, 'launch', 'local.py'), '--num_processes=2',
       '--module=worker', f'--log_dir={tmp_path}/logs', '--grace_seconds=5'],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if how == 'the launcher is stopped':
    deadline = time.time() + 60
    while not all((tmp_path / i).exists() for i in '01') and time.time() < deadline:
      time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    launcher.send_signal(signal.SIGTERM)   # a second one changes nothing
  out, err = launcher.communicate(timeout=60)
  assert launcher.returncode == status
  assert sorted(out.splitlines()) == [
      f'[process {i}] Stopped at step 4 on SIGTERM, with step 4 saved (process {i})'
      for i in '01']
  assert err.splitlines()[-1] == f'launch/local.py: {said}'
  for i in '01':
    assert (tmp_path / 'logs' / f'process_{i}.log').read_text().startswith(f'[Gloo] Rank {i} ')


# What two real processes printed (process_<i>.log), and lines a run prints besides.
GLOO_LINES = [
    '[Gloo] Rank 0[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer '
    'ranks is : 1\n',
    ' is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n',
    '[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n',
]


def test_gloo_reports_are_told_from_a_run_s_own_lines():
  continued = False
  for line in GLOO_LINES:
    continued = local.gloo_report(line, continued)
    assert continued, line
  assert local.gloo_report('1\n', continued=True)          # the end of a torn report
  for line in ('1\n', 'train step 3/3 | loss 4.101 | accuracy 0.1562\n', '\n',
               'Saved step 3 to /tmp/run/checkpoints/3 in 3.1 s.\n',
               'error: 2 peer ranks is what gloo expected\n'):
    assert not local.gloo_report(line, continued=False), line
