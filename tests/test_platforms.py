"""Off a TPU VM the command-line tools run JAX without libtpu, though it is installed: no
libtpu errors, no /tmp/libtpu_lockfile held, two of them at once both work; the user's
JAX_PLATFORMS and libtpu settings still decide."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.checkpoints import helpers
from tests.helpers import REPO
from upcycle.checkpoints import orbax

pytest.importorskip('libtpu', reason="libtpu comes with pip install -e '.[test]'")

# Written at exit by every process started with PROBE on PYTHONPATH: whether libtpu was loaded.
PROBE = '''
import atexit, os

def _report():
  with open('/proc/self/maps') as maps:
    loaded = any('libtpu' in line for line in maps)
  with open(os.path.join(os.environ['LIBTPU_PROBE_DIR'], str(os.getpid())), 'w') as f:
    f.write(str(loaded))

atexit.register(_report)
'''


def _no_tpu_chips() -> bool:
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  return hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0


def _env(tmp_path, **extra):
  """The environment of a user who set neither JAX_PLATFORMS nor libtpu's variables."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_PLATFORMS', 'TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES',
                      'TPU_SKIP_MDS_QUERY', 'JAX_FORCE_TPU_INIT')}
  probe = tmp_path / 'probe'
  probe.mkdir(exist_ok=True)
  (probe / 'sitecustomize.py').write_text(PROBE)
  return {**env, 'PYTHONPATH': f'{probe}:{REPO}', 'LIBTPU_PROBE_DIR': str(probe), **extra}


@pytest.fixture
def step(tmp_path):
  """A training step of a tiny T5, as `python -m upcycle.train` saves it."""
  with orbax.CheckpointManager(str(tmp_path / 'run'), async_save=False) as manager:
    manager.save(3, helpers.random_params(helpers.CHECKPOINT_T5, seed=1))
  return str(tmp_path / 'run' / '3')


@pytest.mark.skipif(not _no_tpu_chips(), reason='this machine has TPU chips')
def test_two_describes_at_once_leave_libtpu_alone_off_a_tpu_vm(tmp_path, step):
  env = _env(tmp_path)
  procs = [subprocess.Popen([sys.executable, '-m', 'upcycle.describe', step], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  for proc in procs:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert err == ''   # no libtpu lines ('Failed to find host bounds ...', 'E0000 ...')
    assert f'path:            {step}' in out
  probes = sorted(p for p in os.listdir(tmp_path / 'probe') if p.isdigit())
  assert sorted(str(p.pid) for p in procs) == probes
  assert [(tmp_path / 'probe' / p).read_text() for p in probes] == ['False', 'False']


@pytest.mark.parametrize('given, platforms', [
    ({}, 'cpu'),
    ({'JAX_PLATFORMS': ''}, ''),                      # the user's choice: JAX's own
    ({'JAX_PLATFORMS': 'cpu'}, 'cpu'),
    ({'TPU_ACCELERATOR_TYPE': 'v4-8', 'TPU_WORKER_HOSTNAMES': 'localhost'}, None),  # upcycle.aot
])
def test_the_users_settings_decide_else_the_host(tmp_path, given, platforms):
  code = ('from upcycle import console; console.show_progress(); import jax; '
          'print(repr(jax.config.jax_platforms))')
  done = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=_env(tmp_path, **given),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == repr(platforms)


# rsqrt and a * b + c over float32 arrays given as arguments (constants would be folded on
# the host), their bits as hex.
COMPUTE = """
import jax, numpy as np
r = np.random.default_rng(0)
x, y, z = (r.standard_normal(4099).astype(np.float32) for _ in range(3))
f = jax.jit(lambda x, y, z: (jax.lax.rsqrt(abs(x)), x * y + z))
print(*(np.asarray(v).tobytes().hex() for v in f(x, y, z)))
"""


def _ieee_reference():
  """numpy's float32 arithmetic, each operation rounded once: 1 / sqrt(|x|), then x * y + z."""
  r = np.random.default_rng(0)
  x, y, z = (r.standard_normal(4099).astype(np.float32) for _ in range(3))
  return [(np.float32(1) / np.sqrt(np.abs(x))).tobytes().hex(), (x * y + z).tobytes().hex()]


def _host_has(flag):
  with open('/proc/cpuinfo') as f:
    return flag in f.read().split()


@pytest.mark.skipif(os.uname().machine != 'x86_64', reason='the cap is an x86-64 ISA')
def test_the_quickstart_stages_compute_ieee_bits_on_every_x86_host():
  """Under the quickstart's cap XLA's CPU code rounds as IEEE float32 does, op by op (numpy's
  bits: no rsqrt estimate, no fused multiply-add), so every x86-64 host computes the same;
  uncapped on a host with AVX2 it does not. XLA_FLAGS the user set are kept, a cap of theirs
  wins."""
  from upcycle import platforms  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}

  def computed(environment):
    done = subprocess.run([sys.executable, '-c', COMPUTE], env=environment, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()

  capped = platforms.portable_cpu_codegen(env)
  assert capped['XLA_FLAGS'] == '--xla_cpu_max_isa=SSE4_2'
  assert computed(capped) == _ieee_reference()
  if _host_has('avx2'):
    rsqrt, fma = computed(env)
    assert rsqrt != _ieee_reference()[0] and fma != _ieee_reference()[1]
  assert platforms.portable_cpu_codegen({'XLA_FLAGS': '--xla_dump_to=/tmp/d'})['XLA_FLAGS'] == (
      '--xla_dump_to=/tmp/d --xla_cpu_max_isa=SSE4_2')
  mine = {'XLA_FLAGS': '--xla_cpu_max_isa=AVX'}
  assert platforms.portable_cpu_codegen(mine) == mine
