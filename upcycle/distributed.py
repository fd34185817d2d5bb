"""Joining the processes of one job: `jax.distributed.initialize()` before JAX is used, as the
Cloud TPU docs ask of every worker of a multi-host slice, and for the N CPU processes
`launch/local.py` starts on one machine. The entry points call `join(--multi_host)` first
(`gin_utils.run`).
"""

import os
from typing import Optional

from upcycle import tpu_slice

# Set by `launch/local.py` for each of the N processes it starts on one machine.
COORDINATOR_ENV = 'UPCYCLE_COORDINATOR_ADDRESS'   # host:port of process 0's coordinator
NUM_PROCESSES_ENV = 'UPCYCLE_NUM_PROCESSES'
PROCESS_ID_ENV = 'UPCYCLE_PROCESS_ID'


def settings(environ=os.environ) -> Optional[dict]:
  """`jax.distributed.initialize` arguments from the launcher's variables (None if unset)."""
  names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
  given = [name for name in names if environ.get(name)]
  if not given:
    return None
  if len(given) < len(names):
    raise SystemExit(f'Set all of {", ".join(names)} or none (only {", ".join(given)} are '
                     'set); launch/local.py sets them for every process it starts.')
  try:
    return {'coordinator_address': environ[COORDINATOR_ENV],
            'num_processes': int(environ[NUM_PROCESSES_ENV]),
            'process_id': int(environ[PROCESS_ID_ENV])}
  except ValueError as e:
    raise SystemExit(f'{NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} must be integers: {e}') from e


def join(mode: str) -> None:
  """Joins the processes of one job before JAX is used (every process runs the same command).

  'auto' initializes on a TPU slice of several workers, found as `jax.distributed.initialize()`
  finds its peers (`tpu_slice.processes()`: a Cloud TPU VM's metadata server, GKE's
  TPU_WORKER_HOSTNAMES), and under `launch/local.py` (UPCYCLE_COORDINATOR_ADDRESS /
  UPCYCLE_NUM_PROCESSES / UPCYCLE_PROCESS_ID; CPU devices run collectives across processes with
  gloo); 'yes' always initializes, 'no' never. On a slice of N workers where JAX does not end up
  with N processes, stops with one line instead of hanging at the first collective.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if mode == 'no':
    return
  given = settings()
  if given is not None:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    _initialize(given)
    return
  workers = tpu_slice.processes()
  if mode == 'yes' or workers > 1:
    _initialize({})
  if workers > 1 and jax.process_count() != workers:
    raise SystemExit(
        f'This TPU slice has {workers} workers but JAX runs {jax.process_count()} process(es) '
        f'(jax.distributed initialized: {jax.distributed.is_initialized()}): run the same '
        'command on every worker at once with --multi_host=auto or yes (launch/tpu_vm.py '
        'train does).')


def _initialize(settings: dict) -> None:
  """jax.distributed.initialize(**settings); a failure (a worker that never joined, no
  cluster to join) is one line."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.distributed.initialize(**settings)
  except (RuntimeError, ValueError) as e:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise SystemExit(f'--multi_host: jax.distributed.initialize() failed: {first} (every worker '
                     'must run the same command at once; --multi_host=no runs this process '
                     'alone).') from e
