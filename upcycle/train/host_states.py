"""Every host's data-iterator position in one checkpoint item.

Each host reads its own shard, so each has its own position (text shards can end their
epochs at different batches). The checkpoint's dataset item is written by one process, so
the positions are gathered first: {'hosts': {'0': state, '1': state, ...}}.
"""

import json
from typing import Any, Dict

import jax
import numpy as np
from jax.experimental import multihost_utils


def gather(state: Dict[str, Any]) -> Dict[str, Any]:
  """This host's JSON state -> every host's, keyed by process index (a collective call)."""
  encoded = np.frombuffer(json.dumps(state).encode(), np.uint8)
  if jax.process_count() == 1:
    return {'hosts': {'0': state}}
  length = int(np.max(multihost_utils.process_allgather(np.array([encoded.size]))))
  padded = np.zeros(length, np.uint8)
  padded[:encoded.size] = encoded
  everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, length)
  return {'hosts': {str(i): json.loads(bytes(row).rstrip(b'\0').decode())
                    for i, row in enumerate(everyone)}}


def mine(saved: Dict[str, Any]) -> Dict[str, Any]:
  """This host's state from what `gather` saved."""
  hosts = saved.get('hosts', {})
  index = str(jax.process_index())
  if index not in hosts:
    raise ValueError(
        f'The checkpoint holds data-iterator positions for hosts {sorted(hosts)}, not for host '
        f'{index}: it was written by a run with another number of hosts. Resume with the same '
        f'number of hosts, or start a fresh MODEL_DIR from it with an initializer.')
  return hosts[index]
