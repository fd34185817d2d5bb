"""This host's part of every global batch, read from this host's data shards only.

The job's data is split into `num_shards` shards (by default one per host); host h of H reads
shards [h*k, (h+1)*k) with k = num_shards / H, each a `DataIterator` of
`global_batch / num_shards` examples, and its host batch is their concatenation. The shards,
and so the examples of every step, depend on `num_shards` alone, not on the number of hosts:
one process reading 2 shards trains on the same examples as 2 processes reading one each.
"""

from typing import Any, Dict, List

import jax
import numpy as np

from upcycle.data.iterator import DataIterator, rebatched


class HostData:
  """Iterator of this host's batches (`dict[str, np.ndarray]`), resumable per shard."""

  def __init__(self, pipeline, *, global_batch_size: int, seed: int, num_shards: int = 0):
    hosts, host = jax.process_count(), jax.process_index()
    num_shards = num_shards or hosts
    if num_shards % hosts or global_batch_size % num_shards:
      raise ValueError(
          f'trainer.TrainConfig.data_shards={num_shards}: must be a multiple of the {hosts} '
          f'host(s) and divide batch_size={global_batch_size}.')
    per_host = num_shards // hosts
    self.shards: List[int] = list(range(host * per_host, (host + 1) * per_host))
    self.iterators = [DataIterator(pipeline, batch_size=global_batch_size // num_shards,
                                   seed=seed, shard_index=i, num_shards=num_shards)
                      for i in self.shards]

  def __iter__(self) -> 'HostData':
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    parts = [next(it) for it in self.iterators]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def example(self) -> Dict[str, np.ndarray]:
    """Zeros shaped like one host batch (for shapes; nothing is read)."""
    spec = self.iterators[0].element_spec
    return {k: np.zeros((v.shape[0] * len(self.iterators),) + tuple(v.shape[1:]),
                        v.dtype.as_numpy_dtype) for k, v in spec.items()}

  def get_state(self) -> Dict[int, Dict[str, Any]]:
    return {i: it.get_state() for i, it in zip(self.shards, self.iterators)}

  def set_state(self, states: Dict[int, Dict[str, Any]]) -> None:
    for i, it in zip(self.shards, self.iterators):
      it.set_state(states[i])

  def continue_stream(self, states: Dict[int, Dict[str, Any]]) -> None:
    """Reads on from another run's positions (`get_state` of a run with the same pipeline,
    seed and data shards, its batch size possibly another: `iterator.rebatched`)."""
    for i, it in zip(self.shards, self.iterators):
      it.set_state(rebatched(states[i], it.get_state()['batch_size']))

  def describe_position(self) -> str:
    """E.g. 'epoch 0, batch 50 of 64 examples (shard 0)' per shard of this host."""
    return '; '.join(f"epoch {s['epoch']}, batch {s['batch_in_epoch']} of {s['batch_size']} "
                     f'examples (shard {i})' for i, s in self.get_state().items())
