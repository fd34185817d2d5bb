"""The decoder-only pipeline and its tokenizers, against the libraries that own the formats
(HF `tokenizers` / transformers' fast tokenizer, SentencePiece) and the framing in closed form."""

import json

import numpy as np
import pytest
import seqio
import tensorflow as tf

from upcycle import fields, pretrained
from upcycle.data import iterator
from upcycle.data import lm
from upcycle.data import offline_text
from upcycle.data import tokenizer as tokenizer_lib

DOCS_TASK = 'test_lm_docs_text'


@pytest.fixture(scope='module')
def offline():
  return tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)


@pytest.fixture(scope='module')
def docs():
  """12 real pieces of the stdlib corpus's validation split, of different lengths."""
  return [d[:25 * (i + 1)] for i, d in enumerate(offline_text.stdlib_documents('validation')[:12])]


def _text_task(name, docs):
  """Registers (again) `name`: a 'train' split of `docs` under `text`, permuted by seed."""
  def dataset_fn(split, shuffle_files, seed=None):
    del split
    order = np.random.default_rng(seed).permutation(len(docs)) if shuffle_files else range(
        len(docs))
    return tf.data.Dataset.from_tensor_slices({'text': [docs[i] for i in order]})

  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(name, source=seqio.FunctionDataSource(dataset_fn, splits=('train',)),
                         output_features={})
  return name


@pytest.fixture(scope='module')
def docs_task(docs):
  return _text_task(DOCS_TASK, docs)


def test_the_offline_bpe_is_deterministic_and_reads_back_in_transformers(offline, tmp_path):
  assert tokenizer_lib.train_offline_bpe() == offline.files['tokenizer.json']
  assert offline.vocab_size == tokenizer_lib.OFFLINE_VOCAB_SIZE
  text = 'def read(path):\n    """Returns the file\'s text."""\n    return open(path).read()\n'
  ids = offline.encode(text)
  assert len(ids) < len(text.encode()) / 2 and offline.decode(ids) == text   # merges, lossless
  offline.save(str(tmp_path))
  import transformers  # pylint: disable=g-import-not-at-top
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf(text, add_special_tokens=False)['input_ids'] == ids
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)


def test_the_offline_bpe_trainer_is_deterministic_with_the_special_tokens_first():
  """`train_bpe`, which trains both offline BPEs, on a small fixed document list: twice the
  same bytes; `tokenizers` reads `OFFLINE_SPECIAL` at ids 0, 1, 2 and every byte's piece."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  documents = offline_text.packages_documents('validation')[:8]
  trained = tokenizer_lib.train_bpe(documents)
  assert tokenizer_lib.train_bpe(documents) == trained
  reference = tokenizers.Tokenizer.from_str(trained.decode())
  assert [reference.token_to_id(t) for t in tokenizer_lib.OFFLINE_SPECIAL] == [0, 1, 2]
  assert all(reference.token_to_id(c) is not None
             for c in tokenizers.pre_tokenizers.ByteLevel.alphabet())
  assert reference.get_vocab_size() == tokenizer_lib.OFFLINE_VOCAB_SIZE


def test_the_packages_bpe_frames_a_packages_document_as_tokenizers_reads_it(tmp_path):
  """The packages BPE (data/offline_packages_lm.gin's, tests/test_configs.py) in an LmPipeline:
  a validation document of the packages corpus is `[BOS] ids [EOS]` in windows, the ids those
  of `tokenizers` reading the saved tokenizer.json, which decodes them back to the text."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  document = offline_text.packages_documents('validation')[0][:3000]
  length = 64
  pipeline = lm.LmPipeline(_text_task('test_lm_packages_text', [document]), 'train',
                           {'targets': length}, tokenizer=tokenizer_lib.OFFLINE_PACKAGES_BPE,
                           shuffle=False)
  tok = pipeline.load_tokenizer()
  assert (tok.source, tok.vocab_size, tok.bos_id, tok.eos_id) == ('offline_packages_bpe', 4096,
                                                                  1, 2)
  tok.save(str(tmp_path))
  reference = tokenizers.Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))
  ids = reference.encode(document, add_special_tokens=False).ids
  assert reference.decode(ids) == document and len(ids) < len(document.encode()) / 2
  framed = [1, *ids, 2]   # in windows of length + 1 that overlap by one
  spans = [framed[s:s + length + 1] for s in range(0, len(framed) - 1, length)]
  windows = [w for b in _rows(pipeline) for w in _windows(b)]
  assert [(i.tolist(), t.tolist()) for i, t in windows] == [(w[:-1], w[1:]) for w in spans]
  targets = [int(t) for _, window in windows for t in window]
  assert reference.decode(targets[:-1]) == document and targets[-1] == 2
  assert tok.digest != tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).digest


def test_an_hf_checkpoint_directory_brings_its_tokenizer_and_special_ids(offline, tmp_path):
  offline.save(str(tmp_path))
  (tmp_path / 'config.json').write_text(json.dumps({'bos_token_id': 7, 'eos_token_id': [9, 2]}))
  loaded = tokenizer_lib.load(str(tmp_path))
  assert (loaded.bos_id, loaded.eos_id) == (7, 9)   # config.json wins; the first end id
  run = tmp_path / 'run'
  offline.save(str(run / tokenizer_lib.RUN_SUBDIR))
  from_step = tokenizer_lib.load(str(run / 'checkpoints' / '20'))
  assert from_step.digest == offline.digest
  with pytest.raises(tokenizer_lib.TokenizerError, match='no tokenizer.json or tokenizer.model'):
    tokenizer_lib.load(str(tmp_path / 'nowhere'))


def test_a_sentencepiece_model_encodes_as_sentencepiece_does(docs, tmp_path):
  import io  # pylint: disable=g-import-not-at-top
  import sentencepiece  # pylint: disable=g-import-not-at-top
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(offline_text.stdlib_documents('validation')[0].splitlines()),
      model_writer=model, vocab_size=200, bos_id=1, eos_id=2,
      pad_id=0, unk_id=3, minloglevel=2)
  (tmp_path / 'tokenizer.model').write_bytes(model.getvalue())
  (tmp_path / 'config.json').write_text(json.dumps({'bos_token_id': 1, 'eos_token_id': 2}))
  loaded = tokenizer_lib.load(str(tmp_path))
  reference = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
  assert loaded.encode(docs[0][:500]) == reference.encode(docs[0][:500])
  assert loaded.vocab_size == 200


def test_text_is_framed_as_transformers_frames_it(offline, tmp_path):
  """`Tokenizer.encode(add_special_tokens=True)` is transformers' default encoding: the
  offline BPE adds nothing, a tokenizer.json whose post-processor adds BOS adds it; a
  tokenizer.model alone is refused in one line."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  plain, framed = tmp_path / 'plain', tmp_path / 'framed'
  offline.save(str(plain))
  backend = tokenizers.Tokenizer.from_str(offline.files['tokenizer.json'].decode())
  backend.post_processor = tokenizers.processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', offline.bos_id)])
  offline.save(str(framed))
  backend.save(str(framed / 'tokenizer.json'))
  text = 'def main(argv):\n  return sorted(argv)[0]\n'
  for directory, first in ((plain, []), (framed, [offline.bos_id])):
    (directory / 'config.json').write_text(json.dumps({'bos_token_id': 1, 'eos_token_id': 2}))
    want = transformers.AutoTokenizer.from_pretrained(str(directory)).encode(text)
    ours = tokenizer_lib.load(str(directory))
    assert ours.encode(text, add_special_tokens=True) == want == first + offline.encode(text)
    assert ours.encode(text) == offline.encode(text)
  spm = tokenizer_lib.Tokenizer(files={'tokenizer.model': b''}, bos_id=1, eos_id=2,
                                vocab_size=3, digest='0', source='/ckpt')
  with pytest.raises(tokenizer_lib.TokenizerError,
                     match=r"^/ckpt: a tokenizer.model alone does not say which special tokens "
                     r'frame text as transformers frames it\. Fix: add .*tokenizer.json'):
    spm.encode('x', add_special_tokens=True)


def _rows(pipeline, batch_size=64):
  ds = pipeline.batches(seed=3, batch_size=batch_size, shard_index=0, num_shards=1,
                        drop_remainder=False, skip_batches=0)
  return [b for b in ds.as_numpy_iterator()]


def _windows(batch):
  """(inputs, targets) of every packed window, row by row."""
  out = []
  for row in range(batch['decoder_segment_ids'].shape[0]):
    seg = batch['decoder_segment_ids'][row]
    for s in range(1, seg.max() + 1):
      at = seg == s
      np.testing.assert_array_equal(batch['decoder_positions'][row][at], np.arange(at.sum()))
      out.append((batch['decoder_input_tokens'][row][at], batch['decoder_target_tokens'][row][at]))
  return out


@pytest.mark.parametrize('pack', [True, False])
def test_every_document_is_framed_windowed_and_predicted_once(docs, docs_task, offline, pack):
  length = 48
  pipeline = lm.LmPipeline(docs_task, 'train', {'targets': length}, pack=pack, shuffle=False)
  batches = _rows(pipeline)
  windows = []
  for batch in batches:
    np.testing.assert_array_equal(batch['decoder_loss_weights'], batch['decoder_segment_ids'] > 0)
    windows += _windows(batch)
  framed = [[offline.bos_id, *offline.encode(d), offline.eos_id] for d in docs]
  expected = []   # each document in windows of length + 1 that overlap by one
  for tokens in framed:
    for start in range(0, len(tokens) - 1, length):
      w = tokens[start:start + length + 1]
      expected.append((w[:-1], w[1:]))
  assert len(windows) == len(expected)
  for (inputs, targets), (want_in, want_tg) in zip(sorted(windows, key=lambda w: w[0].tolist()),
                                                     sorted(expected, key=lambda w: w[0])):
    assert inputs.tolist() == want_in and targets.tolist() == want_tg
  most = max(b['decoder_segment_ids'].max() for b in batches)
  assert most > 1 if pack else most == 1


def test_shuffled_epochs_are_deterministic_resumable_and_shards_disjoint(docs_task):
  pipeline = lm.LmPipeline(docs_task, 'train', {'targets': 32})
  a = iterator.DataIterator(pipeline, batch_size=2, seed=5)
  first = [next(a) for _ in range(4)]
  resumed = iterator.DataIterator(pipeline, batch_size=2, seed=5)
  resumed.set_state(iterator.DataIterator(pipeline, batch_size=2, seed=5).get_state())
  for batch in first:
    np.testing.assert_array_equal(next(resumed)['decoder_target_tokens'],
                                  batch['decoder_target_tokens'])
  shards = [
      {tuple(t) for b in iterator.DataIterator(pipeline, batch_size=1, seed=5, shard_index=i,
                                               num_shards=2, num_epochs=1)
       for t in b['decoder_target_tokens']} for i in (0, 1)]
  assert shards[0] and shards[1] and not shards[0] & shards[1]


def test_feature_lengths_other_than_targets_are_refused_naming_the_macro(docs_task):
  with pytest.raises(fields.ConfigError,
                     match=r"lm.LmPipeline.feature_lengths = \{'inputs': 8, 'targets': 8\}: "
                           r"expected a mapping of only 'targets' to integers >= 1, such as "
                           r"TASK_FEATURE_LENGTHS = \{'targets': 128\}"):
    lm.LmPipeline(docs_task, 'train', {'inputs': 8, 'targets': 8})


USER_MODULE = '''
import seqio, tensorflow as tf
from upcycle.data import offline_text

DOCS = [d[:25 * (i + 1)] for i, d in enumerate(offline_text.stdlib_documents('validation')[:12])]

seqio.TaskRegistry.add(
    'upcycle_test_user_text',
    source=seqio.FunctionDataSource(
        lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(
            {'text': DOCS}), splits=('validation',)),
    output_features={})
'''


def test_mixture_or_task_module_registers_the_text_task_of_training_and_of_prompts(
    docs, docs_task, offline, tmp_path, monkeypatch):
  """A decoder-only run's LmPipeline and a decode's Prompts import the user's module
  (MIXTURE_OR_TASK_MODULE) before looking the task up."""
  from upcycle.data import prompts  # pylint: disable=g-import-not-at-top
  (tmp_path / 'upcycle_test_lm_tasks.py').write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert 'upcycle_test_user_text' not in seqio.TaskRegistry.names()
  length = {'targets': 48}
  theirs = lm.LmPipeline('upcycle_test_user_text', 'validation', length, shuffle=False,
                         module='upcycle_test_lm_tasks')
  ours = lm.LmPipeline(docs_task, 'train', length, shuffle=False)
  windows = lambda p: sorted(w[0].tolist() for b in _rows(p) for w in _windows(b))
  assert windows(theirs) == windows(ours) and len(windows(ours)) >= 12
  read = prompts.Prompts('upcycle_test_user_text', 'validation', {'targets': 8},
                         tokenizer_lib.OFFLINE_BPE, module='upcycle_test_lm_tasks')
  assert [tokens for _, tokens in
          read._task_prompts(offline)] == [  # pylint: disable=protected-access
      [offline.bos_id, *offline.encode(d)][:8] for d in docs]
  with pytest.raises(fields.ConfigError, match=r"^prompts.Prompts.module = 'no_such_tasks' "):
    list(prompts.Prompts('x', 'validation', {'targets': 8}, tokenizer_lib.OFFLINE_BPE,
                         module='no_such_tasks')
         ._task_prompts(offline))  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def swapped(offline, tmp_path_factory):
  """Another tokenizer: the offline BPE with the pieces of ids 2000 and 2001 swapped."""
  from tests import helpers  # pylint: disable=g-import-not-at-top
  return helpers.save_swapped_tokenizer(offline, str(tmp_path_factory.mktemp('swapped')))


def test_a_swapped_tokenizer_is_another_tokenizer(offline, swapped):
  """The reference: HF `tokenizers` reading the swapped file gives ids 2001 and 2000 where the
  offline BPE gives 2000 and 2001 (' float', ' change')."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  other = tokenizers.Tokenizer.from_file(f'{swapped}/tokenizer.json')
  text = 'x = float(y) + change'
  assert {2000, 2001} <= set(offline.encode(text))
  swap = {2000: 2001, 2001: 2000}
  assert other.encode(text, add_special_tokens=False).ids == [
      swap.get(i, i) for i in offline.encode(text)]
  assert tokenizer_lib.load(swapped).digest != offline.digest


def _run_step(run, pipeline, offline):
  """MODEL_DIR `run` as the trainer leaves it: checkpoints/3 with the data position of
  `pipeline` (what `train.host_data` saves), and the run's tokenizer/."""
  from upcycle.checkpoints.orbax import CheckpointManager  # pylint: disable=g-import-not-at-top
  from upcycle.train import host_data, host_states  # pylint: disable=g-import-not-at-top
  position = host_states.gather(host_data.HostData(pipeline, global_batch_size=2, seed=0)
                                .get_state())
  with CheckpointManager(str(run / 'checkpoints'), async_save=False) as manager:
    manager.save(3, {'w': np.zeros(2, np.float32)}, dataset_state=position)
  offline.save(str(run / tokenizer_lib.RUN_SUBDIR))
  return str(run / 'checkpoints' / '3')


def test_a_tokenizer_that_is_not_the_weights_is_refused(docs_task, offline, swapped, tmp_path):
  """A run's step is known by the digest its data position records (even where its tokenizer/
  was replaced), an HF directory by its own files; the matching tokenizer passes."""
  step = _run_step(tmp_path / 'run', lm.LmPipeline(docs_task, 'train', {'targets': 16}), offline)
  other = tokenizer_lib.load(swapped)
  assert pretrained.trained_with(step) == (
      offline.short_digest, f'the data position saved in {step}/dataset')
  pretrained.check_trained(offline, step, binding='TOKENIZER', fix='unused')
  with pytest.raises(tokenizer_lib.TokenizerError) as refused:
    pretrained.check_trained(other, str(tmp_path / 'run' / 'checkpoints'), binding='TOKENIZER',
                                fix='give it back.')
  assert str(refused.value) == (
      f'TOKENIZER reads {swapped} (tokenizer digest {other.short_digest}), but the weights of '
      f'{tmp_path}/run/checkpoints were trained with tokenizer {offline.short_digest} (the data '
      f"position saved in {step}/dataset): they would read another tokenizer's ids. Fix: give "
      'it back.')
  other.save(str(tmp_path / 'run' / tokenizer_lib.RUN_SUBDIR))   # the run's tokenizer/ replaced
  assert tokenizer_lib.load(step).digest == other.digest
  with pytest.raises(tokenizer_lib.TokenizerError, match='were trained with tokenizer '):
    pretrained.check_trained(tokenizer_lib.load(step), step, binding='TOKENIZER', fix='')

  hf = tmp_path / 'hf'
  offline.save(str(hf))
  (hf / 'config.json').write_text(json.dumps({'bos_token_id': 1, 'eos_token_id': 2}))
  assert pretrained.trained_with(str(hf), 'hf') == (
      offline.short_digest, f'the tokenizer files in {hf}')
  pretrained.check_trained(tokenizer_lib.load(str(hf)), str(hf), binding='TOKENIZER', fix='',
                              format='hf')
  with pytest.raises(tokenizer_lib.TokenizerError, match=f'the tokenizer files in {hf}'):
    pretrained.check_trained(other, str(hf), binding='TOKENIZER', fix='', format='hf')
  bare = tmp_path / 'bare'   # weights without tokenizer files: nothing to compare with
  bare.mkdir()
  assert pretrained.trained_with(str(bare), 'hf') is None


def test_merged_sources_must_share_their_tokenizer(offline, swapped, tmp_path):
  for name in ('a', 'b'):
    offline.save(str(tmp_path / name))
  shared = tokenizer_lib.load([str(tmp_path / 'a'), str(tmp_path / 'b')])
  assert shared.digest == offline.digest
  with pytest.raises(tokenizer_lib.TokenizerError) as refused:
    tokenizer_lib.load((str(tmp_path / 'a'), swapped))
  other = tokenizer_lib.load(swapped)
  assert str(refused.value) == (
      f"TOKENIZER={[str(tmp_path / 'a'), swapped]!r}: {swapped} carries another tokenizer "
      f'({swapped}, digest {other.short_digest}) than {tmp_path}/a ({tmp_path}/a, digest '
      f'{offline.short_digest}): their embeddings index different pieces and cannot be merged. '
      'Fix: give checkpoints trained with one tokenizer.')


def test_ids_past_the_embedding_and_a_spec_that_is_no_path_are_refused(docs_task, offline):
  tokenizer_lib.check_fits(offline, 4096, binding='TOKENIZER', rows_binding='unused')
  with pytest.raises(tokenizer_lib.TokenizerError) as refused:
    tokenizer_lib.check_fits(offline, 4000, binding='TOKENIZER (lm.LmPipeline.tokenizer)',
                             rows_binding='models.LlamaConfig.vocab_size')
  assert str(refused.value) == (
      "TOKENIZER (lm.LmPipeline.tokenizer) reads offline_stdlib_bpe, whose 4096 pieces have ids "
      "up to 4095, but the model's embedding has 4000 rows (models.LlamaConfig.vocab_size = "
      '4000). Fix: the tokenizer the model was made for, or models.LlamaConfig.vocab_size = '
      '4096 or more.')
  with pytest.raises(fields.ConfigError) as refused:
    lm.LmPipeline(docs_task, 'train', {'targets': 8}, tokenizer=5)
  assert str(refused.value) == (
      "TOKENIZER (lm.LmPipeline.tokenizer) = 5: expected a tokenizer: an offline BPE "
      "('offline_stdlib_bpe' or 'offline_packages_bpe'), an HF checkpoint directory or a run "
      'directory (a string), or a list of checkpoints that share one.')
  assert lm.LmPipeline(docs_task, 'train', {'targets': 8}, tokenizer=['a', 'b']).tokenizer == (
      'a', 'b')
