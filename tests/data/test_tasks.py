"""Registered tasks and the offline corpora."""

import pathlib
import sysconfig

import numpy as np
import pytest
import seqio
import sentencepiece
import tensorflow as tf
import tensorflow_datasets as tfds

from upcycle.data import offline_text
from upcycle.data import tasks


def test_offline_corpus_splits_are_real_disjoint_text():
  train, validation = offline_text.paragraphs('train'), offline_text.paragraphs('validation')
  assert len(train) > 1500 and len(validation) > 100
  assert sum(map(len, train)) > 300_000
  assert not set(train) & set(validation)
  assert len(set(train)) == len(train)
  assert any('lambda' in p for p in train + validation)
  assert offline_text.paragraphs('train') is train  # Cached, same order every call.


def test_offline_source_order_is_seeded():
  take = lambda ds: [x['text'] for x in ds.take(20).as_numpy_iterator()]
  a = take(offline_text.dataset_fn('train', shuffle_files=True, seed=1))
  b = take(offline_text.dataset_fn('train', shuffle_files=True, seed=1))
  c = take(offline_text.dataset_fn('train', shuffle_files=True, seed=2))
  plain = take(offline_text.dataset_fn('train', shuffle_files=False))
  assert a == b and a != c
  assert plain == [p.encode() for p in offline_text.paragraphs('train')[:20]]


def test_registered_tasks():
  offline = seqio.get_mixture_or_task(tasks.OFFLINE_TASK)
  c4 = seqio.get_mixture_or_task(tasks.C4_TASK)
  assert tuple(offline.splits) == tuple(c4.splits) == ('train', 'validation')
  vocab = offline.output_features['targets'].vocabulary
  assert vocab == seqio.ByteVocabulary(extra_ids=100) and vocab.vocab_size == 359
  c4_vocab = c4.output_features['targets'].vocabulary
  assert c4_vocab.sentencepiece_model_file == tasks.T5_VOCABULARY_PATH  # Not loaded: lazy.
  assert c4_vocab.extra_ids == 100
  assert c4.source.tfds_dataset.name == 'c4/en:3.1.0'
  moved = tasks.add_c4_span_corruption(vocabulary_path='/data/spm.model')
  try:
    assert seqio.get_mixture_or_task(tasks.C4_TASK) is moved
    assert moved.output_features['inputs'].vocabulary.sentencepiece_model_file == '/data/spm.model'
  finally:
    tasks.add_c4_span_corruption()


def test_offline_task_examples():
  task = seqio.get_mixture_or_task(tasks.OFFLINE_TASK)
  ds = task.get_dataset({'inputs': 32, 'targets': 8}, split='validation', shuffle=True, seed=5)
  examples = list(ds.take(50).as_numpy_iterator())
  for ex in examples:
    assert ex['inputs'].dtype == np.int32 and ex['inputs'][-1] == 1 and ex['targets'][-1] == 1
    sentinels = ex['targets'][ex['targets'] >= 259]
    np.testing.assert_array_equal(sentinels, 358 - np.arange(len(sentinels)))
    np.testing.assert_array_equal(ex['inputs'][ex['inputs'] >= 259], sentinels[:len(
        ex['inputs'][ex['inputs'] >= 259])])
  assert sum(len(ex['inputs']) == 32 for ex in examples) > 40


def test_stdlib_corpus_is_the_standard_librarys_modules_split_by_module():
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  modules = offline_text.stdlib_modules()
  names = [m.relative_to(root).as_posix() for m in modules]
  assert names == sorted(names) and 'json/decoder.py' in names and 'difflib.py' in names
  assert not any(n.startswith(('test/', 'encodings/', 'site-packages/')) for n in names)
  train, validation = (offline_text.stdlib_documents(s) for s in ('train', 'validation'))
  size = lambda docs: sum(len(d.encode()) for d in docs)
  assert size(train) > 5_000_000 and size(validation) > 500_000   # ~8.0 and ~1.2 MB on 3.11
  assert max(len(d.encode()) for d in train + validation) <= offline_text.STDLIB_DOCUMENT_BYTES
  joined = {'train': ''.join(train), 'validation': ''.join(validation)}
  for i, module in enumerate(modules[:60]):   # every module's text whole in its split only
    text = module.read_text(encoding='utf-8', errors='replace').strip()
    split, other = ('validation', 'train') if i % 10 == 0 else ('train', 'validation')
    assert text in joined[split], names[i]
    assert len(text) < 200 or text not in joined[other], names[i]


def test_stdlib_task_examples_are_spans_of_the_corpus():
  task = seqio.get_mixture_or_task(tasks.OFFLINE_STDLIB_TASK)
  assert task.output_features['targets'].vocabulary == seqio.ByteVocabulary(extra_ids=100)
  ds = task.get_dataset({'inputs': 64, 'targets': 16}, split='validation', shuffle=True, seed=3)
  corpus = ''.join(offline_text.stdlib_documents('validation')).encode()
  for ex in ds.take(20).as_numpy_iterator():
    kept = ex['inputs'][:-1]          # bytes + 3, sentinels (>= 259) where spans were dropped
    for piece in np.split(kept, np.flatnonzero(kept >= 259)):
      text = bytes((piece[piece < 259] - 3).astype(np.uint8).tolist())
      assert text in corpus


@pytest.fixture(scope='module')
def sentencepiece_model(tmp_path_factory):
  """A small SentencePiece model trained on the offline corpus (T5's real one is on GCS)."""
  prefix = str(tmp_path_factory.mktemp('spm') / 'spm')
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(offline_text.paragraphs('validation')), model_prefix=prefix,
      vocab_size=300, model_type='unigram', pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
  return prefix + '.model'


def test_c4_version_is_one_the_pinned_tfds_builds(tmp_path):
  builder = tfds.builder(tasks.C4_TFDS_NAME, data_dir=str(tmp_path))   # No download.
  assert str(builder.info.version) == '3.1.0' and 'text' in builder.info.features


def test_c4_task_preprocessors_run_on_in_memory_records(sentencepiece_model):
  task = tasks.add_c4_span_corruption(name='test_c4', vocabulary_path=sentencepiece_model)
  try:
    assert seqio.get_mixture_or_task('test_c4').source.tfds_dataset.name == 'c4/en:3.1.0'
    docs = list(offline_text.paragraphs('validation')[:8])
    records = tf.data.Dataset.from_tensor_slices({   # c4/en:3.1.0's fields
        'text': docs, 'url': ['https://example.org'] * 8, 'timestamp': ['2019-04-25'] * 8,
        'content-type': ['text/plain'] * 8, 'content-length': ['100'] * 8})
    lengths = {'inputs': 64, 'targets': 16}
    ds = task.preprocess_postcache(task.preprocess_precache(records, seed=0), lengths, seed=0)
    examples = list(ds.as_numpy_iterator())
  finally:
    seqio.TaskRegistry.remove('test_c4')
  vocab = task.output_features['targets'].vocabulary
  assert vocab.vocab_size == 400 and len(examples) >= 4
  first_sentinel = vocab.vocab_size - 1
  for ex in examples:
    assert ex['inputs'][-1] == ex['targets'][-1] == 1   # EOS
    assert len(ex['inputs']) <= 64 and len(ex['targets']) <= 16
    sentinels = ex['targets'][ex['targets'] >= 300]
    np.testing.assert_array_equal(sentinels, first_sentinel - np.arange(len(sentinels)))
  assert any(len(ex['targets'][ex['targets'] >= 300]) > 0 for ex in examples)
  pieces = vocab.decode(examples[0]['inputs'][examples[0]['inputs'] < 300].tolist())
  assert pieces.split()[0] in docs[0]   # real text, tokenized by the task's vocabulary
