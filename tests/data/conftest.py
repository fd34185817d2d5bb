"""Shared, session-scoped fixtures: TensorFlow pipelines are slow to build, so build each once."""

import numpy as np
import pytest
import seqio
import tensorflow as tf

from upcycle.data import iterator
from upcycle.data import offline_text
from upcycle.data import tasks
from upcycle.data import text

TEXT_LENGTHS = {'inputs': 32, 'targets': 8}
LETTERS = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'
LETTERS_TASK = 'test_letters_span_corruption'
DOCS_TASK = 'test_docs_span_corruption'


def _function_source(docs):
  """A seqio source over `docs` (seeded numpy shuffle, like `offline_text.dataset_fn`)."""

  def dataset_fn(split, shuffle_files, seed=None):
    del split
    order = range(len(docs))
    if shuffle_files:
      order = np.random.default_rng(seed).permutation(len(docs))
    return tf.data.Dataset.from_tensor_slices({'text': [docs[i] for i in order]})

  return seqio.FunctionDataSource(dataset_fn, splits=('train',))


@pytest.fixture(scope='session')
def letters_task():
  """52 documents; document i is LETTERS[i] * 40, so every byte token names its document."""
  return tasks.add_span_corruption_task(
      LETTERS_TASK, _function_source([c * 40 for c in LETTERS]),
      seqio.ByteVocabulary(extra_ids=100))


@pytest.fixture(scope='session')
def docs():
  """30 real paragraphs from the offline corpus."""
  return list(offline_text.paragraphs('validation')[:30])


@pytest.fixture(scope='session')
def docs_task(docs):
  return tasks.add_span_corruption_task(
      DOCS_TASK, _function_source(docs), seqio.ByteVocabulary(extra_ids=100))


@pytest.fixture(scope='session')
def offline_run():
  """The default text task, seed 0, batch 2: 3 batches, the state after them, 3 more batches."""
  pipeline = text.TextPipeline(tasks.OFFLINE_TASK, 'train', TEXT_LENGTHS)
  it = iterator.DataIterator(pipeline, batch_size=2, seed=0)
  first = [next(it) for _ in range(3)]
  state = it.get_state()
  rest = [next(it) for _ in range(3)]
  return pipeline, first, state, rest
