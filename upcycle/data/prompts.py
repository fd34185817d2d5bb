"""Prompts for a decoder-only LM to continue (`python -m upcycle.infer` with
runs/llm_infer.gin): the lines of a JSONL file, or the first window of each document of a text
task's split.

A prompt is framed as training frames a document (`lm.LmPipeline`): the tokenizer's BOS, then
its text's tokens. A task document's prompt is its first window's `decoder_input_tokens`: BOS
and the first `length - 1` tokens of its text, the whole document (without EOS) if it is
shorter. Batches are left-padded to `length` (HF's `padding_side='left'`), so that every row's
next token is at the same column.
"""

import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from etils import epath
import numpy as np

from upcycle import fields
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.data.iterator import EmptySplit


class PromptsError(ValueError):
  """A prompts file that is missing, or a line of it that is no prompt or too long (one line:
  where, what, the fix)."""


@dataclasses.dataclass(frozen=True)
class Prompts:
  """The prompts of a decode, tokenized with the checkpoint's tokenizer.

  Attributes:
    task: a seqio task whose source yields documents under `text_key`; its `split` gives the
      prompts when there is no `prompts_file`.
    split: the task's split.
    feature_lengths: {'targets': n}: a prompt's most tokens, BOS included (a task document's
      first window; a longer file prompt is refused).
    tokenizer: `upcycle.data.tokenizer.load`'s spec: an HF checkpoint directory, a run
      directory or its checkpoint (the run's `tokenizer/`), or an offline BPE
      ('offline_stdlib_bpe', 'offline_packages_bpe').
    prompts_file: a JSONL file (local or gs://), one `{"prompt": "..."}` per line; None: the
      task's documents.
    text_key: the task source's text feature.
    module: a module to import before `task` is looked up, which registers it (T5X's
      MIXTURE_OR_TASK_MODULE); None: none.
  """
  task: str
  split: str
  feature_lengths: Mapping[str, int]
  tokenizer: tokenizer_lib.Spec
  prompts_file: Optional[str] = None
  text_key: str = 'text'
  module: Optional[str] = None

  def __post_init__(self):
    fields.lengths(self, 'feature_lengths', ('targets',), "TASK_FEATURE_LENGTHS = {'targets': 128}")
    object.__setattr__(self, 'tokenizer', tokenizer_lib.checked_spec(
        f'TOKENIZER ({fields.binding(self, "tokenizer")})', self.tokenizer))
    if self.prompts_file is not None and (not isinstance(self.prompts_file, str)
                                          or not self.prompts_file):
      raise fields.ConfigError(
          f'PROMPTS_FILE ({fields.binding(self, "prompts_file")}) = {self.prompts_file!r}: '
          'expected the path of a JSONL file (a string), or None for the task\'s documents.')

  @property
  def length(self) -> int:
    return int(self.feature_lengths['targets'])

  @property
  def name(self) -> str:
    """What the outputs are named after: the prompts file (without its extension) or the task."""
    if self.prompts_file is None:
      return self.task
    return os.path.splitext(epath.Path(self.prompts_file).name)[0]

  def load_tokenizer(self) -> tokenizer_lib.Tokenizer:
    return tokenizer_lib.load(self.tokenizer)

  def size(self) -> Optional[int]:
    """How many prompts there are, if known (the file's lines; a task split's documents when
    its source says)."""
    if self.prompts_file is not None:
      return sum(1 for _ in self._file_lines())
    try:
      return self._task().num_input_examples(self.split)
    except Exception:  # pylint: disable=broad-except  (no count; reading the split says why)
      return None

  def prompts(self) -> Iterator[Tuple[str, List[int]]]:
    """(text, tokens) of each prompt, in order; tokens start with BOS."""
    tok = self.load_tokenizer()
    found = False
    for row in self._task_prompts(tok) if self.prompts_file is None else self._file_prompts(tok):
      found = True
      yield row
    if not found:
      source = self.prompts_file or f'task {self.task!r}, split {self.split!r}'
      raise EmptySplit(f'{source} has no prompts: give a JSONL file with one '
                       '{"prompt": "..."} per line (PROMPTS_FILE), or a task whose split has '
                       'documents.')

  def check(self) -> None:
    """Reads a prompts file through, refusing its first line that is no prompt in one line
    (PromptsError), so that a decode refuses it before reading its checkpoint; a task split is
    read as the decode goes."""
    if self.prompts_file is not None:
      for _ in self.prompts():
        pass

  def batches(self, batch_size: int) -> Iterator[Dict[str, Any]]:
    """Batches of at most `batch_size` prompts: 'prompt' (texts), 'prompt_tokens' and
    'prompt_mask' int32 `[n, length]`, each prompt at the end of its row (mask 1 on it)."""
    rows = []
    for row in self.prompts():
      rows.append(row)
      if len(rows) == batch_size:
        yield self._batch(rows)
        rows = []
    if rows:
      yield self._batch(rows)

  def _batch(self, rows: List[Tuple[str, List[int]]]) -> Dict[str, Any]:
    tokens = np.zeros((len(rows), self.length), np.int32)
    mask = np.zeros((len(rows), self.length), np.int32)
    for i, (_, ids) in enumerate(rows):
      tokens[i, self.length - len(ids):] = ids
      mask[i, self.length - len(ids):] = 1
    return {'prompt': [text for text, _ in rows], 'prompt_tokens': tokens, 'prompt_mask': mask}

  def describe(self) -> Dict[str, Any]:
    """JSON-serializable identity of what is decoded: a prompts file by the sha256 of its
    bytes (two files of one name differ by it, copies of one file do not), else the task's
    split; the tokenizer by its files' digest."""
    source = ({'file_sha256': hashlib.sha256(self._file().read_bytes()).hexdigest()}
              if self.prompts_file is not None else
              {'task': self.task, 'split': self.split, 'text_key': self.text_key})
    return {'kind': 'prompts', **source, 'length': self.length,
            'tokenizer': self.load_tokenizer().digest[:16]}

  def _file(self) -> epath.Path:
    """The prompts file, refused in one line if there is none."""
    path = epath.Path(self.prompts_file)
    if not path.is_file():
      raise PromptsError(f'PROMPTS_FILE = {self.prompts_file!r} (prompts.Prompts.prompts_file): '
                         'no such file. Fix: give a JSONL file of {"prompt": "..."} lines.')
    return path

  def _file_lines(self) -> Iterator[Tuple[int, str]]:
    """(line number, line) of the file's non-blank lines, refusing bytes that are not UTF-8."""
    with self._file().open('rb') as f:
      for number, raw in enumerate(f, 1):
        try:
          line = raw.decode('utf-8')
        except UnicodeDecodeError as e:
          raise PromptsError(
              f'{self.prompts_file}:{number}: not UTF-8 ({e.reason} at byte {e.start + 1} of '
              'the line). Fix: write the file as UTF-8.') from None
        if line.strip():
          yield number, line

  def _file_prompts(self, tok: tokenizer_lib.Tokenizer) -> Iterator[Tuple[str, List[int]]]:
    for number, line in self._file_lines():
      where = f'{self.prompts_file}:{number}'
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise PromptsError(f'{where}: not JSON ({e}). Fix: one {{"prompt": "..."}} per '
                           'line.') from e
      if not isinstance(record, dict) or not isinstance(record.get('prompt'), str):
        raise PromptsError(f'{where}: expected {{"prompt": "<text>"}}, got {line.strip()[:80]}.')
      try:
        record['prompt'].encode('utf-8')
      except UnicodeEncodeError as e:   # a lone surrogate escape (\ud800): no character
        raise PromptsError(
            f'{where}: the prompt holds {record["prompt"][e.start]!r} at character '
            f'{e.start + 1}, half of a UTF-16 surrogate pair, which is no text. Fix: escape '
            'whole characters (\\ud83d\\ude00), or write them as UTF-8.') from None
      tokens = [tok.bos_id, *tok.encode(record['prompt'])]
      if len(tokens) > self.length:
        raise PromptsError(
            f'{where}: the prompt is {len(tokens)} tokens with BOS, more than '
            f"TASK_FEATURE_LENGTHS['targets'] = {self.length} (prompts.Prompts.feature_lengths). "
            f"Fix: --gin.TASK_FEATURE_LENGTHS=\"{{'targets': {len(tokens)}}}\", or shorten it.")
      yield record['prompt'], tokens

  def _task(self) -> Any:
    """The registered seqio task `task`, its `module` imported first (a name nothing
    registers: one line naming the binding; prompts of your own: PROMPTS_FILE)."""
    from upcycle.data import tasks  # pylint: disable=g-import-not-at-top  (imports seqio, TF)
    return tasks.get_task(self.task, module=self.module,
                          task_binding=fields.binding(self, 'task'),
                          module_binding=fields.binding(self, 'module'))

  def _task_prompts(self, tok: tokenizer_lib.Tokenizer) -> Iterator[Tuple[str, List[int]]]:
    """Each document's first window, and its text (decoded: the window cuts between tokens)."""
    # pylint: disable=g-import-not-at-top  (a prompts file needs no TensorFlow)
    from upcycle.data import host_only, source_errors
    # pylint: enable=g-import-not-at-top
    host_only.hide_accelerators()
    task = self._task()
    try:
      ds = task.source.get_dataset(split=self.split, shuffle=False)
    except Exception as e:  # pylint: disable=broad-except  (TFDS and imports fail many ways)
      raise source_errors.source_error(self.task, task, e, module=self.module) from e
    for example in ds.as_numpy_iterator():
      text = example[self.text_key].decode('utf-8', errors='replace')
      tokens = [tok.bos_id, *tok.encode(text)][:self.length]
      yield tok.decode(tokens), tokens
