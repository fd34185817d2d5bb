"""The command-line tools keep JAX's compiled programs in a persistent cache: a second process
running the same program reads it back instead of compiling it; the user's
JAX_COMPILATION_CACHE_DIR decides where, and empty turns it off; `compilation_cache_off`
keeps it off for the compiles within."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO

# A tool's start (console.show_progress), then one jitted program; prints whether JAX read it
# from the persistent cache, and where the cache is.
PROGRAM = '''
import json, jax, jax.numpy as jnp
from upcycle import console
console.show_progress()
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event == '/jax/compilation_cache/cache_hits' else None)
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({'hit': bool(hits), 'dir': jax.config.jax_compilation_cache_dir,
                  'max': jax.config.jax_compilation_cache_max_size}))
'''


def _run(tmp_path, **env):
  env = {**{k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'},
         'JAX_PLATFORMS': 'cpu', 'UPCYCLE_CACHE': str(tmp_path / 'cache'),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0', **env}
  done = subprocess.run([sys.executable, '-c', PROGRAM], cwd=REPO, env=env, capture_output=True,
                        text=True, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_compiled_program_back(tmp_path):
  cache = str(tmp_path / 'cache' / 'jax_compilation_cache')
  assert _run(tmp_path) == {'hit': False, 'dir': cache, 'max': 4 << 30}
  assert os.listdir(cache)   # the program, written
  assert _run(tmp_path) == {'hit': True, 'dir': cache, 'max': 4 << 30}


def test_the_users_setting_decides(tmp_path):
  mine = str(tmp_path / 'mine')
  assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=mine)['dir'] == mine
  assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=mine)['hit']
  off = _run(tmp_path, JAX_COMPILATION_CACHE_DIR='')
  assert not off['hit'] and not off['dir'] and not os.path.exists(tmp_path / 'cache')


def test_the_tests_compile_into_a_cache_of_their_own():
  """tests/conftest.py sets the cache in the environment before JAX is imported, so this
  process, the xdist workers and the processes the tests start share it: the checkout's
  .pytest_cache/jax_compilation_cache unless the environment names another, never the user's
  ~/.cache/upcycle."""
  import jax  # pylint: disable=g-import-not-at-top
  from upcycle import platforms  # pylint: disable=g-import-not-at-top
  directory = os.environ['JAX_COMPILATION_CACHE_DIR']
  assert jax.config.jax_compilation_cache_dir == directory
  assert not directory.startswith(platforms.cache_root())


# Three programs compiled in turn, the second with the cache off; prints the entries the
# cache holds after each.
SWITCHED = '''
import json, os, sys, jax, jax.numpy as jnp
from upcycle import console, platforms
console.show_progress()
cache = jax.config.jax_compilation_cache_dir
entries = lambda: len([n for n in os.listdir(cache) if n.endswith('-cache')])
counts = []
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
counts.append(entries())
with platforms.compilation_cache_off():
  jax.jit(lambda x: jnp.cos(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
  counts.append(entries())
jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
counts.append(entries())
print(json.dumps(counts))
'''


def test_the_cache_stays_off_within_the_switch_after_the_process_has_used_it(tmp_path):
  """JAX decides at a process's first compile whether it uses the cache: switched off after
  that, nothing more is written within, and the next compile after it is written again."""
  env = {**{k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'},
         'JAX_PLATFORMS': 'cpu', 'UPCYCLE_CACHE': str(tmp_path / 'cache'),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}
  done = subprocess.run([sys.executable, '-c', SWITCHED], cwd=REPO, env=env,
                        capture_output=True, text=True, check=True)
  first, within, after = json.loads(done.stdout.strip().splitlines()[-1])
  assert first >= 1 and within == first and after > within
