"""Causal language modelling: a text source -> packed decoder-only batches for one epoch.

Every document of the task's source (its `text` feature: any seqio task reading raw text,
such as `offline_stdlib_text` or `c4_span_corruption`'s C4) is tokenized with the run's
tokenizer (`upcycle.data.tokenizer`) and framed as `[BOS] text [EOS]`; a document longer
than the sequence is cut into windows of `length + 1` tokens that overlap by one, so every
token but the first is predicted exactly once. A window gives `decoder_input_tokens` (all
but its last token) and `decoder_target_tokens` (all but its first), and windows are packed
into rows, as `seqio.DecoderFeatureConverter(pack=True)` names the features:
decoder_input_tokens, decoder_target_tokens, decoder_loss_weights, decoder_segment_ids,
decoder_positions, each int32 `[batch, length]`. Segment ids count the windows in a row
from 1 (0 is padding) and positions restart at 0 in each, so no window attends to another.
Two differences from T5X's converter, both for checkpoints trained with HF tokenizers: the
first input is the tokenizer's BOS (not 0 shifted in), and the loss weights come from the
segment ids, not from `token != 0` (Llama 3's id 0 is a real piece).
"""

import dataclasses
import functools
import logging
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import seqio
import tensorflow as tf

from upcycle import fields
from upcycle.data import host_only, source_errors
from upcycle.data import tasks
from upcycle.data import tokenizer as tokenizer_lib

FEATURES = ('decoder_input_tokens', 'decoder_target_tokens', 'decoder_loss_weights',
            'decoder_segment_ids', 'decoder_positions')
SHUFFLE_BUFFER = 1000   # windows, as seqio's default task buffer

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: tokenizer_lib.Spec) -> tokenizer_lib.Tokenizer:
  tok = tokenizer_lib.load(spec)
  log.info('Tokenizer: %s (%d pieces, digest %s), from TOKENIZER = %r.', tok.source,
           tok.vocab_size, tok.short_digest, spec)
  return tok


@dataclasses.dataclass(frozen=True)
class LmPipeline:
  """One split of a text task, tokenized, windowed and packed for a causal LM.

  Attributes:
    task: a seqio task whose source yields documents under `text_key`.
    split: a split the task has: 'train', 'validation', 'test', ...
    feature_lengths: {'targets': tokens per row}, as T5X's decoder-only runs give
      TASK_FEATURE_LENGTHS.
    tokenizer: `upcycle.data.tokenizer.load`'s spec: an offline BPE ('offline_stdlib_bpe',
      'offline_packages_bpe'), an HF checkpoint directory, or a run directory (a list of
      checkpoints: the one tokenizer they share).
    pack: several windows per row (segment ids apart); else one window per row, padded.
    shuffle: shuffle documents (the source's order) and windows (a seeded buffer).
    text_key: the source's text feature.
    module: a module to import before `task` is looked up, which registers it (T5X's
      MIXTURE_OR_TASK_MODULE); None: none.
  """
  task: str
  split: str
  feature_lengths: Mapping[str, int]
  tokenizer: tokenizer_lib.Spec = tokenizer_lib.OFFLINE_BPE
  pack: bool = True
  shuffle: bool = True
  text_key: str = 'text'
  module: Optional[str] = None

  def __post_init__(self):   # a decoder-only run has no 'inputs': refused, not ignored
    fields.lengths(self, 'feature_lengths', ('targets',), "TASK_FEATURE_LENGTHS = "
                   "{'targets': 128}", only=True)
    object.__setattr__(self, 'tokenizer', tokenizer_lib.checked_spec(
        f'TOKENIZER ({fields.binding(self, "tokenizer")})', self.tokenizer))

  @property
  def length(self) -> int:
    return int(self.feature_lengths['targets'])

  def load_tokenizer(self) -> tokenizer_lib.Tokenizer:
    return _tokenizer(self.tokenizer)

  def describe(self) -> Dict[str, Any]:
    """JSON-serializable identity; the tokenizer by its files' digest, so a resumed run
    reads the same ids."""
    return {'kind': 'lm', 'task': self.task, 'split': self.split, 'length': self.length,
            'tokenizer': self.load_tokenizer().short_digest, 'pack': self.pack,
            'shuffle': self.shuffle}

  def batch_spec(self, batch_size: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    return {k: ((batch_size, self.length), np.dtype(np.int32)) for k in FEATURES}

  def batches(self, *, seed: int, batch_size: int, shard_index: int, num_shards: int,
              drop_remainder: bool, skip_batches: int) -> tf.data.Dataset:
    """One epoch of this host's shard, as batches, after `skip_batches` of them; a pure
    function of (seed, shard_index, num_shards)."""
    host_only.hide_accelerators()
    task = tasks.get_task(self.task, module=self.module,
                          task_binding=fields.binding(self, 'task'),
                          module_binding=fields.binding(self, 'module'))
    tasks.check_split(task, self.split, binding=fields.binding(self, 'split'))
    # As seqio's Task.get_dataset: a source that shards itself gets the shard, others are
    # read whole and sharded by example.
    by_source = num_shards > 1 and task.source.supports_arbitrary_sharding
    shard_info = seqio.ShardInfo(shard_index, num_shards) if by_source else None
    try:
      ds = task.source.get_dataset(split=self.split, shuffle=self.shuffle, seed=seed,
                                   shard_info=shard_info)
      if num_shards > 1 and not by_source:
        ds = ds.shard(num_shards, shard_index)
    except Exception as e:  # pylint: disable=broad-except  (TFDS and imports fail many ways)
      raise source_errors.source_error(self.task, task, e, module=self.module) from e
    ds = ds.flat_map(functools.partial(self._windows, tok=self.load_tokenizer()))
    if self.shuffle:
      ds = ds.shuffle(SHUFFLE_BUFFER, seed=seed)
    ds = self._rows(ds)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    return ds.skip(skip_batches)

  def _windows(self, example, *, tok: tokenizer_lib.Tokenizer) -> tf.data.Dataset:
    """A document -> its windows {'inputs', 'targets'} of at most `length` tokens."""

    def encode(text: bytes) -> np.ndarray:
      ids = tok.encode(text.decode('utf-8', errors='replace'))
      return np.asarray([tok.bos_id, *ids, tok.eos_id], np.int32)

    tokens = tf.numpy_function(encode, [example[self.text_key]], tf.int32, stateful=False)
    tokens.set_shape([None])
    starts = tf.range(0, tf.maximum(tf.size(tokens) - 1, 0), self.length)
    window = lambda s: tokens[s:s + self.length + 1]
    return tf.data.Dataset.from_tensor_slices(starts).map(
        lambda s: {'inputs': window(s)[:-1], 'targets': window(s)[1:]})

  def _rows(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    """Windows {'inputs', 'targets'} (and 'weights', where the loss weights are not every
    real token's) -> rows of FEATURES, packed or padded."""
    lengths = {'inputs': self.length, 'targets': self.length}
    if 'weights' in ds.element_spec:   # packed as weight + 1: seqio's packing takes 0 for padding
      lengths['weights'] = self.length
      ds = ds.map(lambda x: {**x, 'weights': x['weights'] + 1})
    if self.pack:
      ds = seqio.utils.trim_and_pack_dataset(ds, lengths)
      segments = lambda x: x['targets_segment_ids']
      positions = lambda x: x['targets_positions']
    else:
      ds = ds.map(lambda x: {**x, 'real': tf.ones_like(x['targets'])})
      ds = seqio.utils.trim_and_pad_dataset(ds, {**lengths, 'real': self.length})
      segments = lambda x: x['real']
      positions = lambda x: tf.range(self.length) * x['real']

    def features(x):
      segment_ids = tf.cast(segments(x), tf.int32)
      weights = (tf.maximum(x['weights'] - 1, 0) if 'weights' in x
                 else tf.cast(segment_ids > 0, tf.int32))
      return {'decoder_input_tokens': x['inputs'], 'decoder_target_tokens': x['targets'],
              'decoder_loss_weights': tf.cast(weights, tf.int32),
              'decoder_segment_ids': segment_ids,
              'decoder_positions': tf.cast(positions(x), tf.int32)}

    return ds.map(features, num_parallel_calls=tf.data.AUTOTUNE)
