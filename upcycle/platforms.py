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

`portable_cpu_codegen(env)` caps XLA's CPU code generation at SSE4.2 for a subprocess whose
numbers must repeat on every x86-64 host (the quickstart's table).

`cache_compilations()` turns JAX's persistent compilation cache on for the command-line
tools, under `cache_root()` (`UPCYCLE_CACHE`, default ~/.cache/upcycle/, where the offline
tokenizer is kept too), unless JAX_COMPILATION_CACHE_DIR says where (or, empty, that it stays
off); `compilation_cache_off()` keeps it off for the compiles within (those for a TPU
topology without a TPU).
"""

import contextlib
import os
import platform
from typing import Dict, Mapping

CACHE_MAX_BYTES = 4 << 30   # of the persistent compilation cache (`cache_compilations`)
# Set by the user, they say what libtpu should do: JAX is left to its own choice.
WANTS_TPU = ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES')


# XLA's CPU code generator uses what the host's ISA offers, and some of it rounds by the host:
# fused multiply-adds (FMA, from AVX2), and approximations through the estimate instructions
# (`vrsqrtps` for rsqrt, from AVX, whose bits differ between vendors; AVX-512 has its own): the
# tiny T5's validation loss after 30 steps is 3.092011662970843 here (AVX2), 3.092011168277983
# capped at AVX, 3.0920104770439454 at SSE4.2. Capped at SSE4.2, every operation XLA generates
# is one IEEE-rounded instruction (rsqrt is 1 / sqrt, a * b + c two roundings), so every x86-64
# host computes the same bits; matrix products run in Eigen, the same code on every host, split
# over threads by the core count (2 on every image of this kind of machine). About 10% slower.
PORTABLE_CPU_ISA = '--xla_cpu_max_isa=SSE4_2'


def portable_cpu_codegen(env: Mapping[str, str]) -> Dict[str, str]:
  """`env` (a subprocess's environment) with XLA_FLAGS capping the CPU code generation at
  SSE4.2 (`PORTABLE_CPU_ISA`) on x86-64, unless XLA_FLAGS caps it already (the user's choice
  wins); `env` as it is on other hosts (Arm has no SSE)."""
  flags = env.get('XLA_FLAGS', '')
  if platform.machine().lower() not in ('x86_64', 'amd64') or '--xla_cpu_max_isa' in flags:
    return dict(env)
  return {**env, 'XLA_FLAGS': f'{flags} {PORTABLE_CPU_ISA}'.strip()}


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
