"""Text corpora that ship with Python, so language-model pipelines run with no download.

  'pydoc'   the documentation topics of `pydoc_data.topics`: real prose and code from the
            Python reference manual. Documents are paragraphs (blank-line separated), each
            kept once: ~2070 distinct paragraphs, ~370 KB. Every tenth of the 79 topics in
            sorted order is 'validation' (~210 paragraphs, ~29 KB).
  'stdlib'  the source of Python's standard library: code, docstrings and comments, ~9.2 MB
            in 441 modules (Python 3.11), without the test suites, the codec tables, IDLE,
            tkinter, lib2to3, turtledemo and installed packages; large enough that a CPU-sized
            run need not read a byte twice. Documents are modules cut at blank lines into
            pieces of at most `STDLIB_DOCUMENT_BYTES` (span corruption keeps one chunk of 65536
            tokens per document, so no text is skipped). Every tenth module in sorted path
            order is 'validation' (~8.0 MB train, ~1.2 MB validation).

  'functions' an instruction set mined from the same modules (`stdlib_functions`): every
            documented function (a docstring and at least one statement after it) of at most
            `FUNCTION_MAX_BYTES` of source is a prompt (its signature and docstring, with an
            instruction to implement it) and a response (its body after the docstring, as
            written). 4,343 train and 616 validation pairs (Python 3.11.7).

All split by topic or module, deterministically, so validation text comes from topics or
modules never seen in training. The exact text depends on the Python version (`sys.version`).
"""

import ast
import functools
import pathlib
import re
import sysconfig
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

SPLITS = ('train', 'validation')
_VALIDATION_EVERY = 10
STDLIB_DOCUMENT_BYTES = 60_000
FUNCTION_MAX_BYTES = 2_000
FUNCTION_PROMPT = 'Implement this Python function (signature and docstring given):'
_STDLIB_SKIPPED = ('site-packages', 'dist-packages', 'test', 'tests', 'idlelib', 'tkinter',
                   'lib2to3', 'turtledemo', 'encodings', '__phello__')   # encodings: codec tables


@functools.lru_cache(maxsize=None)
def paragraphs(split: str) -> Tuple[str, ...]:
  """The paragraphs of `split`, in corpus order (sorted topics, then position in topic)."""
  if split not in SPLITS:
    raise ValueError(f'The offline corpus has splits {SPLITS}; got split {split!r}.')
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  out, seen = [], set()
  for i, name in enumerate(sorted(topics)):
    for p in re.split(r'\n\s*\n', topics[name]):
      p = p.strip()
      if p and p not in seen:  # Some paragraphs recur across topics; keep the first.
        seen.add(p)
        if (i % _VALIDATION_EVERY == 0) == (split == 'validation'):
          out.append(p)
  return tuple(out)


def stdlib_modules() -> List[pathlib.Path]:
  """The standard library's modules in the corpus, sorted by path below the stdlib root."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  def kept(path):
    folders = path.relative_to(root).parts[:-1]
    return not any(f in _STDLIB_SKIPPED or f.startswith('config-') for f in folders)

  return sorted(filter(kept, root.rglob('*.py')), key=lambda p: p.relative_to(root).as_posix())


def _pieces(text: str) -> List[str]:
  """`text` cut at blank lines into pieces of at most STDLIB_DOCUMENT_BYTES UTF-8 bytes (a
  longer block between blank lines is cut at line ends)."""
  pieces, current, size = [], [], 0
  for block in re.split(r'(?<=\n)(?=\s*\n)', text):
    lines = [block] if len(block.encode()) <= STDLIB_DOCUMENT_BYTES else block.splitlines(True)
    for part in lines:
      n = len(part.encode())
      if current and size + n > STDLIB_DOCUMENT_BYTES:
        pieces.append(''.join(current))
        current, size = [], 0
      current.append(part)
      size += n
  if current:
    pieces.append(''.join(current))
  return [p for p in pieces if p.strip()]


@functools.lru_cache(maxsize=None)
def stdlib_documents(split: str) -> Tuple[str, ...]:
  """The documents of `split` of the 'stdlib' corpus, in corpus order (module, then piece)."""
  out = []
  for module in _split_modules(split):
    out += _pieces(module.read_text(encoding='utf-8', errors='replace'))
  return tuple(out)


def _split_modules(split: str) -> List[pathlib.Path]:
  """The stdlib modules of `split`: every tenth in sorted path order is 'validation'."""
  if split not in SPLITS:
    raise ValueError(f'The offline corpus has splits {SPLITS}; got split {split!r}.')
  return [module for i, module in enumerate(stdlib_modules())
          if (i % _VALIDATION_EVERY == 0) == (split == 'validation')]


def _instruction(lines: List[str], node: ast.FunctionDef) -> Optional[Dict[str, str]]:
  """{'prompt', 'response'} of one function of a module's `lines` (with their ends), or None
  if it has no docstring, no statement after it, or more than FUNCTION_MAX_BYTES of source."""
  if ast.get_docstring(node) is None or len(node.body) < 2:
    return None
  if node.body[1].lineno == node.body[0].end_lineno:
    return None   # a statement on the docstring's line (`"""Doc."""; x = 1`)
  head = ''.join(lines[node.lineno - 1:node.body[0].end_lineno])   # decorators left out
  response = ''.join(lines[node.body[0].end_lineno:node.end_lineno])
  if len((head + response).encode()) > FUNCTION_MAX_BYTES or not response.strip():
    return None
  return {'prompt': f'{FUNCTION_PROMPT}\n\n{head}', 'response': response}


@functools.lru_cache(maxsize=None)
def stdlib_functions(split: str) -> Tuple[Dict[str, str], ...]:
  """The 'functions' instruction set of `split`: `{'prompt', 'response'}` per documented
  function of the split's stdlib modules, in module order, then source order (nested
  functions and methods included). The prompt is `FUNCTION_PROMPT`, a blank line, then the
  function's lines from `def` through its docstring; the response its remaining lines,
  indentation kept. A module Python cannot parse is skipped; a validation function whose
  prompt is also a training one (17 on Python 3.11.7: copies across modules) is left out."""
  out = []
  for module in _split_modules(split):
    text = module.read_text(encoding='utf-8', errors='replace')
    try:
      parsed = ast.parse(text)
    except SyntaxError:
      continue
    lines = text.splitlines(True)
    nodes = sorted((n for n in ast.walk(parsed)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                   key=lambda n: (n.lineno, n.col_offset))
    out += filter(None, (_instruction(lines, node) for node in nodes))
  if split == 'validation':   # a function copied into a training module too is left out
    seen = {pair['prompt'] for pair in stdlib_functions('train')}
    out = [pair for pair in out if pair['prompt'] not in seen]
  return tuple(out)


CORPORA = {'pydoc': paragraphs, 'stdlib': stdlib_documents}


def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None, *,
               corpus: str = 'pydoc') -> tf.data.Dataset:
  """`seqio.FunctionDataSource` source: `{'text': string scalar}` per document of `corpus`.

  With `shuffle_files`, the order is a full permutation drawn from `seed` (numpy, so it is the
  same on every machine); otherwise corpus order.
  """
  texts = np.array(CORPORA[corpus](split), dtype=object)
  if shuffle_files:
    texts = texts[np.random.default_rng(seed).permutation(len(texts))]
  return tf.data.Dataset.from_tensor_slices({'text': tf.constant(list(texts), tf.string)})


def functions_dataset_fn(split: str, shuffle_files: bool,
                         seed: Optional[int] = None) -> tf.data.Dataset:
  """`seqio.FunctionDataSource` source of the 'functions' instruction set: `{'prompt',
  'response'}` string scalars per pair, shuffled as `dataset_fn` shuffles documents."""
  pairs = stdlib_functions(split)
  order = (np.random.default_rng(seed).permutation(len(pairs)) if shuffle_files
           else np.arange(len(pairs)))
  return tf.data.Dataset.from_tensor_slices(
      {key: tf.constant([pairs[i][key] for i in order], tf.string)
       for key in ('prompt', 'response')})
