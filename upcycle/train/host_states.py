"""Every data shard's iterator position in one checkpoint item.

Each host reads its own data shards (`host_data.HostData`), so each shard has its own position
(text shards can end their epochs at different batches). The checkpoint's dataset item is
written by one process, so the positions are gathered first:
{'shards': {'0': state, '1': state, ...}}, keyed by data shard (one per host unless
`TrainConfig.data_shards` says otherwise).
"""

import json
from typing import Any, Dict, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


def gather(states: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
  """This host's {shard: JSON state} -> every shard's, keyed by shard index (a collective)."""
  if jax.process_count() == 1:
    return {'shards': {str(i): s for i, s in sorted(states.items())}}
  encoded = np.frombuffer(json.dumps({str(i): s for i, s in states.items()}).encode(), np.uint8)
  length = int(np.max(multihost_utils.process_allgather(np.array([encoded.size]))))
  padded = np.zeros(length, np.uint8)
  padded[:encoded.size] = encoded
  everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, length)
  merged = {}
  for row in everyone:
    merged.update(json.loads(bytes(row).rstrip(b'\0').decode()))
  return {'shards': dict(sorted(merged.items(), key=lambda kv: int(kv[0])))}


def mine(saved: Dict[str, Any], shards: Sequence[int]) -> Dict[int, Dict[str, Any]]:
  """The states of `shards` (this host's) from what `gather` saved."""
  stored = saved.get('shards', {})
  missing = [i for i in shards if str(i) not in stored]
  if missing:
    raise ValueError(
        f'The checkpoint holds data-iterator positions for data shards {sorted(stored, key=int)}, '
        f'not for shard(s) {missing} of host {jax.process_index()}: it was written with another '
        f'number of data shards. Resume with the same trainer.TrainConfig.data_shards (by '
        f'default the number of hosts), or start a fresh MODEL_DIR from it with an initializer.')
  return {i: stored[str(i)] for i in shards}


def wait_for_all_hosts(name: str, timeout_seconds: int = 600) -> None:
  """Blocks until every process reaches `name` (no-op with one process).

  A barrier of the coordination service, not a device collective: on CPU, gloo gives up on a
  peer that starts a collective more than 30 s after the others (the context set-up has a fixed
  timeout), which a loaded machine reaches while one process still compiles or reads a
  checkpoint. The trainer waits here before its first collectives.

  JAX has no public call for it (`jax.distributed` exposes initialize / shutdown only, and
  `multihost_utils.sync_global_devices` is a device collective); orbax's public
  `multihost.get_barrier_sync_fn` is the coordination client's `wait_at_barrier`.
  """
  if jax.process_count() == 1:
    return
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  multihost.get_barrier_sync_fn()(key=name, timeout_ms=timeout_seconds * 1000)
