"""T5 span corruption (Raffel et al., 2020, Sec. 3.1.4) as a seqio preprocessor.

A chunk of `tokens_length` tokens loses ~`noise_density` of its tokens in spans of mean length
`mean_noise_span_length`. Inputs keep the other tokens with one sentinel per dropped span; targets
are each sentinel followed by the span it stands for:

  tokens   Thank you for inviting me to your party last week .
  inputs   Thank you <X> me to your party <Y> week .
  targets  <X> for inviting <Y> last <Z>

Sentinel i is `vocabulary.vocab_size - 1 - i` (T5's convention): the i-th extra id of a
`seqio.SentencePieceVocabulary` (extra ids are reversed), and of a `seqio.ByteVocabulary` built with
`extra_ids`. Reimplemented from t5.data.preprocessors with the same semantics; T5 is not a
dependency. Random choices take their seeds from `seqio.map_over_dataset`, so a pipeline built
under a seed is deterministic.
"""

from typing import Mapping, Tuple

import tensorflow as tf
import seqio

from upcycle.data import chunking

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0


class LengthError(ValueError):
  """The task feature lengths cannot hold a span-corrupted example."""


def _corrupted_lengths(tokens_length: int, noise_density: float,
                       mean_noise_span_length: float) -> Tuple[int, int, int]:
  """(noise spans, inputs length, targets length) of a `tokens_length` chunk as
  `random_spans_helper` counts them: inputs hold the non-noise tokens, a sentinel per span and
  EOS; targets the noise tokens, a sentinel per span and EOS."""
  num_noise_tokens = int(round(tokens_length * noise_density))
  num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
  return (num_noise_spans, tokens_length - num_noise_tokens + num_noise_spans + 1,
          num_noise_tokens + num_noise_spans + 1)


def random_spans_helper(
    inputs_length: int,
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> Tuple[int, int]:
  """(tokens_length, targets_length): the longest chunk whose corrupted inputs fit.

  Inputs hold the non-noise tokens, one sentinel per noise span and EOS; targets hold the noise
  tokens, one sentinel per span and EOS. For inputs_length=512 this is (568, 114), T5's numbers.
  """

  lengths = lambda n: _corrupted_lengths(n, noise_density, mean_noise_span_length)[1:]
  tokens_length = inputs_length - 1
  while lengths(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  _, targets_length = lengths(tokens_length)
  if noise_density == 0.5 and targets_length > inputs_length:  # T5: keep targets == inputs.
    tokens_length -= 1
    targets_length -= 1
  return tokens_length, targets_length


def _spans_fit(inputs_length: int, noise_density: float, mean_noise_span_length: float) -> bool:
  """Whether `random_spans_helper`'s chunk for `inputs_length` has a whole noise span, so that
  the corrupted inputs (non-noise, a sentinel per span, EOS) fit."""
  tokens_length, _ = random_spans_helper(inputs_length, noise_density, mean_noise_span_length)
  return _corrupted_lengths(tokens_length, noise_density, mean_noise_span_length)[0] >= 1


def num_noise_spans(
    length: int,
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> int:
  """How many spans `random_spans_noise_mask` cuts from `length` tokens (same arithmetic)."""
  length = max(length, 2)
  noise = min(max(int(round(length * noise_density)), 1), length - 1)
  return max(int(round(noise / mean_noise_span_length)), 1)


def random_spans_noise_mask(
    length: tf.Tensor,
    noise_density: float,
    seeds: tf.Tensor,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
) -> tf.Tensor:
  """Boolean noise mask `[length]` made of alternating non-noise / noise spans.

  round(length * noise_density) tokens are noise (at least 1, at most length - 1), cut into
  round(num_noise / mean_noise_span_length) spans (at least 1); the non-noise tokens are cut into
  as many spans. Span lengths are uniform random compositions. The mask starts with non-noise
  and ends with noise.

  Args:
    length: scalar int32, the number of tokens.
    noise_density: fraction of tokens that are noise.
    seeds: `[2, 2]` int32, stateless seeds for the noise and non-noise span lengths.
    mean_noise_span_length: mean length of a noise span.
  """
  orig_length = length
  length = tf.maximum(length, 2)  # Avoid degeneracy.
  num_noise_tokens = tf.cast(tf.round(tf.cast(length, tf.float32) * noise_density), tf.int32)
  num_noise_tokens = tf.minimum(tf.maximum(num_noise_tokens, 1), length - 1)
  num_spans = tf.cast(
      tf.round(tf.cast(num_noise_tokens, tf.float32) / mean_noise_span_length), tf.int32)
  num_spans = tf.maximum(num_spans, 1)
  num_nonnoise_tokens = length - num_noise_tokens

  def random_segmentation(num_items, num_segments, seed):
    """Lengths `[num_segments]` of a random partition of num_items items into non-empty runs."""
    first_in_segment = tf.pad(
        seqio.stateless_shuffle(
            tf.cast(tf.range(num_items - 1) < num_segments - 1, tf.int32), seed),
        [[1, 0]])
    segment_id = tf.cumsum(first_in_segment)
    return tf.math.segment_sum(tf.ones_like(segment_id), segment_id)

  noise_span_lengths = random_segmentation(num_noise_tokens, num_spans, seeds[0])
  nonnoise_span_lengths = random_segmentation(num_nonnoise_tokens, num_spans, seeds[1])
  interleaved = tf.reshape(
      tf.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_spans * 2])
  span_starts = tf.cumsum(interleaved)[:-1]
  span_start_indicator = tf.math.unsorted_segment_sum(
      tf.ones_like(span_starts), span_starts, length)
  span_num = tf.cumsum(span_start_indicator)
  is_noise = tf.equal(span_num % 2, 1)
  return is_noise[:orig_length]


def noise_span_to_unique_sentinel(
    tokens: tf.Tensor, noise_mask: tf.Tensor, vocab_size: int
) -> tf.Tensor:
  """Replaces each noise span of `tokens` `[n]` by one sentinel, counting down from vocab_size-1."""
  prev_token_is_noise = tf.pad(noise_mask[:-1], [[1, 0]])
  first_noise_tokens = tf.logical_and(noise_mask, tf.logical_not(prev_token_is_noise))
  subsequent_noise_tokens = tf.logical_and(noise_mask, prev_token_is_noise)
  sentinel = vocab_size - tf.cumsum(tf.cast(first_noise_tokens, tokens.dtype))
  tokens = tf.where(first_noise_tokens, sentinel, tokens)
  return tf.boolean_mask(tokens, tf.logical_not(subsequent_noise_tokens))


def nonnoise_span_to_unique_sentinel(
    tokens: tf.Tensor, noise_mask: tf.Tensor, vocab_size: int
) -> tf.Tensor:
  """Replaces each non-noise span by one sentinel: the targets of span corruption."""
  return noise_span_to_unique_sentinel(tokens, tf.logical_not(noise_mask), vocab_size)


def span_corruption(
    dataset: tf.data.Dataset,
    sequence_length: Mapping[str, int],
    output_features: Mapping[str, seqio.Feature],
    noise_density: float = NOISE_DENSITY,
    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
    merge_examples_to_reduce_padding: bool = True,
) -> tf.data.Dataset:
  """seqio preprocessor: tokenized `targets` documents -> span-corrupted `inputs`/`targets`.

  Documents are cut to a random chunk, concatenated in runs of 128 (when
  `merge_examples_to_reduce_padding`) and split into `tokens_length` pieces such that the
  corrupted inputs plus EOS fill `sequence_length['inputs']` (`random_spans_helper`). EOS is
  added later by `seqio.preprocessors.append_eos_after_trim`.
  """
  inputs_length = sequence_length['inputs']
  tokens_length, targets_length = random_spans_helper(
      inputs_length, noise_density, mean_noise_span_length)
  if not _spans_fit(inputs_length, noise_density, mean_noise_span_length):
    shortest = next(n for n in range(inputs_length + 1, 10 * inputs_length + 100)
                    if _spans_fit(n, noise_density, mean_noise_span_length))
    raise LengthError(
        f'Span corruption with inputs length {inputs_length} (noise density {noise_density}, '
        f'mean span {mean_noise_span_length}) leaves no room for a corrupted span: the '
        f'examples would be their text copied, with no sentinel in the inputs. Set the task '
        f"feature lengths to at least {{'inputs': {shortest}, 'targets': "
        f'{random_spans_helper(shortest, noise_density, mean_noise_span_length)[1]}}}.')
  if sequence_length['targets'] < targets_length:
    raise LengthError(
        f"Span corruption with inputs length {inputs_length} (noise density {noise_density}, "
        f"mean span {mean_noise_span_length}) makes targets of up to {targets_length} tokens, but "
        f"the targets feature length is {sequence_length['targets']}. Set the task feature "
        f"lengths to {{'inputs': {inputs_length}, 'targets': {targets_length}}}.")
  vocabulary = output_features['targets'].vocabulary
  inputs_vocabulary = output_features['inputs'].vocabulary if 'inputs' in output_features else None
  if inputs_vocabulary is not None and inputs_vocabulary is not vocabulary and (
      inputs_vocabulary != vocabulary):
    raise ValueError('Span corruption needs the same vocabulary for inputs and targets; the '
                     'task output_features give two different ones.')
  spans = num_noise_spans(tokens_length, noise_density, mean_noise_span_length)
  if vocabulary.extra_ids < spans:
    raise ValueError(
        f'Span corruption of {tokens_length}-token chunks needs {spans} sentinels, but the '
        f'vocabulary {vocabulary!r} has extra_ids={vocabulary.extra_ids}: sentinels would collide '
        f'with real tokens. Build the vocabulary with extra_ids >= {spans} (T5 uses 100).')
  vocab_size = vocabulary.vocab_size

  dataset = chunking.select_random_chunk(dataset)
  if merge_examples_to_reduce_padding:
    dataset = chunking.reduce_concat_tokens(dataset, batch_size=128)
  dataset = chunking.split_tokens(dataset, max_tokens_per_segment=tokens_length)

  @seqio.map_over_dataset(num_seeds=2)
  def corrupt(x, seeds):
    tokens = x['targets']
    noise_mask = random_spans_noise_mask(
        tf.size(tokens), noise_density, seeds, mean_noise_span_length)
    return {
        'inputs': noise_span_to_unique_sentinel(tokens, noise_mask, vocab_size),
        'targets': nonnoise_span_to_unique_sentinel(tokens, noise_mask, vocab_size),
    }

  return corrupt(dataset)
