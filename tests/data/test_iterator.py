"""DataIterator: determinism, exact resumption from a JSON state, disjoint host shards."""

import json
import logging

import numpy as np
import pytest

from tests.data.conftest import LETTERS, LETTERS_TASK, TEXT_LENGTHS
from tests.helpers import CountingPipeline
from upcycle.data import images
from upcycle.data import iterator
from upcycle.data import text

TEXT_KEYS = {'encoder_input_tokens', 'encoder_segment_ids', 'encoder_positions',
             'decoder_input_tokens', 'decoder_target_tokens', 'decoder_loss_weights',
             'decoder_segment_ids', 'decoder_positions'}


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_text_batches_are_packed_span_corruption(offline_run):
  _, first, _, _ = offline_run
  batch = first[0]
  assert set(batch) == TEXT_KEYS
  for k, v in batch.items():
    length = TEXT_LENGTHS['inputs' if k.startswith('encoder') else 'targets']
    assert v.shape == (2, length) and v.dtype == np.int32, k
  targets, inputs = batch['decoder_target_tokens'], batch['decoder_input_tokens']
  segments = batch['decoder_segment_ids']
  # Teacher forcing within each packed segment: inputs are targets shifted right, 0 at starts.
  starts = batch['decoder_positions'] == 0
  np.testing.assert_array_equal(inputs[:, 1:][~starts[:, 1:]], targets[:, :-1][~starts[:, 1:]])
  assert np.all(inputs[starts] == 0)
  np.testing.assert_array_equal(batch['decoder_loss_weights'], (targets > 0).astype(np.int32))
  np.testing.assert_array_equal(segments > 0, targets > 0)
  assert np.all(batch['encoder_segment_ids'].max(axis=1) == segments.max(axis=1))
  assert np.all(targets[segments > 0].max() <= 358) and np.any(targets >= 259)  # Sentinels.


def test_text_resumes_exactly(offline_run):
  pipeline, _, state, rest = offline_run
  assert state['batches'] == 3 and state['epoch'] == 0 and state['batch_in_epoch'] == 3
  restored = iterator.DataIterator(pipeline, batch_size=2, seed=0)
  restored.set_state(json.loads(json.dumps(state)))
  _assert_same([next(restored) for _ in range(3)], rest)
  assert restored.get_state()['batches'] == 6


def test_a_position_carries_to_another_batch_size_and_reads_on_from_the_next_example(
    offline_run):
  """restore_dataset with a larger batch: 3 batches of 2 read = 2 batches of 3; the next two
  batches of 3 are the next six examples of the batch-2 stream."""
  pipeline, _, state, rest = offline_run
  moved = iterator.rebatched(state, 3)
  assert (moved['batch_size'], moved['batch_in_epoch'], moved['epoch']) == (3, 2, 0)
  wider = iterator.DataIterator(pipeline, batch_size=3, seed=0)
  wider.set_state(moved)
  got = [next(wider) for _ in range(2)]
  for k in rest[0]:
    np.testing.assert_array_equal(np.concatenate([b[k] for b in got]),
                                  np.concatenate([b[k] for b in rest]), err_msg=k)
  assert iterator.rebatched(state, 2) == state
  with pytest.raises(ValueError, match=r'6 examples\) is not a whole number of batches of 4'):
    iterator.rebatched(state, 4)


def test_text_seed_changes_data(offline_run):
  pipeline, first, _, _ = offline_run
  other = iterator.DataIterator(pipeline, batch_size=2, seed=1)
  assert not np.array_equal(next(other)['encoder_input_tokens'], first[0]['encoder_input_tokens'])


def test_text_shards_are_disjoint(letters_task):
  del letters_task  # Registers LETTERS_TASK: document i is LETTERS[i] * 40.
  pipeline = text.TextPipeline(LETTERS_TASK, 'train', TEXT_LENGTHS)
  letters = []
  for shard in range(2):
    it = iterator.DataIterator(pipeline, batch_size=4, seed=0, shard_index=shard, num_shards=2,
                               num_epochs=1, drop_remainder=False)
    tokens = np.concatenate([b['encoder_input_tokens'].ravel() for b in it])
    letters.append({chr(t - 3) for t in tokens if 3 <= t < 259})
  assert not letters[0] & letters[1]
  assert letters[0] | letters[1] == set(LETTERS) and len(letters[0]) == 26


@pytest.mark.slow
def test_seqio_shuffle_warning_is_logged_at_most_once_not_per_epoch(letters_task, caplog):
  del letters_task
  pipeline = text.TextPipeline(LETTERS_TASK, 'train', TEXT_LENGTHS)
  it = iterator.DataIterator(pipeline, batch_size=4, seed=0, num_epochs=3)
  with caplog.at_level(logging.WARNING, logger='absl'):
    assert len(list(it)) >= 3 and it.get_state()['epoch'] == 3
  warnings = [r for r in caplog.records if 'uncached FunctionDataset' in r.getMessage()]
  assert len(warnings) <= 1


def test_image_resumes_across_epochs():
  pipeline = images.ImagePipeline(split='validation', image_size=8, train=True)
  it = iterator.DataIterator(pipeline, batch_size=64, seed=3)  # 297 // 64 = 4 per epoch.
  states, batches = [], []
  for _ in range(9):
    states.append(it.get_state())
    batches.append(next(it))
  # After an epoch's last batch the state still points into it; the next batch opens epoch 1.
  assert (states[4]['epoch'], states[4]['batch_in_epoch']) == (0, 4)
  assert (states[5]['epoch'], states[5]['batch_in_epoch']) == (1, 1)
  assert it.get_state() == dict(states[0], epoch=2, batch_in_epoch=1, batches=9)
  # Epochs differ (new shuffle and crops).
  assert not np.array_equal(batches[0]['label'], batches[4]['label'])
  for start in (4, 6):  # At an epoch's end; mid-epoch.
    restored = iterator.DataIterator(pipeline, batch_size=64, seed=3)
    restored.set_state(json.loads(json.dumps(states[start])))
    _assert_same([next(restored) for _ in range(9 - start)], batches[start:])
  other = iterator.DataIterator(pipeline, batch_size=64, seed=4)
  assert not np.array_equal(next(other)['image'], batches[0]['image'])


def test_image_shards_are_disjoint_and_equal():
  pipeline = images.ImagePipeline(split='validation', image_size=8, train=False)
  seen = []
  for shard in range(3):
    it = iterator.DataIterator(pipeline, batch_size=7, seed=0, shard_index=shard, num_shards=3,
                               num_epochs=1, drop_remainder=False)
    seen.append({row.tobytes() for b in it for row in b['image']})
  assert [len(s) for s in seen] == [99, 99, 99]
  assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


def test_element_spec_is_the_batch_layout():
  pipeline = images.ImagePipeline(split='validation', image_size=8)
  spec = iterator.DataIterator(pipeline, batch_size=4, seed=0).element_spec
  assert spec['image'].shape.as_list() == [4, 8, 8, 3] and spec['image'].dtype.name == 'float32'
  assert spec['label'].shape.as_list() == [4] and spec['label'].dtype.name == 'int32'


def test_the_spec_is_built_once_with_the_epoch_it_describes():
  """The trainer asks the shapes first (`HostData.example`): the pipeline built for them is
  the one its first epoch reads; a position set after (a resumed run) gets its own, and the
  batches are those of an iterator never asked."""
  pipeline = images.ImagePipeline(split='validation', image_size=8, train=False)
  plain = iterator.DataIterator(pipeline, batch_size=4, seed=0)
  expected = [next(plain) for _ in range(4)]
  counted = CountingPipeline(pipeline)
  asked = iterator.DataIterator(counted, batch_size=4, seed=0)
  assert asked.element_spec['image'].shape.as_list() == [4, 8, 8, 3]
  _assert_same([next(asked) for _ in range(2)], expected[:2])
  assert counted.reads == 1
  resumed = iterator.DataIterator(counted, batch_size=4, seed=0)
  assert resumed.element_spec
  resumed.set_state(asked.get_state())
  _assert_same([next(resumed) for _ in range(2)], expected[2:])
  assert counted.reads == 3


def test_state_mismatch_and_bad_arguments_are_errors():
  pipeline = images.ImagePipeline(split='validation', image_size=8, train=False)
  state = iterator.DataIterator(pipeline, batch_size=4, seed=0).get_state()
  with pytest.raises(ValueError, match=r"seed: checkpoint 0 vs this iterator 1"):
    iterator.DataIterator(pipeline, batch_size=4, seed=1).set_state(state)
  other = images.ImagePipeline(split='validation', image_size=16, train=False)
  with pytest.raises(ValueError, match='different data configuration'):
    iterator.DataIterator(other, batch_size=4, seed=0).set_state(state)
  with pytest.raises(ValueError, match='jax.process_index'):
    iterator.DataIterator(pipeline, batch_size=4, seed=0, shard_index=2, num_shards=2)
  with pytest.raises(ValueError, match='lower batch_size'):
    next(iterator.DataIterator(pipeline, batch_size=1000, seed=0))
  with pytest.raises(ValueError, match='not a registered seqio task'):
    next(iterator.DataIterator(text.TextPipeline('nope', 'train', TEXT_LENGTHS), batch_size=2,
                               seed=0))
