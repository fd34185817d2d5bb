"""Test session setup: 8 simulated CPU devices, so sharding tests can build real meshes, and
fixtures: tiny HuggingFace T5 v1.1 and ViT checkpoints, built and saved once a session (and a
byte-vocabulary T5 once a module), a local GCS emulator, the entry points on `__main__`."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests import hf_files
from tests.helpers import REPO

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_flags = os.environ.get('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in _flags:
  _flags += ' --xla_force_host_platform_device_count=8'
if '--xla_backend_optimization_level' not in _flags:
  # Tests compile hundreds of tiny programs: skipping LLVM's optimizations roughly halves
  # compile time and leaves results within the tests' tolerances.
  _flags += ' --xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = _flags.strip()
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')   # the workers' TensorFlow start-up lines
# JAX's persistent compilation cache, in this checkout (never the user's ~/.cache/upcycle):
# set before JAX is imported, in the environment, so the xdist workers and every process a
# test starts share it; a program compiled again (another test, worker or process) is read
# back. JAX keys an entry by the program, its version and XLA's flags. The size limit turns on
# JAX's file lock (no half-written entry is read) and evicts the least recently read.
# JAX_COMPILATION_CACHE_DIR='' turns it off.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(REPO, '.pytest_cache', 'jax_compilation_cache'))
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(2 << 30))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '1')


@pytest.fixture(autouse=True)
def _gin_left_unlocked():
  """A test that finalized gin's configuration (an entry point run in process) leaves it
  unlocked: the next test on this worker may register configurables."""
  yield
  import gin  # pylint: disable=g-import-not-at-top
  if gin.config_is_locked():
    gin.clear_config()


@pytest.fixture(scope='session')
def hf_t5(tmp_path_factory):
  """(directory, reference torch model) of an untied T5 v1.1 with its own lm_head.weight.

  Written as a real v1.1 file (`hf_files.save_untied_t5`); the reference is re-read from it.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.T5Config(
      vocab_size=32, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_decoder_layers=2,
      num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
      feed_forward_proj='gated-gelu', tie_word_embeddings=False, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(config)
  hf_files.perturb(model, seed=1)
  directory = str(tmp_path_factory.mktemp('hf_t5'))
  reference = hf_files.save_untied_t5(model, directory)
  return directory, reference


@pytest.fixture(scope='session')
def hf_vit(tmp_path_factory):
  """(directory, reference torch model) of a tiny ViTForImageClassification."""
  import transformers  # pylint: disable=g-import-not-at-top
  config = transformers.ViTConfig(
      hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
      image_size=8, patch_size=4, num_channels=3, num_labels=5, initializer_range=0.2)
  directory = str(tmp_path_factory.mktemp('hf_vit'))
  return directory, hf_files.save_perturbed(
      lambda: transformers.ViTForImageClassification(config), directory, seed=3)


@pytest.fixture(scope='module')
def byte_vocab_t5(tmp_path_factory):
  """(directory, reference) of a tiny untied HF T5 v1.1 over the offline task's 384 ids, for
  the infer / eval tests (its architecture as gin flags: tests/helpers.py, BYTE_T5_FLAGS)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.T5Config(
      vocab_size=384, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1,
      num_heads=2, feed_forward_proj='gated-gelu', tie_word_embeddings=False, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(config)
  directory = str(tmp_path_factory.mktemp('byte_t5'))
  return directory, hf_files.save_untied_t5(model, directory)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='session')
def gcs_emulator():
  """The environment that points tensorstore and etils.epath (through gcsfs) at a GCS emulator
  (tests/gcs_emulator.py) on 127.0.0.1 holding an empty bucket `bucket`, for the session."""
  url = f'http://127.0.0.1:{_free_port()}'
  server = subprocess.Popen(
      [sys.executable, os.path.join(os.path.dirname(__file__), 'gcs_emulator.py'),
       url.rsplit(':', 1)[1]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  for _ in range(100):
    try:
      urllib.request.urlopen(urllib.request.Request(
          f'{url}/storage/v1/b', data=json.dumps({'name': 'bucket'}).encode(),
          headers={'Content-Type': 'application/json'}))
      break
    except OSError:
      time.sleep(0.1)
  yield {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator', 'EPATH_USE_TF': 'false'}
  server.terminate()
  server.wait()


@pytest.fixture
def on_gcs(gcs_emulator, monkeypatch):
  """etils.epath (through gcsfs) and tensorstore of this process on the emulator."""
  import gcsfs  # pylint: disable=g-import-not-at-top
  from etils.epath import backend, gpath  # pylint: disable=g-import-not-at-top
  caches = (gcsfs.GCSFileSystem.clear_instance_cache,   # clients of another endpoint
            backend._FileSystemSpecBackend._get_filesystem.cache_clear,  # etils keeps its first
            gpath._is_tf_installed.cache_clear)  # etils: TensorFlow's client or gcsfs, once
  for key, value in gcs_emulator.items():
    monkeypatch.setenv(key, value)
  for clear in caches:
    clear()
  yield gcs_emulator
  for clear in caches:
    clear()


@pytest.fixture
def entry_points(monkeypatch):
  """The functions the gin files bind as `__main__.<name>` (train, evaluate, infer), as each
  entry point runs them; gin's configuration is cleared afterwards."""
  import gin  # pylint: disable=g-import-not-at-top
  from upcycle import eval as eval_main, infer as infer_main  # pylint: disable=g-import-not-at-top
  from upcycle.train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  main = sys.modules['__main__']
  monkeypatch.setattr(main, 'train', train_main.train, raising=False)
  monkeypatch.setattr(main, 'evaluate', eval_main.evaluate, raising=False)
  monkeypatch.setattr(main, 'infer', infer_main.infer, raising=False)
  yield
  gin.clear_config(clear_constants=True)


def _tmpfs(tmp_path, size: str):
  mount = tmp_path / 'disk'
  mount.mkdir()
  done = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(mount)],
                        capture_output=True, text=True)
  if done.returncode:
    pytest.skip(f'cannot mount a small tmpfs here: {done.stderr.strip()}')
  yield mount
  subprocess.run(['umount', str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
  """A 3 MiB tmpfs (root only): a tiny T5's checkpoint fits once, not twice."""
  yield from _tmpfs(tmp_path, '3M')


@pytest.fixture
def roomy_disk(tmp_path):
  """A 16 MiB tmpfs (root only): room for a tiny T5's checkpoints, until something fills it."""
  yield from _tmpfs(tmp_path, '16M')
