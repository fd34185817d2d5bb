"""launch/tpu_vm.py for real, against a fake `gcloud` on PATH: it records every call, answers
`describe` and `create` from canned replies, runs `tpu-vm ssh --command=...` job commands
(start, status, stop, logs) with bash in a fake worker home, copies `gcloud storage cp` into a
local folder, and `tpu-vm delete` ends the fake worker's jobs, as deleting the VM would."""

import glob
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import types

import pytest

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location('tpu_vm', os.path.join(REPO, 'launch', 'tpu_vm.py'))
tpu_vm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu_vm)
WHERE = ['--name=moe', '--zone=us-central2-b', '--project=proj']
HOST = socket.gethostname()

FAKE_GCLOUD = '''#!{python}
import json, os, shutil, signal, subprocess, sys
argv, fake = sys.argv[1:], os.environ['FAKE_GCLOUD']
with open(os.path.join(fake, 'calls.jsonl'), 'a') as f:
  f.write(json.dumps(argv) + '\\n')
command = next((a[len('--command='):] for a in argv if a.startswith('--command=')), None)
if argv[:2] == ['storage', 'cp']:
  target = os.path.join(fake, 'gcs', argv[3][len('gs://'):])
  os.makedirs(os.path.dirname(target), exist_ok=True)
  shutil.copy(os.path.expandvars(argv[2]), target)
elif command is not None and 'upcycle_logs' in command:
  sys.exit(subprocess.run(['bash', '-c', command]).returncode)
elif 'delete' in argv:   # the VM goes, and its jobs with it
  logs = os.path.expanduser('~/upcycle_logs')
  for name in os.listdir(logs) if os.path.isdir(logs) else []:
    if name.endswith('.pid'):
      try:
        os.killpg(int(open(os.path.join(logs, name)).read()), signal.SIGKILL)
      except (ProcessLookupError, ValueError):
        pass
  shutil.rmtree(logs, ignore_errors=True)
else:
  with open(os.path.join(fake, 'replies.json')) as f:
    replies = json.load(f)
  key = next((k for k in replies if all(word in argv for word in k.split())), None)
  if key is not None:
    reply = replies[key][0]
    if len(replies[key]) > 1:
      replies[key].pop(0)
      with open(os.path.join(fake, 'replies.json'), 'w') as f:
        json.dump(replies, f)
    sys.stdout.write(reply.get('out', ''))
    sys.stderr.write(reply.get('err', ''))
    sys.exit(reply.get('code', 0))
'''

# The worker's `.venv/bin/python`: prints its arguments, then runs for FAKE_JOB_SECONDS and
# exits with FAKE_JOB_EXIT.
FAKE_TRAINER = '''#!/bin/bash
echo "trainer $* TFDS_DATA_DIR=$TFDS_DATA_DIR"
sleep "${FAKE_JOB_SECONDS:-0}"
echo "trainer done"
exit "${FAKE_JOB_EXIT:-0}"
'''


class Fake:
  """The fake gcloud's folder: its canned replies, its record of calls, its 'GCS'."""

  def __init__(self, path):
    self.path = path

  def reply(self, replies=None):
    """{'tpu-vm describe': [{'out': 'READY\\n'}], ...}: the first key whose words are all in
    the argv answers, with its replies in order, the last one again and again."""
    with open(os.path.join(self.path, 'replies.json'), 'w') as f:
      json.dump(replies or {}, f)

  def calls(self):
    with open(os.path.join(self.path, 'calls.jsonl')) as f:
      return [json.loads(line) for line in f]

  def gcs(self, url):
    with open(os.path.join(self.path, 'gcs', url[len('gs://'):])) as f:
      return f.read()


def clock(monkeypatch, sleep):
  """The launcher's waits (only its own) go to `sleep`."""
  monkeypatch.setattr(tpu_vm, 'time', types.SimpleNamespace(time=time.time, sleep=sleep))


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
  fake, home, bin_dir = tmp_path / 'fake', tmp_path / 'home', tmp_path / 'bin'
  for d in (fake, home / 'upcycle' / '.venv' / 'bin', bin_dir):
    d.mkdir(parents=True)
  (bin_dir / 'gcloud').write_text(FAKE_GCLOUD.format(python=sys.executable))
  (home / 'upcycle' / '.venv' / 'bin' / 'python').write_text(FAKE_TRAINER)
  for script in (bin_dir / 'gcloud', home / 'upcycle' / '.venv' / 'bin' / 'python'):
    script.chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('HOME', str(home))
  monkeypatch.setenv('FAKE_GCLOUD', str(fake))
  clock(monkeypatch, lambda seconds: time.sleep(min(seconds, 0.2)))
  result = Fake(str(fake))
  result.reply()
  result.home = home
  yield result
  for pid_file in glob.glob(str(home / 'upcycle_logs' / '*.pid')):   # the jobs this test started
    try:
      os.killpg(int(open(pid_file).read()), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass


def _wait_for(condition, seconds=10.0):
  deadline = time.time() + seconds
  while not condition():
    assert time.time() < deadline, 'timed out'
    time.sleep(0.05)


def _running(pid):
  """The process exists and is not a zombie (this machine's init may not reap orphans)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def _log(home, run='moe'):
  path = home / 'upcycle_logs' / f'{run}.log'
  return path.read_text() if path.exists() else ''


def test_train_starts_the_job_detached_and_status_logs_stop_follow_it(gcloud, monkeypatch, capfd):
  monkeypatch.setenv('FAKE_JOB_SECONDS', '60')
  began = time.time()
  assert tpu_vm.main(['train', *WHERE, '--tfds_data_dir=gs://data/tfds', '--',
                      '--gin_file=models/t5_1_1/base.gin']) == 0
  assert time.time() - began < 10   # returned while the 60 s job runs on
  (start,) = gcloud.calls()
  assert start[:6] == ['compute', 'tpus', 'tpu-vm', 'ssh', 'moe', '--zone=us-central2-b']
  assert '--worker=all' in start and 'setsid nohup bash -c upcycle_job' in start[-1]
  _wait_for(lambda: 'trainer' in _log(gcloud.home))
  assert _log(gcloud.home) == ('trainer -m upcycle.train --gin_file=models/t5_1_1/base.gin '
                               'TFDS_DATA_DIR=gs://data/tfds\n')   # v4-8: no --multi_host
  pid = int((gcloud.home / 'upcycle_logs' / 'moe.pid').read_text())
  assert _running(pid)   # after the launcher returned
  capfd.readouterr()

  assert tpu_vm.main(['status', *WHERE]) == 0
  out = capfd.readouterr().out
  assert f'upcycle-job moe {HOST} running\ntrainer -m upcycle.train' in out
  with pytest.raises(SystemExit, match='exit code 3'):   # one job per run name at a time
    tpu_vm.main(['train', *WHERE, '--', '--gin_file=models/t5_1_1/base.gin'])
  assert 'moe is already running on' in capfd.readouterr().err

  assert tpu_vm.main(['logs', *WHERE, '--no-follow', '--lines=1']) == 0
  assert capfd.readouterr().out.endswith('\ntrainer -m upcycle.train --gin_file=models/t5_1_1/'
                                         'base.gin TFDS_DATA_DIR=gs://data/tfds\n')
  assert gcloud.calls()[-1][-1] == '--command=tail -n 1 $HOME/upcycle_logs/moe.log'
  assert tpu_vm.main(['logs', *WHERE, '--dry_run']) == 0   # reattaches: tail -F
  assert capfd.readouterr().out.endswith("'--command=tail -n 100 -F $HOME/upcycle_logs/moe.log'\n")

  assert tpu_vm.main(['stop', *WHERE]) == 0
  assert f'stopped moe on {HOST}' in capfd.readouterr().out
  assert not _running(pid)
  tpu_vm.main(['status', *WHERE, '--lines=0'])
  assert capfd.readouterr().out.strip().splitlines()[-1] == f'upcycle-job moe {HOST} stopped'


# A trainer whose SIGTERM handler saves for 3 s before it exits, as train/preemption.py does.
SAVING_TRAINER = '''#!/bin/bash
trap 'sleep 3; echo "saved at SIGTERM"; exit 143' TERM
echo "trainer started"
sleep 60 & wait $!
'''


def test_stop_waits_for_the_trainer_to_finish_saving(gcloud, capfd):
  (gcloud.home / 'upcycle' / '.venv' / 'bin' / 'python').write_text(SAVING_TRAINER)
  assert tpu_vm.main(['train', *WHERE, '--', '--gin_file=x.gin']) == 0
  _wait_for(lambda: 'trainer started' in _log(gcloud.home))
  began = time.time()
  assert tpu_vm.main(['stop', *WHERE]) == 0
  assert time.time() - began >= 3   # the wrapper died at once; stop waited for the group
  assert _log(gcloud.home).endswith('trainer started\nsaved at SIGTERM\n')
  assert f'stopped moe on {HOST}' in capfd.readouterr().out


def test_a_finished_job_leaves_its_status_and_its_log_in_model_dir_logs(gcloud, capfd):
  assert tpu_vm.main(['train', *WHERE, '--run=r1', '--',
                      "--gin.MODEL_DIR='gs://bucket/run'"]) == 0
  _wait_for(lambda: (gcloud.home / 'upcycle_logs' / 'r1.exit').exists())
  assert (gcloud.home / 'upcycle_logs' / 'r1.exit').read_text() == 'exit=0\n'
  assert gcloud.gcs(f'gs://bucket/run/logs/r1-{HOST}.log') == _log(gcloud.home, 'r1')
  assert _log(gcloud.home, 'r1').endswith('trainer done\n')
  capfd.readouterr()
  tpu_vm.main(['status', *WHERE, '--run=r1', '--lines=0'])
  assert capfd.readouterr().out.strip().splitlines()[-1] == f'upcycle-job r1 {HOST} exit=0'


def test_retries_replace_a_preempted_slice_and_start_the_job_again(gcloud, monkeypatch, capfd):
  monkeypatch.setenv('FAKE_JOB_SECONDS', '0.3')
  gcloud.reply({'tpu-vm describe': [{'out': 'PREEMPTED\n'}, {'out': 'READY\n'}]})
  assert tpu_vm.main(['train', *WHERE, '--spot', '--retries=2', '--poll_seconds=0',
                      '--retry_wait=0', '--git_url=https://example.org/u.git', '--',
                      '--gin_file=x.gin']) == 0
  verbs = [' '.join(argv[2:4]) for argv in gcloud.calls()]
  assert verbs[:7] == ['tpu-vm ssh',                                      # start
                       'tpu-vm describe',                                 # PREEMPTED
                       'tpu-vm delete', 'tpu-vm create', 'tpu-vm describe',   # READY
                       'tpu-vm ssh', 'tpu-vm ssh']                        # setup, start again
  # then, while READY, the job's state on every worker until it is exit=0 on all of them
  assert verbs[7:] == ['tpu-vm describe', 'tpu-vm ssh'] * (len(verbs[7:]) // 2)
  assert '--spot' in gcloud.calls()[3]
  assert 'moe is PREEMPTED: replacing it (retry 1 of 2).' in capfd.readouterr().out
  assert _log(gcloud.home).count('trainer done') == 1   # the log of the new VM's run


def test_a_job_that_fails_on_a_healthy_slice_is_stopped_not_retried(gcloud, monkeypatch):
  monkeypatch.setenv('FAKE_JOB_EXIT', '3')
  gcloud.reply({'tpu-vm describe': [{'out': 'READY\n'}]})
  with pytest.raises(SystemExit) as failed:
    tpu_vm.main(['train', *WHERE, '--retries=2', '--poll_seconds=0.5', '--', '--gin_file=x.gin'])
  assert str(failed.value) == (
      f'moe failed: {HOST} exit=3 on a healthy slice (READY): see $HOME/upcycle_logs/moe.log '
      '(`logs --worker=N`). Not retried: this is not a preemption.')
  assert 'delete' not in {word for argv in gcloud.calls() for word in argv}


def test_a_queued_request_is_polled_until_active(gcloud):
  gcloud.reply({'queued-resources describe': [
      {'out': 'WAITING_FOR_RESOURCES\n'}, {'out': 'PROVISIONING\n'}, {'out': 'ACTIVE\n'}]})
  assert tpu_vm.main(['create', *WHERE, '--accelerator_type=v4-128', '--queued', '--spot',
                      '--valid_until=6h', '--poll_seconds=0']) == 0
  create, *polls = gcloud.calls()
  assert create == ['compute', 'tpus', 'queued-resources', 'create', 'moe', '--node-id=moe',
                    '--zone=us-central2-b', '--project=proj', '--accelerator-type=v4-128',
                    '--runtime-version=tpu-ubuntu2204-base', '--spot',
                    '--valid-until-duration=6h']
  assert polls == [['compute', 'tpus', 'queued-resources', 'describe', 'moe',
                    '--zone=us-central2-b', '--project=proj', '--format=value(state.state)']] * 3


def test_a_failed_queued_request_stops_with_the_reason(gcloud):
  gcloud.reply({
      'queued-resources describe --format=value(state.state)': [
          {'out': 'WAITING_FOR_RESOURCES\n'}, {'out': 'FAILED\n'}],
      'queued-resources describe': [
          {'out': 'SERVICE\tvalid_until_time passed before resources were found\n'}]})
  with pytest.raises(SystemExit) as stopped:
    tpu_vm.main(['create', *WHERE, '--queued', '--poll_seconds=0'])
  assert str(stopped.value) == (
      'queued resource moe is FAILED (SERVICE valid_until_time passed before resources were '
      'found): delete it (delete --queued) and create it again, in another zone or with a '
      'longer --valid_until.')
  assert len(gcloud.calls()) == 4   # create, 2 polls, the reason: no polling for hours


def test_no_capacity_backs_off_doubling_up_to_a_cap(gcloud, monkeypatch):
  no_capacity = {'code': 1, 'err': 'ERROR: (gcloud.compute.tpus.tpu-vm.create) {"code": 8, '
                                   '"message": "There is no more capacity in the zone"}\n'}
  gcloud.reply({'tpu-vm create': [no_capacity] * 8 + [{}],
                'tpu-vm describe': [{'out': 'READY\n'}]})
  waits = []
  clock(monkeypatch, waits.append)
  assert tpu_vm.main(['create', *WHERE, '--spot']) == 0
  assert waits == [30, 60, 120, 240, 480, 960, 1800, 1800]
  gcloud.reply({'tpu-vm create': [{'code': 1, 'err': 'ERROR: Quota limit TPUV4sPerProjectPerZone '
                                                     'exceeded (RESOURCE_EXHAUSTED)\n'}]})
  with pytest.raises(SystemExit, match='^create moe failed: ERROR: Quota limit'):
    tpu_vm.main(['create', *WHERE])


def test_setup_ships_head_and_names_what_it_leaves_behind(gcloud, tmp_path, capsys,
                                                         monkeypatch):
  source = tmp_path / 'checkout'
  source.mkdir()
  git = ['git', '-C', str(source), '-c', 'user.name=t', '-c', 'user.email=t@t']
  subprocess.run(git[:3] + ['init', '-q'], check=True)
  (source / 'a.py').write_text('committed\n')
  (source / '.gitignore').write_text('ignored/\n')
  subprocess.run(git + ['add', '.'], check=True)
  subprocess.run(git + ['commit', '-q', '-m', 'first'], check=True)
  (source / 'a.py').write_text('edited\n')
  (source / 'new.py').write_text('untracked\n')
  (source / 'ignored').mkdir()
  (source / 'ignored' / 'big.bin').write_text('x')
  archive = str(tmp_path / 'code.tar.gz')
  monkeypatch.setattr(tpu_vm, 'ARCHIVE', archive)

  assert tpu_vm.main(['setup', *WHERE, f'--source={source}']) == 0
  out, err = capsys.readouterr()
  assert f'# ships HEAD of {source} (' in out and ' first): committed files only' in out
  assert err == ('# warning: 2 uncommitted change(s) do not ship: a.py, new.py; commit them or '
                 'pass --ship_worktree\n')
  with tarfile.open(archive) as tar:
    assert sorted(tar.getnames()) == ['.gitignore', 'a.py']
    assert tar.extractfile('a.py').read() == b'committed\n'

  assert tpu_vm.main(['setup', *WHERE, f'--source={source}', '--ship_worktree']) == 0
  assert (f'# ships the working tree of {source} as it is: 3 files, 2 of them with uncommitted '
          'changes') in capsys.readouterr().out
  with tarfile.open(archive) as tar:
    assert sorted(tar.getnames()) == ['.gitignore', 'a.py', 'new.py']
    assert tar.extractfile('a.py').read() == b'edited\n'
  scp = gcloud.calls()[-2]
  assert scp[2:4] == ['tpu-vm', 'scp'] and scp[4] == archive


def test_identity_network_and_data_flags_reach_create_and_the_job(capsys):
  flags = ['--service_account=sa@proj.iam.gserviceaccount.com', '--scopes=cloud-platform',
           '--network=net', '--subnetwork=sub']
  expected = ['--service-account=sa@proj.iam.gserviceaccount.com', '--scopes=cloud-platform',
              '--network=net', '--subnetwork=sub']
  for queued in ([], ['--queued']):
    tpu_vm.main(['create', *WHERE, *flags, *queued, '--dry_run'])
    create = capsys.readouterr().out.splitlines()[0]
    assert create.endswith(' '.join(expected)), create
  tpu_vm.main(['train', *WHERE, '--accelerator_type=v4-64', '--tfds_data_dir=gs://b/tfds',
               '--dry_run', '--', '--gin_file=x.gin'])
  start = capsys.readouterr().out
  assert ('TF_CPP_MIN_LOG_LEVEL=3 TFDS_DATA_DIR=gs://b/tfds .venv/bin/python -m upcycle.train '
          '--gin_file=x.gin --multi_host=yes >>') in start   # v4-64: 8 workers join
  tpu_vm.main(['train', *WHERE, '--accelerator_type=v4-64', '--dry_run', '--',
               '--gin_file=x.gin', '--multi_host=no'])
  assert '--multi_host=no >>' in capsys.readouterr().out   # the user's choice stands


def test_flags_create_does_not_take_are_refused_with_the_fix():
  with pytest.raises(SystemExit, match=r'^--preemptible: queued resources take --spot'):
    tpu_vm.main(['create', *WHERE, '--queued', '--preemptible', '--dry_run'])
  with pytest.raises(SystemExit, match=r'^--valid_until: .* add --queued or drop --valid_until'):
    tpu_vm.main(['create', *WHERE, '--valid_until=6h', '--dry_run'])


def test_the_dry_run_of_a_watched_train_prints_every_command(capsys):
  tpu_vm.main(['train', *WHERE, '--retries=1', '--git_url=https://example.org/u.git',
               '--dry_run', '--', '--gin_file=x.gin'])
  out = capsys.readouterr().out
  assert textwrap.dedent('''\
      # then every 60 s `gcloud compute tpus tpu-vm describe moe --zone=us-central2-b \
--project=proj '--format=value(state)'`; while READY, the job's state on every worker \
(`status`); when the slice is PREEMPTED/TERMINATED or gone, up to 1 times: the commands below, \
then the start command again
      + gcloud compute tpus tpu-vm delete moe --zone=us-central2-b --project=proj --quiet
      + gcloud compute tpus tpu-vm create moe''') in out
