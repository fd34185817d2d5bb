"""Instruction-tuning data (`upcycle.data.sft`): ids and response-only loss weights against
transformers' `apply_chat_template` and TRL's completion-only convention, packing, over-length
samples, the files pyarrow writes, the offline instruction set against Python's parser, and
every refusal in one line."""

import ast
import json
import logging
import re
import textwrap

import numpy as np
import pytest

from upcycle import fields
from upcycle.data import offline_text, sft
from upcycle.data import tokenizer as tokenizer_lib

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SAMPLES = [
    {'prompt': 'Name the largest planet.', 'response': 'Jupiter is the largest planet.'},
    {'system': 'You answer briefly.', 'prompt': 'Add 2 and 3.', 'completion': 'Five.'},
    {'messages': [{'role': 'user', 'content': 'Hi there'},
                  {'role': 'assistant', 'content': 'Hello! How can I help?'},
                  {'role': 'user', 'content': 'Say a colour.'},
                  {'role': 'assistant', 'content': 'Blue.'}]},
]


def _messages(sample):
  if 'messages' in sample:
    return sample['messages']
  system = [{'role': 'system', 'content': sample['system']}] if 'system' in sample else []
  return system + [{'role': 'user', 'content': sample['prompt']},
                   {'role': 'assistant',
                    'content': sample.get('response', sample.get('completion'))}]


@pytest.fixture(scope='module')
def chat_dir(tmp_path_factory):
  """The offline BPE as a transformers fast tokenizer with ChatML's special tokens and chat
  template, saved by transformers (its chat_template.jinja)."""
  import transformers  # pylint: disable=g-import-not-at-top
  directory = tmp_path_factory.mktemp('chat_tokenizer')
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  offline.save(str(directory))
  hf = transformers.AutoTokenizer.from_pretrained(str(directory))
  hf.add_special_tokens({'additional_special_tokens': ['<|im_start|>', '<|im_end|>']})
  hf.chat_template = CHATML
  hf.save_pretrained(str(directory))
  assert (directory / 'chat_template.jinja').exists()
  return str(directory)


@pytest.fixture(scope='module')
def hf(chat_dir):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.AutoTokenizer.from_pretrained(chat_dir)


def _ids(hf, messages, **kwargs):
  return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _trl_reference(hf, messages):
  """TRL's completion-only convention for every assistant turn, with transformers: the ids of
  the whole conversation, 1 on the tokens each assistant turn adds to the prompt before it."""
  ids = _ids(hf, messages)
  mask = np.zeros(len(ids), np.int32)
  for i, message in enumerate(messages):
    if message['role'] == 'assistant':
      prompt = _ids(hf, messages[:i], add_generation_prompt=True)
      upto = _ids(hf, messages[:i + 1])
      assert ids[:len(upto)] == upto and upto[:len(prompt)] == prompt   # TRL's assumption
      mask[len(prompt):len(upto)] = 1
  return ids, mask


def _ours(chat_dir, messages):
  tok = tokenizer_lib.load(chat_dir)
  parts = sft.response_parts(tok.chat_template, tuple(messages), tok.special_tokens())
  return sft.tokens_and_mask(tok, parts)


@pytest.mark.parametrize('index', range(len(SAMPLES)))
def test_ids_and_response_mask_are_transformers_and_trls(chat_dir, hf, index):
  messages = _messages(SAMPLES[index])
  want_ids, want_mask = _trl_reference(hf, messages)
  ids, mask = _ours(chat_dir, messages)
  assert ids.tolist() == want_ids
  np.testing.assert_array_equal(mask, want_mask)
  assert 0 < mask.sum() < len(mask)


def test_a_response_that_merges_with_its_prompt_is_tokenized_as_prompted(chat_dir, hf):
  """'\\n' + indentation is one piece in the whole text; the prompt alone ends in '\\n' (what
  the model is prompted with), so the response is encoded on its own."""
  messages = [{'role': 'user', 'content': 'Indent it.'},
              {'role': 'assistant', 'content': '    return x'}]
  prompt = hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
  whole = hf.apply_chat_template(messages, tokenize=False)
  prompt_ids = hf(prompt, add_special_tokens=False)['input_ids']
  rest_ids = hf(whole[len(prompt):], add_special_tokens=False)['input_ids']
  assert _ids(hf, messages)[:len(prompt_ids)] != prompt_ids   # TRL would warn here
  ids, mask = _ours(chat_dir, messages)
  assert ids.tolist() == prompt_ids + rest_ids
  assert mask.tolist() == [0] * len(prompt_ids) + [1] * len(rest_ids)


def _write_jsonl(path, samples):
  path.write_text(''.join(json.dumps(s) + '\n' for s in samples))
  return str(path)


def _batches(pipeline, batch_size=4, seed=0):
  ds = pipeline.batches(seed=seed, batch_size=batch_size, shard_index=0, num_shards=1,
                        drop_remainder=False, skip_batches=0)
  return list(ds.as_numpy_iterator())


def _segments(batches):
  """(inputs, targets, weights) of every sample of the rows, checking positions restart."""
  out = []
  for batch in batches:
    for row in range(len(batch['decoder_segment_ids'])):
      seg = batch['decoder_segment_ids'][row]
      assert not batch['decoder_loss_weights'][row][seg == 0].any()   # padding weighs nothing
      for s in range(1, seg.max() + 1):
        at = seg == s
        np.testing.assert_array_equal(batch['decoder_positions'][row][at], np.arange(at.sum()))
        out.append(tuple(batch[k][row][at].tolist() for k in (
            'decoder_input_tokens', 'decoder_target_tokens', 'decoder_loss_weights')))
  return out


@pytest.mark.parametrize('pack', [True, False])
def test_rows_hold_each_sample_apart_with_prompt_tokens_weighing_zero(chat_dir, hf, tmp_path,
                                                                      pack):
  path = _write_jsonl(tmp_path / 'train.jsonl', SAMPLES * 2)
  pipeline = sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                             data_files=path, pack=pack, shuffle=False)
  batches = _batches(pipeline)
  want = []
  for sample in SAMPLES * 2:
    ids, mask = _trl_reference(hf, _messages(sample))
    want.append((ids[:-1], ids[1:], mask[1:].tolist()))   # target t weighs its token's mask
  assert sorted(_segments(batches)) == sorted(want)
  most = max(b['decoder_segment_ids'].max() for b in batches)
  assert most > 1 if pack else most == 1   # unpacked: one sample per row (the router stage)


def test_parquet_written_by_pyarrow_reads_as_the_same_samples(chat_dir, tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  rows = [{'messages': _messages(s)} for s in SAMPLES]
  pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / 'train.parquet'))
  jsonl = _write_jsonl(tmp_path / 'train.jsonl', rows)
  make = lambda files: sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                                       data_files=files, shuffle=False)
  assert (_segments(_batches(make(str(tmp_path / 'train.parquet'))))
          == _segments(_batches(make(jsonl))))


def test_a_dataset_saved_to_disk_by_datasets_reads_as_the_same_samples(chat_dir, tmp_path):
  """A directory `datasets`' save_to_disk wrote (its Arrow files, in two shards) reads as the
  same samples as the JSONL; a DatasetDict saved whole is refused naming its splits."""
  datasets = pytest.importorskip('datasets')
  rows = [{'messages': _messages(s)} for s in SAMPLES]
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / 'saved'), num_shards=2)
  assert len(list((tmp_path / 'saved').glob('*.arrow'))) == 2
  jsonl = _write_jsonl(tmp_path / 'train.jsonl', rows)
  make = lambda files: sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                                       data_files=files, shuffle=False)
  assert (_segments(_batches(make(str(tmp_path / 'saved'))))
          == _segments(_batches(make(jsonl))))
  datasets.DatasetDict({'train': datasets.Dataset.from_list(rows)}).save_to_disk(
      str(tmp_path / 'dict'))
  with pytest.raises(sft.SftError, match=r"a DatasetDict saved to disk, with the splits "
                                        r"\['train'\]. Fix: give one split's directory, e.g. "
                                        r"'\S*dict/train'$"):
    make(str(tmp_path / 'dict')).records()


def test_an_alpaca_json_array_reads_as_its_prompt_response_pairs(chat_dir, tmp_path):
  alpaca = [{'instruction': 'Name the largest planet.', 'input': '', 'output': 'Jupiter.'},
            {'instruction': 'Add the numbers.', 'input': '2 and 3', 'output': 'Five.'}]
  (tmp_path / 'alpaca_data.json').write_text(json.dumps(alpaca, indent=2))
  pairs = _write_jsonl(tmp_path / 'pairs.jsonl', [
      {'prompt': 'Name the largest planet.', 'response': 'Jupiter.'},
      {'prompt': 'Add the numbers.\n\n2 and 3', 'response': 'Five.'}])
  make = lambda files: sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                                       data_files=files, shuffle=False)
  assert (make(str(tmp_path / 'alpaca_data.json')).rendered(seed=0, shard_index=0, num_shards=1)
          == make(pairs).rendered(seed=0, shard_index=0, num_shards=1))


def test_over_length_samples_are_truncated_or_dropped_and_counted():
  ids = np.arange(10, dtype=np.int32)
  mask = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1], np.int32)
  counts = sft.SampleCounts()
  row = sft.window(ids, mask, length=5, overlong='truncate', counts=counts)
  assert row['inputs'].tolist() == [0, 1, 2, 3, 4] and row['targets'].tolist() == [1, 2, 3, 4, 5]
  assert row['weights'].tolist() == [0, 0, 1, 1, 1]
  assert sft.window(ids, mask, length=5, overlong='drop', counts=counts) is None
  late = np.array([0] * 8 + [1, 1], np.int32)   # the response starts after the window
  assert sft.window(ids, late, length=5, overlong='truncate', counts=counts) is None
  assert sft.window(ids, mask, length=9, overlong='drop', counts=counts) is not None
  assert counts == sft.SampleCounts(whole=1, truncated=1, dropped_overlong=1,
                                    dropped_no_response=1)


def test_a_split_logs_its_counts_and_is_refused_with_none_left(chat_dir, tmp_path, caplog):
  late = {'prompt': 'Repeat. ' * 40, 'response': 'Done.'}   # its response beyond 64 tokens
  long = {'prompt': 'Count.', 'response': 'one two ' * 40}   # its response cut
  path = _write_jsonl(tmp_path / 'train.jsonl', SAMPLES[:2] + [late, long])
  pipeline = sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                             data_files=path, shuffle=False)
  counts = (f'SFT data {path} (shard 0): 4 samples, 2 whole, 1 truncated to 65 tokens, 0 left '
            'out as longer than that, 1 left out with no response token within it.')
  with caplog.at_level(logging.INFO, logger=sft.__name__):
    batches = pipeline.batches(seed=0, batch_size=4, shard_index=0, num_shards=1,
                               drop_remainder=False, skip_batches=0)
    assert caplog.messages == [counts]   # before the first row is read
  rows = _segments(list(batches.as_numpy_iterator()))
  assert len(rows) == 3 and len(rows[-1][0]) == 64
  path = _write_jsonl(tmp_path / 'late.jsonl', [late])
  with pytest.raises(sft.SftError, match=r'^SFT data \S*late.jsonl \(shard 0\): 1 samples, 0 '
                     r'whole, .* 1 left out with no response token within it. None is left to '
                     r"train on. Fix: a longer TASK_FEATURE_LENGTHS\['targets'\]"):
    _batches(sft.SftPipeline('unused', 'train', {'targets': 64}, tokenizer=chat_dir,
                             data_files=path))


def test_the_plain_template_frames_a_base_tokenizers_samples():
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  parts = sft.response_parts(sft.TEMPLATES['plain'], tuple(_messages(SAMPLES[0])),
                             offline.special_tokens())
  assert parts == [('<s>### User:\nName the largest planet.\n\n### Response:\n', False),
                   ('Jupiter is the largest planet.</s>\n\n', True)]
  ids, mask = sft.tokens_and_mask(offline, parts)
  assert ids[0] == offline.bos_id and offline.eos_id in ids[mask == 1].tolist()


def test_the_offline_instruction_set_is_the_stdlibs_documented_functions():
  train, validation = (offline_text.stdlib_functions(s) for s in offline_text.SPLITS)
  assert len(train) > 4000 and len(validation) > 500
  assert not {p['prompt'] for p in train} & {p['prompt'] for p in validation}
  for pair in validation[::25]:
    head = pair['prompt'].split('\n\n', 1)[1]
    assert pair['prompt'].startswith(offline_text.FUNCTION_PROMPT)
    function = ast.parse(textwrap.dedent(head + pair['response'])).body[0]
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert ast.get_docstring(function) and len(function.body) >= 2   # docstring, then the body
    assert ast.parse(textwrap.dedent(head + '    pass\n')).body[0].name == function.name


def test_the_offline_task_reads_the_same_pairs(chat_dir):
  pipeline = sft.SftPipeline('offline_stdlib_sft', 'validation', {'targets': 64},
                             template='plain', shuffle=False)
  records = pipeline.records()
  assert [r for _, r in records] == list(offline_text.stdlib_functions('validation'))


def test_refusals_are_one_line(chat_dir, tmp_path):
  offline = tokenizer_lib.OFFLINE_BPE
  make = lambda path, **kw: sft.SftPipeline('unused', 'train', {'targets': 32}, data_files=path,
                                            shuffle=False, **kw)
  good = _write_jsonl(tmp_path / 'good.jsonl', SAMPLES)
  with pytest.raises(sft.SftError, match=r"^TOKENIZER offline_stdlib_bpe has no chat template "
                     r".*Fix: --gin.SFT_TEMPLATE=\"'plain'\" \(sft.SftPipeline.template; "):
    make(good, tokenizer=offline).rendered(seed=0, shard_index=0, num_shards=1)
  with pytest.raises(fields.ConfigError, match=r"^SFT_TEMPLATE \(sft.SftPipeline.template\) = "
                     r"'chatml': expected None"):
    make(good, template='chatml')
  with pytest.raises(fields.ConfigError, match=r'^sft.SftPipeline.overlong = '):
    make(good, overlong='cut')
  cases = [
      ('bad.jsonl', '{"prompt": "a", "response": "b"}\n{"prompt": \n',
       r'bad.jsonl:2: not a line of JSON \(Expecting value '
       r'at character 13\)'),
      ('keys.jsonl', '{"question": "a", "answer": "b"}\n',
       r"keys.jsonl:1: keys \['answer', 'question'\]: expected \"messages\""),
      ('noreply.jsonl', json.dumps({'messages': [{'role': 'user', 'content': 'a'}]}) + '\n',
       r'noreply.jsonl:1: no assistant message'),
      ('role.jsonl', json.dumps({'messages': [{'role': 'bot', 'content': 'a'}]}) + '\n',
       r"role.jsonl:1: message 0 is .*: expected a role of \('system', 'user', 'assistant'\)"),
      ('latin.jsonl', '{"prompt": "caf\xe9"}\n', r'latin.jsonl:1: not UTF-8 \(invalid '
       r'continuation byte at byte 16 of the line\)'),
      ('bad.parquet', 'PAR1 not really', r'bad.parquet: not a Parquet file pyarrow reads '),
  ]
  for name, text, message in cases:
    (tmp_path / name).write_bytes(text.encode('latin-1'))
    with pytest.raises(sft.SftError) as e:
      make(str(tmp_path / name), tokenizer=chat_dir).rendered(seed=0, shard_index=0,
                                                              num_shards=1)
    assert re.match(re.escape(str(tmp_path)) + '/' + message, str(e.value)), str(e.value)
    assert '\n' not in str(e.value)
  (tmp_path / 'text.txt').write_text('hello\n')
  with pytest.raises(sft.SftError, match=r"^SFT_TRAIN_FILES \(sft.SftPipeline.data_files\) = "
                     r"'\S*text.txt': a .txt file. Fix: give .jsonl"):
    make(str(tmp_path / 'text.txt'), tokenizer=chat_dir).records()
  with pytest.raises(sft.SftError, match=r"'\S*missing.jsonl': no such file"):
    make(str(tmp_path / 'missing.jsonl'), tokenizer=chat_dir).records()
  with pytest.raises(sft.SftError, match=r"a directory that holds no dataset saved to disk "
                                        r"\(state.json\)\. Fix: .* or a `datasets` "
                                        r"save_to_disk directory\.$"):
    make(str(tmp_path), tokenizer=chat_dir).records()


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
  """A template whose render of a prefix is not a prefix of the whole (here it marks the last
  message) leaves the response nowhere: refused, naming the sample."""
  template = ("{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}>{% endif %}")
  with pytest.raises(sft.NotAPrefix, match='^message 1$'):
    sft.response_parts(template, tuple(_messages(SAMPLES[0])), {})


@pytest.mark.parametrize('form', ['string', 'named'])
def test_a_chat_template_in_tokenizer_config_is_the_one_transformers_reads(tmp_path, form):
  import transformers  # pylint: disable=g-import-not-at-top
  tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).save(str(tmp_path))
  config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
  config['chat_template'] = CHATML if form == 'string' else [
      {'name': 'tool_use', 'template': '{{ tools }}'}, {'name': 'default', 'template': CHATML}]
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  tok, hf = tokenizer_lib.load(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(
      str(tmp_path))
  want = hf.chat_template if form == 'string' else hf.chat_template['default']
  assert tok.chat_template == want == CHATML
  assert tok.special_tokens() == {'bos_token': hf.bos_token, 'eos_token': hf.eos_token,
                                  'pad_token': hf.pad_token}
