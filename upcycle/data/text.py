"""Text pipeline: a registered seqio task -> packed encoder-decoder batches for one epoch.

Batches are dicts of int32 `[batch, length]` arrays, as produced by
`seqio.EncDecFeatureConverter`: encoder_input_tokens, encoder_segment_ids, encoder_positions
(length = feature_lengths['inputs']) and decoder_input_tokens, decoder_target_tokens,
decoder_loss_weights, decoder_segment_ids, decoder_positions (length = feature_lengths['targets']).
Segment ids and positions exist only with `pack=True`. An unpacked pipeline with
`pretokenized=True` also gives the task's `*_pretokenized` features (its whole texts, before
tokenizing and truncation, where its preprocessors keep them, as seqio's `tokenize` does), as
`[batch]` byte strings: what decoding writes (`upcycle.predictions`, T5X's infer does the same).
"""

import dataclasses
import logging
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import seqio
import tensorflow as tf

from upcycle import fields
from upcycle.data import host_only, source_errors, span_corruption
from upcycle.data import tasks


class _OnceFilter(logging.Filter):
  """Lets a log message that starts with `prefix` through once per process.

  seqio warns on every shuffled read of a `FunctionDataSource` that restarts reshuffle poorly.
  `DataIterator` opens each epoch with its own seed and resumes inside the same epoch, so the
  warning (once per epoch) says nothing new after the first time.
  """

  def __init__(self, prefix: str):
    super().__init__()
    self._prefix = prefix
    self._seen = False

  def filter(self, record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith(self._prefix):
      return True
    seen, self._seen = self._seen, True
    return not seen


logging.getLogger('absl').addFilter(_OnceFilter('Using an uncached FunctionDataset'))


@dataclasses.dataclass(frozen=True)
class TextPipeline:
  """One split of a registered seqio task, span-corrupted and packed.

  Attributes:
    task: a name registered in `seqio.TaskRegistry`, e.g. 'offline_span_corruption' or
      'c4_span_corruption' (see `upcycle.data.tasks`).
    split: a split the task has: 'train', 'validation', 'test', ...
    feature_lengths: task feature lengths, e.g. {'inputs': 512, 'targets': 114}.
    pack: pack several examples per row (`EncDecFeatureConverter(pack=True)`).
    shuffle: shuffle documents (source order and seqio's example buffer).
    module: a module to import before `task` is looked up, which registers it (T5X's
      MIXTURE_OR_TASK_MODULE); None: none.
    pretokenized: with `pack=False`, batches also carry the task's `*_pretokenized` texts
      (`[batch]` bytes). Not part of `describe()`: the tokens are the same either way.
  """
  task: str
  split: str
  feature_lengths: Mapping[str, int]
  pack: bool = True
  shuffle: bool = True
  module: Optional[str] = None
  pretokenized: bool = False

  def __post_init__(self):
    fields.lengths(self, 'feature_lengths', ('inputs', 'targets'),
                   "TASK_FEATURE_LENGTHS = {'inputs': 512, 'targets': 114}")

  def describe(self) -> Dict[str, Any]:
    """JSON-serializable identity; a resumed iterator must see the same one."""
    return {'kind': 'text', 'task': self.task, 'split': self.split,
            'feature_lengths': dict(sorted(self.feature_lengths.items())),
            'pack': self.pack, 'shuffle': self.shuffle}

  def batch_spec(self, batch_size: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """{feature: (shape, dtype)} of a batch of `batch_size`, from the feature lengths alone
    (nothing is read: the task's data need not exist here)."""
    converter = seqio.EncDecFeatureConverter(pack=self.pack)
    lengths = converter.get_model_feature_lengths(dict(self.feature_lengths))
    return {k: ((batch_size, n), np.dtype(np.int32)) for k, n in lengths.items()}

  def seqio_task(self) -> Any:
    """The registered seqio task or mixture `task`, its `module` imported first."""
    return tasks.get_task(self.task, module=self.module,
                          task_binding=fields.binding(self, 'task'),
                          module_binding=fields.binding(self, 'module'))

  def batches(self, *, seed: int, batch_size: int, shard_index: int, num_shards: int,
              drop_remainder: bool, skip_batches: int) -> tf.data.Dataset:
    """One epoch of this host's shard, as batches, starting after `skip_batches` of them.

    The whole epoch is a pure function of (seed, shard_index, num_shards): seqio seeds every
    stochastic preprocessor and shuffle from `seed`. Skipping re-runs the skipped work.
    """
    host_only.hide_accelerators()
    task = self.seqio_task()
    tasks.check_split(task, self.split, binding=fields.binding(self, 'split'))
    shard_info = seqio.ShardInfo(shard_index, num_shards) if num_shards > 1 else None
    try:
      ds = task.get_dataset(
          dict(self.feature_lengths), split=self.split, use_cached=False, shuffle=self.shuffle,
          seed=seed, shard_info=shard_info, num_epochs=1)
    except span_corruption.LengthError as e:
      raise fields.ConfigError(
          f'{fields.binding(self, "feature_lengths")} = {dict(self.feature_lengths)} '
          f'(TASK_FEATURE_LENGTHS): {e}') from None
    except Exception as e:  # pylint: disable=broad-except  (TFDS and imports fail many ways)
      raise source_errors.source_error(self.task, task, e, module=self.module) from e
    texts = _pretokenized_names(ds) if self.pretokenized and not self.pack else []
    # The converter reads 'inputs', 'targets' and the texts it passes through; packing warns of
    # every other feature it drops (the '*_pretokenized' copies seqio's tokenize keeps).
    ds = ds.map(lambda example: {k: example[k] for k in (*self.feature_lengths, *texts)})
    ds = _converted(ds, dict(self.feature_lengths), pack=self.pack, texts=texts)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if texts:
      ds = ds.map(lambda batch: {**batch, **{k: batch[k][:, 0] for k in texts}})
    return ds.skip(skip_batches)


def _pretokenized_names(ds: tf.data.Dataset) -> list:
  """The task's `*_pretokenized` text features (scalar strings) in `ds`'s examples."""
  return sorted(k for k, spec in ds.element_spec.items()
                if k.endswith('_pretokenized') and spec.dtype == tf.string
                and spec.shape.rank == 0)


def _converted(ds: tf.data.Dataset, lengths: Dict[str, int], *, pack: bool,
               texts: list) -> tf.data.Dataset:
  """`seqio.EncDecFeatureConverter`'s examples of the task's `ds`, the unpacked ones with the
  text features `texts` passed through as `[1]` strings (seqio passes features of rank 1
  with a length; a text is one string of length 1)."""
  if not texts:
    return seqio.EncDecFeatureConverter(pack=pack)(ds, lengths)
  spec = seqio.FeatureConverter.FeatureSpec(dtype=tf.string)
  converter = seqio.EncDecFeatureConverter(pack=False,
                                           passthrough_features={k: spec for k in texts})
  ds = ds.map(lambda example: {**example, **{k: example[k][None] for k in texts}})
  return converter(ds, {**lengths, **{k: 1 for k in texts}})
