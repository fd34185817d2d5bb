"""MODEL_DIR on gs://, for real against a local GCS emulator (gcp-storage-emulator on 127.0.0.1,
with the generation header tensorstore needs: gcs_emulator.py).

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

from tests.train.test_training import REPO, _train_command



def _port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def emulator(tmp_path_factory):
  port = _port()
  url = f'http://127.0.0.1:{port}'
  server = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__),
                                                         'gcs_emulator.py'), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  for _ in range(100):
    try:
      urllib.request.urlopen(urllib.request.Request(
          f'{url}/storage/v1/b', data=json.dumps({'name': 'bucket'}).encode(),
          headers={'Content-Type': 'application/json'}))
      break
    except OSError:
      time.sleep(0.1)
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator', 'EPATH_USE_TF': 'false'}
  yield env
  server.terminate()
  server.wait()


def _env(emulator):
  return {**os.environ, **emulator,
          'XLA_FLAGS': '--xla_force_host_platform_device_count=1 '
                       '--xla_backend_optimization_level=0'}


def _object(emulator, url: str, media: bool = False) -> bytes:
  """The object at gs://`url` through the emulator's JSON API, from this test's own process
  (whose etils.epath may already use TensorFlow's GCS client, which cannot be redirected)."""
  bucket, _, name = url[len('gs://'):].partition('/')
  query = '?alt=media' if media else ''
  return urllib.request.urlopen(f"{emulator['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}/o/"
                                f"{urllib.parse.quote(name, safe='')}{query}").read()


def _exists(emulator, url: str) -> bool:
  try:
    _object(emulator, url)
    return True
  except urllib.error.HTTPError as e:
    if e.code == 404:
      return False
    raise


def _rows(emulator, url):
  return [json.loads(line) for line in _object(emulator, url, media=True).decode().splitlines()]


def test_the_run_lock_on_gcs(emulator, monkeypatch):
  for k, v in emulator.items():
    monkeypatch.setenv(k, v)
  from upcycle.file_lock import LockHeld  # pylint: disable=g-import-not-at-top
  from upcycle.train.gcs_lock import GcsLock  # pylint: disable=g-import-not-at-top
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


def test_train_kill_resume_and_inspect_on_gcs(tmp_path, emulator):
  env = _env(emulator)
  local, remote = tmp_path / 'local', 'gs://bucket/run'
  extra = ['--gin.trainer.TrainConfig.tensorboard=False']
  subprocess.run(_train_command(local, 8) + extra, cwd=REPO, env=env, check=True,
                 capture_output=True)
  log = open(tmp_path / 'killed.log', 'w')
  proc = subprocess.Popen(_train_command(remote, 8) + extra, cwd=REPO, env=env,
                          stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if _exists(emulator, f'{remote}/checkpoints/4/commit_success.txt'):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.2)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, (
      'the run ended before it could be killed: ' + open(tmp_path / 'killed.log').read()[-3000:])
  done = subprocess.run(_train_command(remote, 8) + extra, cwd=REPO, env=env, capture_output=True,
                        text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'Resuming from gs://bucket/run/checkpoints at step 4' in done.stdout + done.stderr
  expected = {r['step']: r['loss'] for r in map(json.loads, open(local / 'metrics.jsonl'))
              if r['split'] == 'train'}
  resumed = [r for r in _rows(emulator, f'{remote}/metrics.jsonl') if r['split'] == 'train']
  assert [r['step'] for r in resumed] == list(range(1, 9))
  assert {r['step']: r['loss'] for r in resumed} == expected
  assert _exists(emulator, f'{remote}/config.gin')
  assert _exists(emulator, f'{remote}/operative_config.gin')
  assert not _exists(emulator, f'{remote}/run.lock')
  info = subprocess.run([sys.executable, '-m', 'upcycle.inspect', f'{remote}/checkpoints',
                         '--json', '--verify'], cwd=REPO, env=env, capture_output=True, text=True)
  assert info.returncode == 0, info.stderr[-3000:]
  summary = json.loads(info.stdout)
  assert summary['format'] == 'orbax' and summary['step'] == 8
  assert summary['path'] == 'gs://bucket/run/checkpoints/8'
