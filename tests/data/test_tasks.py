"""Registered tasks and the offline corpora."""

import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import numpy as np
import pytest
import seqio
import sentencepiece
import tensorflow as tf
import tensorflow_datasets as tfds

from upcycle import fields
from upcycle.data import offline_text
from upcycle.data import source_errors
from upcycle.data import tasks
from upcycle.data import text

# T5's C4 span-corruption task and the TFDS version it reads, as t5/data/tasks.py registers it
# (T5X's examples, e.g. t5_1_1/examples/base_c4_pretrain.gin, train on it).
T5_C4_TASKS = {'c4_v220_span_corruption': 'c4/en:2.2.0'}


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


@pytest.mark.parametrize('name', sorted(tasks.C4_TASKS))
def test_c4_versions_are_ones_the_pinned_tfds_reads(name, tmp_path):
  tfds_name = tasks.C4_TASKS[name]
  builder = tfds.builder(tfds_name, data_dir=str(tmp_path))   # No download.
  assert str(builder.info.version) == tfds_name.split(':')[1] and 'text' in builder.info.features


def test_t5s_c4_tasks_are_registered_with_t5s_versions_and_vocabulary():
  assert T5_C4_TASKS.items() <= tasks.C4_TASKS.items()
  assert tasks.C4_TASKS[tasks.C4_TASK] == 'c4/en:3.1.0'   # the version the pinned TFDS builds
  for name, tfds_name in tasks.C4_TASKS.items():
    task = seqio.get_mixture_or_task(name)
    assert task.source.tfds_dataset.name == tfds_name
    assert tuple(task.splits) == ('train', 'validation')
    vocab = task.output_features['targets'].vocabulary
    assert vocab.sentencepiece_model_file == tasks.T5_VOCABULARY_PATH and vocab.extra_ids == 100
    assert task.output_features['inputs'].vocabulary is vocab


def _noise_counts(example, vocab_size):
  """(tokens, noise tokens, noise spans) of a span-corrupted example: targets hold the noise,
  inputs the rest; each has one sentinel per span and EOS."""
  inputs, targets = example['inputs'][:-1], example['targets'][:-1]
  spans = int(np.sum(inputs >= vocab_size - 100))
  noise = int(np.sum(targets < vocab_size - 100))
  return noise + int(np.sum(inputs < vocab_size - 100)), noise, spans


@pytest.mark.parametrize('name', sorted(tasks.C4_TASKS))
def test_c4_task_preprocessors_run_on_in_memory_records(name, sentencepiece_model):
  task = tasks.add_c4_span_corruption(name='test_c4', vocabulary_path=sentencepiece_model,
                                      tfds_name=tasks.C4_TASKS[name])
  try:
    assert seqio.get_mixture_or_task('test_c4').source.tfds_dataset.name == tasks.C4_TASKS[name]
    docs = list(offline_text.paragraphs('validation')[:8])
    records = tf.data.Dataset.from_tensor_slices({   # the fields of both C4 versions
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
  for example in examples:   # T5's span_corruption: noise density 0.15, mean noise span 3
    length, noise, spans = _noise_counts(example, vocab.vocab_size)
    assert noise == min(max(round(length * 0.15), 1), length - 1), (length, noise)
    assert spans == max(round(noise / 3), 1), (noise, spans)
  assert max(len(ex['inputs']) for ex in examples) == 64   # chunks sized to fill the inputs


def test_a_c4_version_the_pinned_tfds_cannot_build_is_one_line_that_says_so(tmp_path):
  name = 'c4_v220_span_corruption'
  tasks.add_c4_span_corruption(name, tfds_name='c4/en:2.2.0', tfds_data_dir=str(tmp_path))
  try:
    with pytest.raises(source_errors.SourceError) as raised:
      text.TextPipeline(name, 'train', {'inputs': 64, 'targets': 16}).batches(
          seed=0, batch_size=2, shard_index=0, num_shards=1, drop_remainder=True, skip_batches=0)
  finally:
    tasks.add_c4_span_corruption(name, tfds_name='c4/en:2.2.0')
  message = str(raised.value)
  assert '\n' not in message and isinstance(raised.value, fields.ConfigError)
  assert message.startswith(f'task c4_v220_span_corruption reads TFDS c4/en:2.2.0 from '
                            f'TFDS_DATA_DIR={tmp_path}, which failed to load (')
  assert (f'Fix: the pinned TFDS {tfds.__version__} reads c4/en:2.2.0 but builds only '
          f'version(s) 3.1.0: copy a prepared c4/en:2.2.0 into {tmp_path}, or pass '
          '--tfds_data_dir=<where it is prepared>; or use the offline task') in message


USER_MODULE = '''
"""A T5X user's task module: TFDS datasets over local files and seqio tasks reading them."""
import pathlib

import seqio
import tensorflow_datasets as tfds

from upcycle.data import tasks

HERE = pathlib.Path(__file__).parent


class UpcycleTestNotes(tfds.core.GeneratorBasedBuilder):
  """HERE/notes.txt, a document a line: odd lines 'train', even lines 'validation'."""
  VERSION = tfds.core.Version('1.0.0')
  FILE = 'notes.txt'

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    lines = (HERE / self.FILE).read_text().splitlines()
    return {'train': self._generate_examples(lines[1::2]),
            'validation': self._generate_examples(lines[::2])}

  def _generate_examples(self, lines):
    for i, line in enumerate(lines):
      yield i, {'text': line}


class UpcycleTestLater(UpcycleTestNotes):
  """The same over HERE/later.txt, a file that comes later."""
  FILE = 'later.txt'


for name in ('upcycle_test_notes', 'upcycle_test_later'):
  tasks.add_span_corruption_task(
      f'{name}_span_corruption',
      seqio.TfdsDataSource(f'{name}:1.0.0', tfds_data_dir=str(HERE / 'tfds'),
                           splits=('train', 'validation')),
      seqio.ByteVocabulary(extra_ids=100))
'''
MODULE = 'upcycle_test_user_tasks'


@pytest.fixture(scope='module')
def user_module(tmp_path_factory):
  """The directory of MODULE, on sys.path, with notes.txt beside it (MODULE is not imported)."""
  directory = tmp_path_factory.mktemp('user')
  (directory / f'{MODULE}.py').write_text(textwrap.dedent(USER_MODULE))
  paragraphs = offline_text.paragraphs('validation')[:40]
  notes = [' '.join(p.split()) for p in paragraphs if p.isascii()]   # one a line
  (directory / 'notes.txt').write_text('\n'.join(notes))
  with pytest.MonkeyPatch.context() as patch:
    patch.syspath_prepend(str(directory))
    yield directory
  sys.modules.pop(MODULE, None)


def _pipeline(task, module=MODULE):
  return text.TextPipeline(task, 'validation', {'inputs': 32, 'targets': 8}, shuffle=False,
                           module=module)


def _batches(pipeline):
  return list(pipeline.batches(seed=0, batch_size=4, shard_index=0, num_shards=1,
                               drop_remainder=False, skip_batches=0).as_numpy_iterator())


def test_mixture_or_task_module_registers_the_task_that_the_pipeline_reads(user_module):
  assert 'upcycle_test_notes_span_corruption' not in seqio.TaskRegistry.names()
  batches = _batches(_pipeline('upcycle_test_notes_span_corruption'))
  # seqio prepared the TFDS dataset on first read (TFDS needs importlib_resources for it).
  assert (user_module / 'tfds' / 'upcycle_test_notes' / '1.0.0' / 'dataset_info.json').is_file()
  rows = [row for b in batches for row in b['encoder_input_tokens']]
  # Text between sentinels (>= 259), EOS (1) and padding (0): bytes + 3 of the documents, which
  # span corruption concatenates (in the stored order: shuffle=False).
  pieces = [p[(p > 1) & (p < 259)] for row in rows for p in np.split(row, np.flatnonzero(
      (row >= 259) | (row <= 1)))]
  words = [bytes((p - 3).astype(np.uint8).tolist()).decode() for p in pieces if len(p)]
  builder = tfds.builder('upcycle_test_notes:1.0.0', data_dir=str(user_module / 'tfds'))
  stored = [x['text'].decode() for x in builder.as_dataset(split='validation').as_numpy_iterator()]
  assert sorted(stored) == sorted((user_module / 'notes.txt').read_text().splitlines()[::2])
  validation = ''.join(stored)   # in TFDS's order, which the task reads
  assert sum(map(len, words)) > 500 and [w for w in words if w not in validation] == []


@pytest.mark.slow
def test_a_missing_dataset_is_one_line_whose_command_prepares_it(user_module):
  with pytest.raises(source_errors.SourceError) as raised:
    _batches(_pipeline('upcycle_test_later_span_corruption'))
  message, data_dir = str(raised.value), user_module / 'tfds'
  assert '\n' not in message and message.startswith(
      'task upcycle_test_later_span_corruption reads TFDS upcycle_test_later:1.0.0 from '
      f'TFDS_DATA_DIR={data_dir}, which failed to load (FileNotFoundError: ')
  command = (f'import tensorflow_datasets as tfds, {MODULE}; '
             f"tfds.builder('upcycle_test_later:1.0.0', data_dir='{data_dir}')"
             '.download_and_prepare()')
  assert f'Fix: prepare it there (python -c "{command}"), or pass --tfds_data_dir=' in message
  (user_module / 'later.txt').write_text('Some text.\nMore text.\n')
  done = subprocess.run([sys.executable, '-c', command], cwd=user_module, capture_output=True,
                        text=True, timeout=120, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 0, done.stderr[-2000:]
  assert (data_dir / 'upcycle_test_later' / '1.0.0' / 'dataset_info.json').is_file()


def test_a_task_module_that_fails_to_import_is_one_line_naming_the_binding():
  pipeline = text.TextPipeline(tasks.OFFLINE_TASK, 'train', {'inputs': 32, 'targets': 8},
                               module='upcycle_no_such_tasks')
  with pytest.raises(fields.ConfigError) as raised:
    pipeline.batches(seed=0, batch_size=2, shard_index=0, num_shards=1, drop_remainder=True,
                     skip_batches=0)
  assert str(raised.value) == (
      "text.TextPipeline.module = 'upcycle_no_such_tasks' (MIXTURE_OR_TASK_MODULE): importing "
      "it failed (ModuleNotFoundError: No module named 'upcycle_no_such_tasks'). Fix: name a "
      'module on the Python path that registers your seqio tasks, or None.')


def test_an_unregistered_task_is_one_line_naming_the_binding_and_the_module_macro():
  pipeline = text.TextPipeline('c4_v220_iid_denoising', 'train', {'inputs': 32, 'targets': 8})
  with pytest.raises(fields.ConfigError) as raised:
    pipeline.batches(seed=0, batch_size=2, shard_index=0, num_shards=1, drop_remainder=True,
                     skip_batches=0)
  message = str(raised.value)
  assert '\n' not in message and message.startswith(
      "text.TextPipeline.task = 'c4_v220_iid_denoising' (MIXTURE_OR_TASK_NAME): not a "
      "registered seqio task or mixture (registered: ['c4_span_corruption', "
      "'c4_v220_span_corruption', ")
  assert message.endswith('--gin.MIXTURE_OR_TASK_MODULE="\'my_tasks\'".')


def _pretokenized_task():
  """A task as most seqio tasks are: `tokenize` keeps the texts as '*_pretokenized'."""
  name = 'test_pretokenized_pairs'
  if name not in seqio.TaskRegistry.names():
    vocabulary = seqio.ByteVocabulary()
    source = seqio.FunctionDataSource(
        lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(
            {'inputs': ['a b c', 'd e', 'f'], 'targets': ['x', 'y z', 'w']}),
        splits=('validation',))
    seqio.TaskRegistry.add(
        name, source=source,
        preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
        output_features={'inputs': seqio.Feature(vocabulary),
                         'targets': seqio.Feature(vocabulary)})
  return name


def test_packing_a_task_with_pretokenized_texts_is_seqio_s_and_says_nothing(caplog):
  """The batches are seqio's converter's on the task's examples as read; its warning that the
  pretokenized texts are dropped by packing is not logged."""
  name, lengths = _pretokenized_task(), {'inputs': 16, 'targets': 8}
  pipeline = text.TextPipeline(name, 'validation', lengths, shuffle=False)
  with caplog.at_level('WARNING', logger='absl'):
    batches = list(pipeline.batches(seed=0, batch_size=2, shard_index=0, num_shards=1,
                                    drop_remainder=False, skip_batches=0).as_numpy_iterator())
  assert not [r for r in caplog.records if 'packing' in r.getMessage()]
  examples = seqio.get_mixture_or_task(name).get_dataset(lengths, split='validation',
                                                        shuffle=False, use_cached=False)
  assert 'inputs_pretokenized' in examples.element_spec
  with caplog.at_level('WARNING', logger='absl'):
    expected = list(seqio.EncDecFeatureConverter(pack=True)(examples, lengths).batch(2)
                    .as_numpy_iterator())
  assert [r for r in caplog.records if 'removed during packing' in r.getMessage()]
  assert len(batches) == len(expected)
  for got, want in zip(batches, expected):
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
