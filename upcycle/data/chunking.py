"""Cutting token streams into pieces: T5's `select_random_chunk`, `reduce_concat_tokens`,
`split_tokens`, on the `targets` feature of seqio datasets.

Semantics follow t5.data.preprocessors (reimplemented here: T5 is not a dependency). Random
choices take their seeds from `seqio.map_over_dataset`, so a pipeline built under a seed
(`Task.get_dataset(seed=...)`) is deterministic.
"""

import tensorflow as tf
import seqio

AUTOTUNE = tf.data.AUTOTUNE


def select_random_chunk(
    dataset: tf.data.Dataset, *, max_length: int = 65536, feature_key: str = 'targets'
) -> tf.data.Dataset:
  """One random aligned chunk of at most `max_length` tokens per document; drops empty ones.

  The chunk is segment `k` of the document cut into `max_length` pieces, `k` uniform (T5's
  default `uniform_random_start=False`). Other features are dropped.
  """

  @seqio.map_over_dataset(num_seeds=1)
  def chunk(x, seed):
    tokens = x[feature_key]
    n_tokens = tf.shape(tokens)[0]
    num_segments = tf.cast(
        tf.math.ceil(tf.cast(n_tokens, tf.float32) / tf.cast(max_length, tf.float32)), tf.int32)
    start = max_length * tf.random.stateless_uniform(
        [], seed=seed, maxval=num_segments, dtype=tf.int32)
    end = tf.minimum(start + max_length, n_tokens)
    return {feature_key: tokens[start:end]}

  dataset = dataset.filter(lambda x: tf.not_equal(tf.size(x[feature_key]), 0))
  return chunk(dataset)


def reduce_concat_tokens(
    dataset: tf.data.Dataset, *, batch_size: int = 128, feature_key: str = 'targets'
) -> tf.data.Dataset:
  """Concatenates runs of `batch_size` consecutive documents into one token stream.

  Token id 0 is padding and is removed, as in T5 (no vocabulary maps text to id 0).
  """
  dataset = dataset.map(lambda x: {feature_key: x[feature_key]}, num_parallel_calls=AUTOTUNE)
  dataset = dataset.padded_batch(batch_size, padded_shapes={feature_key: [-1]})

  def concat(x):
    tokens = tf.reshape(x[feature_key], [-1])
    return {feature_key: tf.boolean_mask(tokens, tf.cast(tokens, tf.bool))}

  return dataset.map(concat, num_parallel_calls=AUTOTUNE)


def split_tokens(
    dataset: tf.data.Dataset, *, max_tokens_per_segment: int, feature_key: str = 'targets'
) -> tf.data.Dataset:
  """Splits every token stream into consecutive segments of `max_tokens_per_segment` tokens.

  The last segment of a stream keeps the remainder (shorter, never empty).
  """
  length = max_tokens_per_segment

  def split(x):
    tokens = x[feature_key]
    n_tokens = tf.shape(tokens)[0]
    num_segments = (n_tokens + length - 1) // length
    padding = num_segments * length - n_tokens
    segments = tf.reshape(tf.pad(tokens, [[0, padding]]), [-1, length])
    lengths = tf.concat([tf.fill([num_segments - 1], length), [length - padding]], axis=0)
    return {feature_key: segments, 'length': lengths}

  dataset = dataset.filter(lambda x: tf.not_equal(tf.size(x[feature_key]), 0))
  dataset = dataset.map(split, num_parallel_calls=AUTOTUNE).unbatch()
  return dataset.map(
      lambda x: {feature_key: x[feature_key][:x['length']]}, num_parallel_calls=AUTOTUNE)
