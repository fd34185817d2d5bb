"""launch/local.py's process environments, and the entry point's reading of them."""

import importlib.util
import os
import shlex

import pytest

from upcycle import gin_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  assert gin_utils.distributed_settings({}) is None
  assert gin_utils.distributed_settings({
      'UPCYCLE_COORDINATOR_ADDRESS': '127.0.0.1:5', 'UPCYCLE_NUM_PROCESSES': '2',
      'UPCYCLE_PROCESS_ID': '1'}) == {'coordinator_address': '127.0.0.1:5', 'num_processes': 2,
                                      'process_id': 1}
  with pytest.raises(SystemExit, match='only UPCYCLE_PROCESS_ID are set'):
    gin_utils.distributed_settings({'UPCYCLE_PROCESS_ID': '1'})
