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

Both split by topic or module, deterministically, so validation text comes from topics or
modules never seen in training. The exact text depends on the Python version (`sys.version`).
"""

import functools
import pathlib
import re
import sysconfig
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

SPLITS = ('train', 'validation')
_VALIDATION_EVERY = 10
STDLIB_DOCUMENT_BYTES = 60_000
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
  if split not in SPLITS:
    raise ValueError(f'The offline corpus has splits {SPLITS}; got split {split!r}.')
  out = []
  for i, module in enumerate(stdlib_modules()):
    if (i % _VALIDATION_EVERY == 0) == (split == 'validation'):
      out += _pieces(module.read_text(encoding='utf-8', errors='replace'))
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
