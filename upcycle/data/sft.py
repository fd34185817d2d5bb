"""Supervised fine-tuning (instruction tuning) data: samples -> decoder-only rows whose loss
weights are 1 on the responses only.

A sample is a conversation: `{"messages": [{"role": ..., "content": ...}, ...]}` (roles
'system', 'user', 'assistant'; at least one assistant message), or a prompt/response pair
`{"prompt": ..., "response": ...}` (also `completion` for `response`, and an optional `system`;
or Alpaca's `instruction`, `input`, `output`: the prompt is the instruction, then a blank line
and the input if there is one), which is the conversation [user: prompt, assistant: response].
Samples come from JSONL, JSON (an array of samples) or Parquet files (`data_files`) or from a
registered seqio task whose source yields `prompt` / `response` strings or `messages` as a JSON
string (the default: `offline_stdlib_sft`, documented functions of Python's standard library,
`offline_text.stdlib_functions`).

A conversation is rendered with a Jinja chat template, as transformers' `apply_chat_template`
renders it (sandboxed, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`, the
tokenizer's special tokens by name): the tokenizer's own (`Tokenizer.chat_template`) or, for a
base tokenizer without one, a named template of `TEMPLATES`. The loss covers each assistant
message (TRL's completion-only convention, for every assistant turn): for assistant message i,
the render of messages[:i] with the generation prompt is the prompt part, and what the render
of messages[:i + 1] adds to it is the response part. The text is tokenized part by part
(without adding special tokens; the template writes them), so the ids are transformers'
`apply_chat_template(messages, tokenize=True)` wherever the prompt's tokens are a prefix of the
whole conversation's (TRL's assumption; it warns otherwise), and otherwise what the model sees
when it is prompted with the prompt alone. A template that does not render each prefix of the
conversation as a prefix of its render is refused in one line (no response span is defined).

Over-length samples: a sample of more than `length + 1` tokens is cut to its first
`length + 1` (`overlong='truncate'`, TRL's `keep_start`) or left out (`'drop'`); a sample with
no response token left is left out either way. Each split logs how many samples were whole,
truncated and left out (`SampleCounts`) when its batches are made. Rows are packed as
`lm.LmPipeline` packs windows (`decoder_segment_ids` apart, positions from 0 in each, so no sample
attends to another) or, with `pack=False`, one sample per row (UpIT's router stage scores rows as
samples).

The samples of a split are read, checked, rendered and tokenized when its batches are made
(host memory: the rendered text and its ids), and the counts logged then. A record that is no
sample, or a template that fails on it, is refused in one line naming the file and line; so is
a split of which no sample is left.
"""

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from etils import epath
import numpy as np
import tensorflow as tf

from upcycle import fields
from upcycle.data import host_only, lm, source_errors, tasks
from upcycle.data import tokenizer as tokenizer_lib

ROLES = ('system', 'user', 'assistant')
OVERLONG = ('truncate', 'drop')
# For base tokenizers, which carry no chat template: the conversation as plain text, the
# document framed by BOS and each response closed by EOS (so a tuned model learns to stop).
TEMPLATES = {
    'plain': (
        '{{ bos_token }}'
        '{% for message in messages %}'
        '{% if message.role == "assistant" %}'
        '### Response:\n{{ message.content }}{{ eos_token }}\n\n'
        '{% else %}'
        '### {{ message.role | capitalize }}:\n{{ message.content }}\n\n'
        '{% endif %}'
        '{% endfor %}'
        '{% if add_generation_prompt %}### Response:\n{% endif %}'),
}

log = logging.getLogger(__name__)
Conversation = Tuple[Dict[str, str], ...]


class SftError(fields.ConfigError):
  """SFT data that is not what the pipeline reads (one line: where, what, the fix)."""


class NotAPrefix(Exception):
  """A chat template's render of the messages before an assistant turn (with the generation
  prompt) is not the start of the conversation's render: the turn has no span."""


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
  """`template` compiled as transformers compiles chat templates."""
  import jinja2  # pylint: disable=g-import-not-at-top
  from jinja2 import ext, sandbox  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def render(template: str, messages: Sequence[Mapping[str, str]], *,
           add_generation_prompt: bool, special: Mapping[str, str]) -> str:
  """The text of `messages` under chat template `template`; `special`: the tokenizer's
  special tokens by name (`Tokenizer.special_tokens`)."""
  return _compiled(template).render(messages=[dict(m) for m in messages],
                                    add_generation_prompt=add_generation_prompt, **special)


def response_parts(template: str, messages: Conversation,
                   special: Mapping[str, str]) -> List[Tuple[str, bool]]:
  """The render of `messages` as consecutive (text, is_response) parts: each assistant
  message's part is what its render adds to the render of the messages before it with the
  generation prompt. NotAPrefix (the message index) where a prefix does not render as a
  prefix."""
  full = render(template, messages, add_generation_prompt=False, special=special)
  parts, done = [], 0
  for i, message in enumerate(messages):
    if message['role'] != 'assistant':
      continue
    prompt = render(template, messages[:i], add_generation_prompt=True, special=special)
    upto = render(template, messages[:i + 1], add_generation_prompt=False, special=special)
    if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= done):
      raise NotAPrefix(f'message {i}')
    parts += [(prompt[done:], False), (upto[len(prompt):], True)]
    done = len(upto)
  parts.append((full[done:], False))
  return [(text, is_response) for text, is_response in parts if text]


def tokens_and_mask(tok: tokenizer_lib.Tokenizer,
                    parts: Sequence[Tuple[str, bool]]) -> Tuple[np.ndarray, np.ndarray]:
  """int32 `[n]` ids of the parts, each encoded alone without added special tokens, and
  int32 `[n]` 1 on the response parts' ids."""
  ids, mask = [], []
  for text, is_response in parts:
    piece = tok.encode(text)
    ids += piece
    mask += [int(is_response)] * len(piece)
  return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


@dataclasses.dataclass
class SampleCounts:
  """How a pass over a split treated its samples."""
  whole: int = 0
  truncated: int = 0
  dropped_overlong: int = 0
  dropped_no_response: int = 0

  def text(self, where: str, length: int) -> str:
    total = self.whole + self.truncated + self.dropped_overlong + self.dropped_no_response
    return (f'SFT data {where}: {total} samples, {self.whole} whole, {self.truncated} truncated '
            f'to {length + 1} tokens, {self.dropped_overlong} left out as longer than that, '
            f'{self.dropped_no_response} left out with no response token within it.')


def window(ids: np.ndarray, mask: np.ndarray, *, length: int, overlong: str,
           counts: SampleCounts) -> Optional[Dict[str, np.ndarray]]:
  """One sample -> {'inputs', 'targets', 'weights'} of at most `length` tokens (the weight of
  target t is the mask of its token), or None if it is left out; counted in `counts`."""
  truncated = len(ids) > length + 1
  if truncated and overlong == 'drop':
    counts.dropped_overlong += 1
    return None
  ids, mask = ids[:length + 1], mask[:length + 1]
  if not mask[1:].any():
    counts.dropped_no_response += 1
    return None
  if truncated:
    counts.truncated += 1
  else:
    counts.whole += 1
  return {'inputs': ids[:-1], 'targets': ids[1:], 'weights': mask[1:]}


def conversation(record: Any, where: str) -> Conversation:
  """A record (a JSON object / Parquet row) -> its conversation; SftError naming `where`."""
  fix = ('Fix: give {"messages": [{"role": "user", "content": ...}, {"role": "assistant", '
         '"content": ...}]} or {"prompt": ..., "response": ...}.')
  if not isinstance(record, Mapping):
    raise SftError(f'{where}: expected a JSON object, got {type(record).__name__}. {fix}')
  if record.get('messages') is not None:
    messages = record['messages']
    if not isinstance(messages, (list, tuple)):
      raise SftError(f'{where}: "messages" is a {type(messages).__name__}, not a list. {fix}')
    out = []
    for i, message in enumerate(messages):
      role = message.get('role') if isinstance(message, Mapping) else None
      content = message.get('content') if isinstance(message, Mapping) else None
      if role not in ROLES or not isinstance(content, str):
        raise SftError(f'{where}: message {i} is {str(message)[:80]}: expected a role of '
                       f'{ROLES} and a string content. {fix}')
      out.append({'role': role, 'content': content})
    if not any(m['role'] == 'assistant' for m in out):
      raise SftError(f'{where}: no assistant message, so no response to train on. {fix}')
    return tuple(out)
  prompt = record.get('prompt')
  response = record.get('response', record.get('completion'))
  if prompt is None and isinstance(record.get('instruction'), str):   # Alpaca's fields
    extra = record.get('input')
    prompt = record['instruction'] + (f'\n\n{extra}' if isinstance(extra, str) and extra else '')
    response = record.get('output')
  if not isinstance(prompt, str) or not isinstance(response, str):
    keys = sorted(record)[:8]
    raise SftError(f'{where}: keys {keys}: expected "messages", or string "prompt" and '
                   f'"response" (or "completion"; or Alpaca\'s "instruction", "input", '
                   f'"output"). {fix}')
  system = record.get('system')
  head = ({'role': 'system', 'content': system},) if isinstance(system, str) and system else ()
  return head + ({'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': response})


def _jsonl_records(path: epath.Path) -> Iterator[Tuple[str, Any]]:
  with path.open('rb') as f:
    for number, raw in enumerate(f, 1):
      where = f'{path}:{number}'
      if not raw.strip():
        continue
      try:
        yield where, json.loads(raw.decode('utf-8'))
      except UnicodeDecodeError as e:
        raise SftError(f'{where}: not UTF-8 ({e.reason} at byte {e.start + 1} of the line). '
                       'Fix: write the file as UTF-8.') from None
      except json.JSONDecodeError as e:
        raise SftError(f'{where}: not a line of JSON ({e.msg} at character {e.pos + 1}). Fix: '
                       'one JSON object per line.') from None


def _json_records(path: epath.Path) -> Iterator[Tuple[str, Any]]:
  """A .json file: a JSON array of samples (Alpaca's `alpaca_data.json`), else JSON lines."""
  try:
    records = json.loads(path.read_bytes().decode('utf-8'))
  except (UnicodeDecodeError, json.JSONDecodeError):
    records = None
  if not isinstance(records, list):
    return _jsonl_records(path)
  return ((f'{path} (item {i})', record) for i, record in enumerate(records))


def _parquet_records(path: epath.Path) -> Iterator[Tuple[str, Any]]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    with path.open('rb') as f:
      rows = pq.read_table(f).to_pylist()
  except Exception as e:  # pylint: disable=broad-except  (pyarrow fails many ways)
    raise SftError(f'{path}: not a Parquet file pyarrow reads ({type(e).__name__}: '
                   f'{str(e).splitlines()[0] if str(e) else ""}).') from None
  for number, row in enumerate(rows):
    yield f'{path} (row {number})', row


def _saved_dataset_records(path: epath.Path, binding: str) -> Iterator[Tuple[str, Any]]:
  """A directory `datasets.Dataset.save_to_disk` wrote: its `state.json` lists its Arrow files
  (Arrow's streaming format), read here with pyarrow, in order. A `DatasetDict` saved whole
  (`dataset_dict.json`) is refused naming its splits' directories."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  if (path / 'dataset_dict.json').exists():
    splits = json.loads((path / 'dataset_dict.json').read_text()).get('splits', [])
    raise SftError(f'{binding} = {str(path)!r}: a DatasetDict saved to disk, with the splits '
                   f'{splits}. Fix: give one split\'s directory, e.g. {str(path / splits[0])!r}'
                   if splits else f'{binding} = {str(path)!r}: a DatasetDict with no splits.')
  try:
    files = [entry['filename'] for entry in json.loads((path / 'state.json').read_text())[
        '_data_files']]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SftError(f'{path}/state.json: not the state of a dataset saved to disk '
                   f'({type(e).__name__}: {e}). Fix: save it with datasets\' save_to_disk, or '
                   f'give .jsonl / .parquet files.') from None
  number = 0
  for name in files:
    with (path / name).open('rb') as f:
      rows = pa.ipc.open_stream(f).read_all().to_pylist()
    for row in rows:
      yield f'{path / name} (row {number})', row
      number += 1


def file_records(path: str, binding: str) -> Iterator[Tuple[str, Any]]:
  """(where, record) of a .jsonl, .json (an array, or JSON lines) or .parquet file, or of a
  directory a `datasets` dataset was saved to (`save_to_disk`), in file order."""
  file = epath.Path(path)
  if file.is_dir() and ((file / 'state.json').exists() or
                        (file / 'dataset_dict.json').exists()):
    return _saved_dataset_records(file, binding)
  readers = {'.jsonl': _jsonl_records, '.json': _json_records, '.parquet': _parquet_records}
  reader = readers.get(file.suffix.lower())
  if reader is None or not file.is_file():
    what = ('a directory that holds no dataset saved to disk (state.json)' if file.is_dir() else
            'no such file' if not file.exists() else f'a {file.suffix or "suffixless"} file')
    raise SftError(f'{binding} = {path!r}: {what}. Fix: give .jsonl (one JSON object per '
                   'line) or .parquet files of samples, or a `datasets` save_to_disk directory.')
  return reader(file)


def _example_record(example: Mapping[str, Any]) -> Dict[str, Any]:
  """A seqio example (bytes features) -> a record: `messages` JSON decoded, strings decoded."""
  out = {k: v.decode('utf-8', errors='replace') if isinstance(v, bytes) else v
         for k, v in example.items()}
  if isinstance(out.get('messages'), str):
    try:
      out['messages'] = json.loads(out['messages'])
    except json.JSONDecodeError:
      pass   # `conversation` says it is no list
  return out


@dataclasses.dataclass(frozen=True)
class SftPipeline(lm.LmPipeline):
  """One split of instruction samples, rendered, tokenized and packed, loss on responses.

  Attributes (besides `lm.LmPipeline`'s: `task`, `split`, `feature_lengths`, `tokenizer`,
  `pack`, `shuffle`, `module`; `text_key` unused):
    data_files: a .jsonl / .parquet path, a `datasets` save_to_disk directory, or a list of
      them (local or gs://), read instead of
      the task (whose split is then not read); None: the task's split.
    template: None (the tokenizer's chat template) or a name of `TEMPLATES` (for a base
      tokenizer; it replaces the tokenizer's).
    overlong: 'truncate' or 'drop' (module docstring).
  """
  data_files: Union[None, str, Sequence[str]] = None
  template: Optional[str] = None
  overlong: str = 'truncate'

  def __post_init__(self):
    super().__post_init__()
    fields.choice(self, 'overlong', OVERLONG)
    if self.template is not None and self.template not in TEMPLATES:
      raise fields.ConfigError(
          f'SFT_TEMPLATE ({fields.binding(self, "template")}) = {self.template!r}: expected None '
          f"(the tokenizer's chat template) or one of {sorted(TEMPLATES)}.")
    files = self.data_files
    if isinstance(files, str):
      files = (files,)
    if files is not None and (not isinstance(files, (list, tuple)) or not files
                              or not all(isinstance(f, str) and f for f in files)):
      raise fields.ConfigError(
          f'{fields.binding(self, "data_files")} = {self.data_files!r}: expected a .jsonl / '
          '.parquet path or a save_to_disk directory, a list of them, or None for the task.')
    object.__setattr__(self, 'data_files', None if files is None else tuple(files))

  def chat_template(self) -> str:
    """The template samples are rendered with; SftError if the tokenizer has none and no
    name is given."""
    tok = self.load_tokenizer()
    if 'tokenizer.json' not in tok.files:
      raise SftError(
          f'TOKENIZER {tok.source} is SentencePiece alone (tokenizer.model): encoding a '
          'conversation part by part would add a word boundary at every part. Fix: the '
          "checkpoint's tokenizer.json (HF tokenizers).")
    if self.template is not None:
      return TEMPLATES[self.template]
    if tok.chat_template is None:
      raise SftError(
          f'TOKENIZER {tok.source} has no chat template (no chat_template.jinja, no '
          f'chat_template in tokenizer_config.json), so its samples cannot be rendered. Fix: '
          f'--gin.SFT_TEMPLATE="\'plain\'" ({fields.binding(self, "template")}; one of '
          f'{sorted(TEMPLATES)}), or a tokenizer with a chat template.')
    return tok.chat_template

  def describe(self) -> Dict[str, Any]:
    source = ({'files_sha256': self._files_digest()} if self.data_files is not None else
              {'task': self.task, 'split': self.split})
    return {'kind': 'sft', **source, 'length': self.length,
            'tokenizer': self.load_tokenizer().short_digest, 'template': self.template,
            'overlong': self.overlong, 'pack': self.pack, 'shuffle': self.shuffle}

  def _files_digest(self) -> str:
    h = hashlib.sha256()
    for path in self.data_files:
      h.update(epath.Path(path).read_bytes() if epath.Path(path).is_file() else path.encode())
    return h.hexdigest()[:16]

  def _where(self) -> str:
    return (', '.join(self.data_files) if self.data_files is not None
            else f'task {self.task!r}, split {self.split!r}')

  def records(self) -> List[Tuple[str, Any]]:
    """(where, record) of every sample of the split, in source order."""
    if self.data_files is not None:
      macro = 'SFT_TRAIN_FILES' if self.split == 'train' else 'SFT_VALIDATION_FILES'
      binding = f'{macro} ({fields.binding(self, "data_files")})'
      return [r for path in self.data_files for r in file_records(path, binding)]
    host_only.hide_accelerators()
    task = tasks.get_task(self.task, module=self.module,
                          task_binding=fields.binding(self, 'task'),
                          module_binding=fields.binding(self, 'module'))
    try:
      ds = task.source.get_dataset(split=self.split, shuffle=False)
      examples = list(ds.as_numpy_iterator())
    except Exception as e:  # pylint: disable=broad-except  (TFDS and imports fail many ways)
      raise source_errors.source_error(self.task, task, e, module=self.module) from e
    return [(f'task {self.task!r}, split {self.split!r}, example {i}', _example_record(x))
            for i, x in enumerate(examples)]

  def rendered(self, *, seed: int, shard_index: int, num_shards: int
               ) -> List[List[Tuple[str, bool]]]:
    """The response parts (`response_parts`) of this host's shard of the split's samples,
    in a permutation drawn from `seed` (numpy) when shuffling, else in source order."""
    template, special = self.chat_template(), self.load_tokenizer().special_tokens()
    records = self.records()
    order = (np.random.default_rng(seed).permutation(len(records)) if self.shuffle
             else np.arange(len(records)))
    out = []
    for i in order[shard_index::num_shards]:
      where, record = records[i]
      messages = conversation(record, where)
      try:
        out.append(response_parts(template, messages, special))
      except NotAPrefix as e:
        raise SftError(f'{where}: the chat template does not render the conversation up to '
                       f'its {e} (with the generation prompt) as the start of the whole '
                       'conversation, so the response has no place in it. Fix: a template '
                       'that renders each turn after the ones before it.') from None
      except Exception as e:  # pylint: disable=broad-except  (Jinja: a template's own errors)
        raise SftError(f'{where}: the chat template failed on this sample '
                       f'({type(e).__name__}: {e}).') from None
    if not out:
      raise SftError(f'SFT data {self._where()} has no samples (shard {shard_index} of '
                     f'{num_shards}). Fix: give samples, one JSON object per line.')
    return out

  def batches(self, *, seed: int, batch_size: int, shard_index: int, num_shards: int,
              drop_remainder: bool, skip_batches: int) -> tf.data.Dataset:
    """One epoch of this host's shard of samples, as batches of rows, after `skip_batches`;
    a pure function of (seed, shard_index, num_shards). The samples are tokenized here, and
    how many were whole, truncated and left out is logged."""
    tok, where = self.load_tokenizer(), f'{self._where()} (shard {shard_index})'
    counts = SampleCounts()
    windows = [w for w in (
        window(*tokens_and_mask(tok, parts), length=self.length, overlong=self.overlong,
               counts=counts)
        for parts in self.rendered(seed=seed, shard_index=shard_index, num_shards=num_shards))
               if w is not None]
    log.info(counts.text(where, self.length))
    if not windows:
      raise SftError(
          f'{counts.text(where, self.length)} None is left to train on. Fix: a longer '
          f"TASK_FEATURE_LENGTHS['targets'], or --gin.SFT_OVERLONG=\"'truncate'\".")
    spec = tf.TensorSpec([None], tf.int32)
    ds = tf.data.Dataset.from_generator(
        lambda: iter(windows), output_signature={'inputs': spec, 'targets': spec,
                                                 'weights': spec})
    ds = self._rows(ds)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    return ds.skip(skip_batches)
