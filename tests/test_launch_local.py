"""launch/local.py's process environments, and the entry point's reading of them."""

import importlib.util
import os
import shlex
import subprocess
import sys

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
