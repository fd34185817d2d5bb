"""Which JAX platform a command-line tool runs on: off a Cloud TPU VM, never libtpu.

JAX tries every backend it has, TPU first, when the user names none (JAX_PLATFORMS unset).
With libtpu installed (the `tpu` and `test` extras) on a machine without TPU chips, that
loads libtpu, which prints errors about the TPU it cannot find and takes /tmp/libtpu_lockfile,
so a second JAX process started meanwhile fails. `choose()` names the platforms instead
(CUDA when JAX has its plugin, then the CPU) unless this is a TPU VM, decided as JAX decides
it at import (`running_in_cloud_tpu_vm`: libtpu and TPU chips on the PCI bus, or
JAX_FORCE_TPU_INIT), or the user asked for something:
  JAX_PLATFORMS                              the platforms, as JAX reads them
  TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES  libtpu's own settings (`upcycle.aot` compiles
                                             with libtpu off a TPU VM with these)

`cache_compilations()` turns JAX's persistent compilation cache on for the command-line
tools, under `cache_root()` (`UPCYCLE_CACHE`, default ~/.cache/upcycle/, where the offline
tokenizer is kept too), unless JAX_COMPILATION_CACHE_DIR says where (or, empty, that it stays
off); `compilation_cache_off()` keeps it off for the compiles within (those for a TPU
topology without a TPU).
"""

import contextlib
import os

CACHE_MAX_BYTES = 4 << 30   # of the persistent compilation cache (`cache_compilations`)
# Set by the user, they say what libtpu should do: JAX is left to its own choice.
WANTS_TPU = ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES')


def choose() -> None:
  """Off a TPU VM, and unless the user chose (module doc), JAX uses CUDA if it can, else the
  CPU, never libtpu. Has no effect once JAX's backends are initialized."""
  if 'JAX_PLATFORMS' in os.environ or any(os.environ.get(name) for name in WANTS_TPU):
    return
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import cloud_tpu_init, xla_bridge  # pylint: disable=g-import-not-at-top
  if cloud_tpu_init.running_in_cloud_tpu_vm or xla_bridge.backends_are_initialized():
    return
  jax.config.update('jax_platforms', _host_platforms())


def cache_root() -> str:
  """Where upcycle keeps what it makes once and reads again: `UPCYCLE_CACHE`, default
  ~/.cache/upcycle."""
  return os.environ.get('UPCYCLE_CACHE', os.path.expanduser('~/.cache/upcycle'))


def cache_compilations() -> None:
  """JAX's persistent compilation cache, under `cache_root()/jax_compilation_cache`: a rerun
  of a program compiled before (a run resumed, an ablation of the same shapes, infer or eval of
  a later step) reads XLA's output back instead of compiling it again; JAX caches programs
  that took at least `jax_persistent_cache_min_compile_time_secs` (1 s) to compile
  (benchmarks/time_to_first_step.py measures what it saves), keeps at most
  `CACHE_MAX_BYTES` (the least recently read entries go first) and locks the directory
  while it writes, so concurrent processes share it. JAX_COMPILATION_CACHE_DIR set by the
  user wins (JAX reads it; empty: no cache)."""
  if 'JAX_COMPILATION_CACHE_DIR' in os.environ:
    return
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_compilation_cache_dir',
                    os.path.join(cache_root(), 'jax_compilation_cache'))
  jax.config.update('jax_compilation_cache_max_size', CACHE_MAX_BYTES)


@contextlib.contextmanager
def compilation_cache_off():
  """JAX's persistent compilation cache off for the compiles within, on again after: an
  executable compiled for a topology description (`upcycle.aot`) has no client to be loaded
  back with ('PjRtCompiler must be constructed with a Client to call
  DeserializeLoadedExecutable'), so what would be written is never read, and a rerun's read of
  it only warns and compiles again. JAX decides once per process, at its first compile,
  whether it uses the cache, so the switch resets that decision both ways."""
  # pylint: disable=g-import-not-at-top
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  # pylint: enable=g-import-not-at-top
  before = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', before)
    compilation_cache.reset_cache()


def _host_platforms() -> str:
  """'cuda,cpu' where JAX has the CUDA plugin (it skips CUDA without a visible GPU), else
  'cpu'."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  xla_bridge._discover_and_register_pjrt_plugins()  # pylint: disable=protected-access
  registered = xla_bridge._backend_factories  # pylint: disable=protected-access
  return 'cuda,cpu' if 'cuda' in registered else 'cpu'
