"""Deterministic, resumable iterator of numpy batches over a text or image pipeline.

The stream is a sequence of epochs. Epoch `e` is a pure function of (seed, e, shard): its seed
is derived from both, so every epoch has its own shuffle and corruption noise, and no epoch
depends on how the previous one was consumed. The state is therefore small and JSON-friendly:

  {'pipeline': {...}, 'seed': 0, 'shard_index': 0, 'num_shards': 1, 'batch_size': 8,
   'epoch': 2, 'batch_in_epoch': 17, 'batches': 61}

Restoring rebuilds epoch `epoch` and skips `batch_in_epoch` batches, so resuming costs at most one
epoch of skipped work (image pipelines skip before decoding; text pipelines re-run the skipped
preprocessing). A batch never spans two epochs: with `drop_remainder` the last partial batch of
each epoch is dropped.

Multi-host: give every host the same seed and its own `shard_index` of `num_shards`; hosts see
disjoint shards, and each host checkpoints its own state.
"""

import json
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Protocol

import numpy as np

if TYPE_CHECKING:  # The pipelines bring TensorFlow; the iterator itself never imports it.
  import tensorflow as tf


class EmptySplit(ValueError):
  """A pipeline read whole (partial batches kept) gave no example at all."""


class Pipeline(Protocol):
  """What `DataIterator` needs: `TextPipeline` and `ImagePipeline` implement it."""

  def describe(self) -> Dict[str, Any]:
    ...

  def batches(self, *, seed: int, batch_size: int, shard_index: int, num_shards: int,
              drop_remainder: bool, skip_batches: int) -> 'tf.data.Dataset':
    ...


def epoch_seed(seed: int, epoch: int) -> int:
  """A 30-bit seed for epoch `epoch` (seqio derives consecutive per-preprocessor seeds from it)."""
  state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint32)[0]
  return int(state >> 2)


class DataIterator:
  """Numpy batches (`dict[str, np.ndarray]`, leading axis `batch_size`) of one host's shard.

  Args:
    pipeline: a `TextPipeline` or `ImagePipeline`.
    batch_size: examples per batch on this host.
    seed: data seed; the same on every host.
    shard_index: this host's shard, in [0, num_shards).
    num_shards: number of hosts reading disjoint shards.
    num_epochs: stop after this many epochs (None: forever; use 1 for evaluation).
    drop_remainder: drop each epoch's last partial batch (keeps shapes static for jit).
  """

  def __init__(self, pipeline: Pipeline, *, batch_size: int, seed: int, shard_index: int = 0,
               num_shards: int = 1, num_epochs: Optional[int] = None,
               drop_remainder: bool = True):
    if batch_size < 1:
      raise ValueError(f'DataIterator batch_size={batch_size} must be >= 1.')
    if not 0 <= shard_index < num_shards:
      raise ValueError(f'DataIterator shard_index={shard_index} must be in [0, num_shards='
                       f'{num_shards}); pass jax.process_index() and jax.process_count().')
    self._pipeline = pipeline
    self._config = {'pipeline': pipeline.describe(), 'seed': int(seed),
                    'shard_index': int(shard_index), 'num_shards': int(num_shards),
                    'batch_size': int(batch_size)}
    json.dumps(self._config)  # Fails early if the pipeline description cannot be checkpointed.
    self._num_epochs = num_epochs
    self._drop_remainder = drop_remainder
    self._epoch = 0
    self._batch_in_epoch = 0
    self._batches = 0
    self._it: Optional[Iterator[Dict[str, np.ndarray]]] = None
    # ((epoch, batch_in_epoch), its dataset): built for `element_spec`, read by the epoch that
    # opens at that position (building a pipeline traces it: seconds).
    self._built: Optional[tuple] = None

  def __iter__(self) -> 'DataIterator':
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    while True:
      if self._num_epochs is not None and self._epoch >= self._num_epochs:
        raise StopIteration
      if self._it is None:
        self._it = self._open_epoch()
      try:
        batch = next(self._it)
      except StopIteration:
        if self._batch_in_epoch == 0:
          raise self._no_batch() from None
        self._epoch += 1
        self._batch_in_epoch = 0
        self._it = None
        continue
      self._batch_in_epoch += 1
      self._batches += 1
      return batch

  def _no_batch(self) -> ValueError:
    """The error for an epoch without a batch: too few examples for a full batch, or (with
    partial batches kept) none at all."""
    shard = f'shard {self._config["shard_index"]} of {self._config["num_shards"]}'
    if self._drop_remainder:
      return ValueError(
          f'Epoch {self._epoch} of {self._config["pipeline"]} gave no batch of '
          f'{self._config["batch_size"]} examples on {shard}: lower batch_size or use fewer '
          'shards.')
    return EmptySplit(f'{self._config["pipeline"]} has no examples on {shard}: check the task, '
                      'its split and where its data is read (TFDS_DATA_DIR).')

  def _epoch_dataset(self) -> 'tf.data.Dataset':
    """The pipeline of the current epoch from the current batch on (built, not run)."""
    position = (self._epoch, self._batch_in_epoch)
    if self._built is not None and self._built[0] == position:
      return self._built[1]
    return self._pipeline.batches(
        seed=epoch_seed(self._config['seed'], self._epoch),
        batch_size=self._config['batch_size'], shard_index=self._config['shard_index'],
        num_shards=self._config['num_shards'], drop_remainder=self._drop_remainder,
        skip_batches=self._batch_in_epoch)

  def _open_epoch(self) -> Iterator[Dict[str, np.ndarray]]:
    ds, self._built = self._epoch_dataset(), None
    return ds.prefetch(2).as_numpy_iterator()

  @property
  def element_spec(self) -> Dict[str, 'tf.TensorSpec']:
    """Shapes and dtypes of a batch: of the pipeline the next epoch reads from here (built,
    not run, and kept for it)."""
    ds = self._epoch_dataset()
    if self._it is None:
      self._built = ((self._epoch, self._batch_in_epoch), ds)
    return ds.element_spec

  def get_state(self) -> Dict[str, Any]:
    """JSON-serializable position: restoring it yields exactly the batch that would come next."""
    return json.loads(json.dumps({**self._config, 'epoch': self._epoch,
                                  'batch_in_epoch': self._batch_in_epoch,
                                  'batches': self._batches}))

  def set_state(self, state: Dict[str, Any]) -> None:
    """Continues from `state` (from `get_state` of an iterator with the same configuration)."""
    state = json.loads(json.dumps(state))  # Accept any JSON round trip (e.g. tuples -> lists).
    config = json.loads(json.dumps(self._config))
    mismatched = {k: (state.get(k), v) for k, v in config.items() if state.get(k) != v}
    if mismatched:
      details = '; '.join(f'{k}: checkpoint {a!r} vs this iterator {b!r}'
                          for k, (a, b) in mismatched.items())
      raise ValueError(
          f'The data iterator state in the checkpoint belongs to a different data configuration '
          f'({details}). Resume with the same pipeline, seed, batch size and shard layout as '
          f'the checkpointed run, or start the run in a fresh model directory.')
    self._epoch = int(state['epoch'])
    self._batch_in_epoch = int(state['batch_in_epoch'])
    self._batches = int(state['batches'])
    self._it = None


def rebatched(state: Dict[str, Any], batch_size: int) -> Dict[str, Any]:
  """`state` (from `get_state`) as the same place in the stream for batches of `batch_size`.

  An epoch's examples come in an order that does not depend on the batch size (batching is
  the pipeline's last step), so a position of `batch_in_epoch` batches of size b is one of
  `batch_in_epoch * b / batch_size` batches of the new size when that is a whole number:
  a continued run with a larger batch reads on from the next unread example.
  """
  old = int(state['batch_size'])
  if old == batch_size:
    return state
  examples = int(state['batch_in_epoch']) * old
  if examples % batch_size:
    raise ValueError(
        f'The data position {state["batch_in_epoch"]} batches of {old} examples into epoch '
        f'{state["epoch"]} ({examples} examples) is not a whole number of batches of '
        f'{batch_size}; continue with a batch size that divides {examples}.')
  return {**state, 'batch_size': batch_size, 'batch_in_epoch': examples // batch_size,
          'batches': int(state['batches']) * old // batch_size}
