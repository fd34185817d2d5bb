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
"""

import os

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


def _host_platforms() -> str:
  """'cuda,cpu' where JAX has the CUDA plugin (it skips CUDA without a visible GPU), else
  'cpu'."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  xla_bridge._discover_and_register_pjrt_plugins()  # pylint: disable=protected-access
  registered = xla_bridge._backend_factories  # pylint: disable=protected-access
  return 'cuda,cpu' if 'cuda' in registered else 'cpu'
