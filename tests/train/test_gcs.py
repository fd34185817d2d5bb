"""MODEL_DIR on gs://, for real against a local GCS emulator (gcp-storage-emulator on 127.0.0.1,
with the fixes tensorstore needs: tests/gcs_emulator.py; the session fixture `gcs_emulator` of
tests/conftest.py starts it).

What is pointed at the emulator: tensorstore's GCS driver (TENSORSTORE_GCS_HTTP_URL: checkpoint
arrays, the run lock) and etils.epath through gcsfs (STORAGE_EMULATOR_HOST, with
EPATH_USE_TF=false: orbax's directories, metrics.jsonl, gin configs). TensorFlow's own GCS client
(tf.io.gfile, hence tf.summary) has a fixed endpoint and cannot be, so TensorBoard is off here.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.helpers import REPO
from tests.train.helpers import ONE_DEVICE_XLA_FLAGS, train_command
from upcycle import describe


def _env(gcs_emulator):
  return {**os.environ, **gcs_emulator, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS}


def _object(gcs_emulator, url: str, media: bool = False) -> bytes:
  """The object at gs://`url` through the emulator's JSON API, from this test's own process
  (whose etils.epath may already use TensorFlow's GCS client, which cannot be redirected)."""
  bucket, _, name = url[len('gs://'):].partition('/')
  query = '?alt=media' if media else ''
  host = gcs_emulator['STORAGE_EMULATOR_HOST']
  return urllib.request.urlopen(f"{host}/storage/v1/b/{bucket}/o/"
                                f"{urllib.parse.quote(name, safe='')}{query}").read()


def _exists(gcs_emulator, url: str) -> bool:
  try:
    _object(gcs_emulator, url)
    return True
  except urllib.error.HTTPError as e:
    if e.code == 404:
      return False
    raise


def _rows(gcs_emulator, url):
  text = _object(gcs_emulator, url, media=True).decode()
  return [json.loads(line) for line in text.splitlines()]


def test_the_run_lock_on_gcs(gcs_emulator, monkeypatch):
  for k, v in gcs_emulator.items():
    monkeypatch.setenv(k, v)
  from upcycle.locks.file_lock import LockHeld  # pylint: disable=g-import-not-at-top
  from upcycle.locks.gcs_lock import GcsLock  # pylint: disable=g-import-not-at-top
  first = GcsLock('gs://bucket/locked/run.lock').acquire()
  with pytest.raises(LockHeld, match=f'held by pid {os.getpid()} on host'):
    GcsLock('gs://bucket/locked/run.lock').acquire()
  first.release()
  GcsLock('gs://bucket/locked/run.lock').acquire().release()
  store = first._store  # pylint: disable=protected-access
  dead_pid = subprocess.Popen(['true'])
  dead_pid.wait()
  store.write('locked/run.lock', json.dumps({'host': socket.gethostname(), 'pid': dead_pid.pid,
                                             'since': 'then', 'heartbeat': time.time()})).result()
  taken = GcsLock('gs://bucket/locked/run.lock').acquire()  # its holder is dead: taken over
  assert json.loads(bytes(store.read('locked/run.lock').result().value))['pid'] == os.getpid()
  taken.release()


@pytest.mark.slow
@pytest.mark.usefixtures('on_gcs')   # describe, in this process, on the emulator
def test_train_kill_resume_and_inspect_on_gcs(tmp_path, gcs_emulator, straight_run, capsys):
  env = _env(gcs_emulator)
  remote = 'gs://bucket/run'
  extra = ['--gin.trainer.TrainConfig.tensorboard=False']
  log = open(tmp_path / 'killed.log', 'w')
  proc = subprocess.Popen(train_command(remote, 8) + extra, cwd=REPO, env=env,
                          stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if _exists(gcs_emulator, f'{remote}/checkpoints/4/commit_success.txt'):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.2)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, (
      'the run ended before it could be killed: ' + open(tmp_path / 'killed.log').read()[-3000:])
  done = subprocess.run(train_command(remote, 8) + extra, cwd=REPO, env=env, capture_output=True,
                        text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Resuming from gs://bucket/run/checkpoints at step 4' in done.stdout + done.stderr
  expected = {r['step']: r['loss'] for r in map(json.loads, open(straight_run / 'metrics.jsonl'))
              if r['split'] == 'train' and r['step'] <= 8}   # the local 12-step run's first 8
  resumed = [r for r in _rows(gcs_emulator, f'{remote}/metrics.jsonl') if r['split'] == 'train']
  assert [r['step'] for r in resumed] == list(range(1, 9))
  assert {r['step']: r['loss'] for r in resumed} == expected
  assert _exists(gcs_emulator, f'{remote}/config.gin')
  assert _exists(gcs_emulator, f'{remote}/operative_config.gin')
  assert not _exists(gcs_emulator, f'{remote}/run.lock')
  capsys.readouterr()
  # `python -m upcycle.describe`'s main, in this process.
  assert describe.main([f'{remote}/checkpoints', '--json', '--verify']) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary['format'] == 'orbax' and summary['step'] == 8
  assert summary['path'] == 'gs://bucket/run/checkpoints/8'


# Another process's writes and deletes: a finished step (as is_step_dir reads one on gs://:
# orbax's marker and commit file, the parameters' _METADATA) or a step removed.
_ANOTHER_PROCESS = '''
import sys
from etils import epath
root, write, delete = sys.argv[1:]
for name in ('_CHECKPOINT_METADATA', 'commit_success.txt', 'params/_METADATA'):
  epath.Path(root, write, name).write_text('{}')
epath.Path(root, delete).rmtree()
'''


@pytest.mark.usefixtures('on_gcs')   # this process's epath on the emulator, through gcsfs
def test_a_long_lived_reader_sees_the_steps_another_process_writes_and_deletes(gcs_emulator):
  """gcsfs keeps the listings it read for the life of the process: a reader of a live run's
  checkpoints (lm_eval's harness, a notebook) saw the steps of its first look."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import orbax  # pylint: disable=g-import-not-at-top
  root = 'gs://bucket/live/checkpoints'
  for name in ('_CHECKPOINT_METADATA', 'commit_success.txt', 'params/_METADATA'):
    epath.Path(root, '100', name).write_text('{}')
  assert sorted(orbax.run_steps('gs://bucket/live')) == [100]
  subprocess.run([sys.executable, '-c', _ANOTHER_PROCESS, root, '200', '100'], check=True,
                 env={**os.environ, **gcs_emulator})
  assert sorted(orbax.run_steps('gs://bucket/live')) == [200]
  assert orbax.latest('gs://bucket/live') == f'{root}/200'
