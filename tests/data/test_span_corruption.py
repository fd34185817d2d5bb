"""T5 span corruption: span arithmetic, noise-mask statistics, exact reconstruction."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from upcycle.data import span_corruption as sc

VOCAB = seqio.ByteVocabulary(extra_ids=100)  # vocab_size 359: sentinels 358, 357, ...


@tf.function
def _traced_mask(length, seeds):
  return sc.random_spans_noise_mask(length, 0.15, seeds, 3.0)


def _mask(length, seed):
  seeds = tf.constant([[seed, 1], [seed, 2]], tf.int32)
  return _traced_mask(tf.constant(length), seeds).numpy()


def _spans(mask):
  """Number of runs of True."""
  return int(np.sum(mask[1:] & ~mask[:-1]) + mask[0])


def _reconstruct(inputs, targets, vocab_size, extra_ids=100):
  """Undoes span corruption: each sentinel of `inputs` -> the tokens after it in `targets`."""
  is_sentinel = lambda t: t >= vocab_size - extra_ids
  spans, current = {}, None
  for t in targets:
    if is_sentinel(t):
      current = spans.setdefault(int(t), [])
    else:
      current.append(int(t))
  out = []
  for t in inputs:
    out.extend(spans[int(t)] if is_sentinel(t) else [int(t)])
  return out


def test_random_spans_helper_matches_t5():
  # T5's published feature lengths for span corruption: inputs 512 -> targets 114.
  assert sc.random_spans_helper(512) == (568, 114)
  for inputs_length in (16, 32, 64, 100, 512, 1024):
    tokens_length, targets_length = sc.random_spans_helper(inputs_length)
    noise = int(round(tokens_length * 0.15))
    spans = int(round(noise / 3))
    assert tokens_length - noise + spans + 1 == inputs_length or inputs_length < 20
    assert targets_length == noise + spans + 1
    longer = tokens_length + 1
    assert longer - round(longer * 0.15) + round(round(longer * 0.15) / 3) + 1 > inputs_length


@pytest.mark.parametrize('length', [2, 7, 20, 64, 101, 568])
def test_noise_mask_counts(length):
  noise = int(np.clip(np.round(np.float32(length) * np.float32(0.15)), 1, length - 1))
  spans = max(int(np.round(np.float32(noise) / np.float32(3.0))), 1)
  for seed in range(5):
    mask = _mask(length, seed)
    assert mask.shape == (length,) and mask.dtype == bool
    assert mask.sum() == noise
    assert _spans(mask) == spans == _spans(~mask)  # Alternating runs, as many of each.
    assert not mask[0] and mask[-1]  # Starts with non-noise, ends with noise.
  assert sc.num_noise_spans(length) == spans


def test_noise_mask_statistics():
  masks = np.stack([_mask(100, seed) for seed in range(300)])
  assert masks.mean() == pytest.approx(0.15)  # round(100 * 0.15) = 15 noise tokens, always.
  # Spans land everywhere: per-position noise rate is ~density away from the fixed ends.
  per_position = masks[:, 5:95].mean(axis=0)
  assert 0.07 < per_position.min() and per_position.max() < 0.26
  # Mean noise span length 15 / round(15 / 3) = 3, with varied span lengths.
  lengths = np.concatenate([np.diff(np.flatnonzero(np.diff(np.r_[0, m.astype(int), 0]))) [::2]
                            for m in masks])
  assert lengths.mean() == pytest.approx(3.0)
  assert lengths.min() == 1 and lengths.max() >= 7
  assert len({m.tobytes() for m in masks}) == 300  # Seeds give different masks.


def test_sentinels_on_handmade_mask():
  tokens = tf.constant([10, 11, 12, 13, 14, 15, 16, 17])
  mask = tf.constant([False, False, True, True, False, False, True, False])
  inputs = sc.noise_span_to_unique_sentinel(tokens, mask, VOCAB.vocab_size).numpy()
  targets = sc.nonnoise_span_to_unique_sentinel(tokens, mask, VOCAB.vocab_size).numpy()
  assert VOCAB.vocab_size == 359
  np.testing.assert_array_equal(inputs, [10, 11, 358, 14, 15, 357, 17])
  np.testing.assert_array_equal(targets, [358, 12, 13, 357, 16, 356])


def test_reconstruction_with_random_mask():
  tokens = np.arange(3, 3 + 568, dtype=np.int32) % 250 + 3
  mask = _mask(568, seed=7)
  inputs = sc.noise_span_to_unique_sentinel(tf.constant(tokens), tf.constant(mask), 359).numpy()
  targets = sc.nonnoise_span_to_unique_sentinel(tf.constant(tokens), tf.constant(mask), 359).numpy()
  assert len(inputs) == 568 - 85 + 28 and len(targets) == 85 + 28  # 512 and 114 with EOS.
  np.testing.assert_array_equal(inputs[inputs >= 259], 358 - np.arange(28))
  np.testing.assert_array_equal(targets[targets >= 259], 358 - np.arange(28))
  assert _reconstruct(inputs, targets, 359) == tokens.tolist()


def test_task_examples_reconstruct_the_corpus(docs, docs_task):
  lengths = {'inputs': 64, 'targets': 16}
  tokens_length, targets_length = sc.random_spans_helper(64)
  assert (tokens_length, targets_length) == (70, 14)
  ds = docs_task.get_dataset(lengths, split='train', shuffle=False, seed=3)
  examples = list(ds.as_numpy_iterator())
  text = []
  for i, ex in enumerate(examples):
    inputs, targets = ex['inputs'], ex['targets']
    assert inputs[-1] == 1 and targets[-1] == 1  # EOS.
    assert len(inputs) <= 64 and len(targets) <= targets_length
    if i < len(examples) - 1:  # Full chunks fill the inputs exactly.
      assert len(inputs) == 64 and len(targets) == targets_length
    chunk = _reconstruct(inputs[:-1], targets[:-1], VOCAB.vocab_size)
    assert len(chunk) == tokens_length or i == len(examples) - 1
    text.append(VOCAB.decode(chunk))
  # < 128 documents: one concatenated stream, split in order, nothing lost or reordered.
  assert ''.join(text) == ''.join(docs)


def test_errors_name_the_fix():
  features = {'inputs': seqio.Feature(VOCAB), 'targets': seqio.Feature(VOCAB)}
  ds = tf.data.Dataset.from_tensor_slices({'targets': [[5, 6, 7]]})
  with pytest.raises(ValueError, match=r"'targets': 114"):
    sc.span_corruption(ds, {'inputs': 512, 'targets': 100}, features)
  no_sentinels = seqio.ByteVocabulary(extra_ids=0)
  features = {'inputs': seqio.Feature(no_sentinels), 'targets': seqio.Feature(no_sentinels)}
  with pytest.raises(ValueError, match='extra_ids >= 28'):
    sc.span_corruption(ds, {'inputs': 512, 'targets': 114}, features)
