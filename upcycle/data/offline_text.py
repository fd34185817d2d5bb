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
            order is 'validation' (~8.0 MB train, ~1.2 MB validation). Its text is the
            interpreter's: two builds of Python 3.11.7 can differ.
  'packages' the source of the numpy, scipy, scikit-learn and matplotlib that setup.py pins
            (PACKAGE_PINS), as installed: 1,175 modules, ~27.5 MB, cut and split as 'stdlib'
            (1,057 modules and ~24.9 MB train, 118 and ~2.6 MB validation). Left out: every
            `tests/` and `test/` folder (the test suites; `numpy.testing` and
            `matplotlib.testing` are library code and stay), vendored copies of other projects,
            data tables and the wheels' build-time `__config__.py` (`_PACKAGES_LEFT_OUT`). The
            same text on every machine that installs the pins: `corpus_record` says whether
            this machine's is the pinned one (its `digest` against PACKAGES_DIGEST), and every
            training run records it.

  'functions' an instruction set mined from the same modules (`stdlib_functions`): every
            documented function (a docstring and at least one statement after it) of at most
            `FUNCTION_MAX_BYTES` of source is a prompt (its signature and docstring, with an
            instruction to implement it) and a response (its body after the docstring, as
            written). 4,343 train and 616 validation pairs (Python 3.11.7).

All split by topic or module, deterministically, so validation text comes from topics or
modules never seen in training. The text of 'pydoc', 'stdlib' and 'functions' depends on the
Python build; that of 'packages' on the pinned packages' wheels alone.
"""

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import pathlib
import platform
import re
import sysconfig
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

SPLITS = ('train', 'validation')
_VALIDATION_EVERY = 10
STDLIB_DOCUMENT_BYTES = 60_000
FUNCTION_MAX_BYTES = 2_000
FUNCTION_PROMPT = 'Implement this Python function (signature and docstring given):'
_STDLIB_SKIPPED = ('site-packages', 'dist-packages', 'test', 'tests', 'idlelib', 'tkinter',
                   'lib2to3', 'turtledemo', 'encodings', '__phello__')   # encodings: codec tables
# The 'packages' corpus: {distribution: its folder in site-packages}, and setup.py's pins.
PACKAGES = {'numpy': 'numpy', 'scipy': 'scipy', 'scikit-learn': 'sklearn',
            'matplotlib': 'matplotlib'}
PACKAGE_PINS = {'numpy': '2.4.6', 'scipy': '1.17.1', 'scikit-learn': '1.9.1',
                'matplotlib': '3.11.2'}
# `corpus_digest('packages')` of the pinned wheels (Linux x86-64, CPython 3.11).
PACKAGES_DIGEST = 'b76f7f0eeaa93a06d67f2b7cd47d3be941011b47e3d7c6d4e512b5bff3d580ec'
_PACKAGES_LEFT_OUT = (   # besides every folder named tests/ or test/ (the test suites)
    # vendored copies of other projects (scikit-learn and scipy both carry array_api_compat
    # and array_api_extra, so their text would be in both splits)
    'sklearn/externals', 'scipy/_lib/array_api_compat', 'scipy/_lib/array_api_extra',
    'scipy/_lib/cobyqa', 'scipy/_lib/pyprima', 'scipy/_lib/_uarray',
    # data tables: colormaps, glyph metrics, physical constants, quadrature nodes
    'matplotlib/_cm.py', 'matplotlib/_cm_bivar.py', 'matplotlib/_cm_listed.py',
    'matplotlib/_cm_multivar.py', 'matplotlib/_mathtext_data.py', 'scipy/constants/_codata.py',
    'scipy/integrate/_lebedev.py',
    # written when the wheel was built: the build machine's compilers and libraries
    'numpy/__config__.py', 'scipy/__config__.py')


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


def stdlib_modules(root: Optional[pathlib.Path] = None) -> List[pathlib.Path]:
  """The standard library's modules in the corpus, sorted by path below `root` (None: this
  interpreter's stdlib directory)."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib']) if root is None else root
  def kept(relative):
    return not any(f in _STDLIB_SKIPPED or f.startswith('config-') for f in relative.parts[:-1])

  return _sorted_modules(root, root.rglob('*.py'), kept)


def packages_root() -> pathlib.Path:
  """The directory the pinned packages are installed in (site-packages): numpy's parent."""
  return pathlib.Path(importlib.util.find_spec('numpy').submodule_search_locations[0]).parent


def package_modules(root: Optional[pathlib.Path] = None) -> List[pathlib.Path]:
  """The 'packages' corpus's modules: the `.py` files of PACKAGES' folders in `root` (None:
  `packages_root()`) but their test suites, vendored code and data tables
  (`_PACKAGES_LEFT_OUT`), sorted by path below `root`."""
  root = packages_root() if root is None else root
  def kept(relative):
    path = relative.as_posix()
    return not (set(relative.parts[:-1]) & {'tests', 'test'} or any(
        path == left or path.startswith(left + '/') for left in _PACKAGES_LEFT_OUT))

  found = [p for folder in PACKAGES.values() for p in (root / folder).rglob('*.py')]
  return _sorted_modules(root, found, kept)


def _sorted_modules(root: pathlib.Path, paths: Iterable[pathlib.Path],
                    kept: Callable[[pathlib.PurePath], bool]) -> List[pathlib.Path]:
  """`paths` whose path relative to `root` is `kept`, sorted by that path (POSIX form)."""
  relative = {p: p.relative_to(root) for p in paths}
  return sorted((p for p, r in relative.items() if kept(r)),
                key=lambda p: relative[p].as_posix())


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
  return _documents(_split_modules(stdlib_modules(), split))


@functools.lru_cache(maxsize=None)
def packages_documents(split: str) -> Tuple[str, ...]:
  """The documents of `split` of the 'packages' corpus, in corpus order (module, then piece)."""
  return _documents(_split_modules(package_modules(), split))


def _documents(modules: List[pathlib.Path]) -> Tuple[str, ...]:
  """The documents of `modules`: each cut into `_pieces`, in order."""
  return tuple(piece for module in modules
               for piece in _pieces(module.read_text(encoding='utf-8', errors='replace')))


def _split_modules(modules: List[pathlib.Path], split: str) -> List[pathlib.Path]:
  """The `modules` of `split`: every tenth in order, from the first, is 'validation'."""
  if split not in SPLITS:
    raise ValueError(f'The offline corpus has splits {SPLITS}; got split {split!r}.')
  return [module for i, module in enumerate(modules)
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
  for module in _split_modules(stdlib_modules(), split):
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


CORPORA = {'pydoc': paragraphs, 'stdlib': stdlib_documents, 'packages': packages_documents}
_MODULES = {'stdlib': stdlib_modules, 'packages': package_modules}   # corpora read from files


def package_versions(root: Optional[pathlib.Path] = None) -> Dict[str, Optional[str]]:
  """{distribution: version} of PACKAGES as installed in `root` (None: `packages_root()`),
  from their `.dist-info` metadata; None for one that is not installed there."""
  root = packages_root() if root is None else root
  found = {dist.metadata['Name'].lower(): dist.version
           for dist in importlib.metadata.distributions(path=[str(root)])}
  return {name: found.get(name) for name in PACKAGES}


def digest(root: pathlib.Path, modules: List[pathlib.Path], versions: Dict[str, Optional[str]]
           ) -> str:
  """sha256 (hex) of `versions` and `modules`: first `name==version` and a newline per entry of
  `versions` in order, then per module, in order, its path relative to `root` (POSIX, UTF-8),
  a NUL byte, its size in bytes in decimal, a NUL byte and its bytes."""
  h = hashlib.sha256(''.join(f'{n}=={v}\n' for n, v in versions.items()).encode())
  for module in modules:
    data = module.read_bytes()
    h.update(f'{module.relative_to(root).as_posix()}\0{len(data)}\0'.encode())
    h.update(data)
  return h.hexdigest()


def corpus_record(corpus: str, root: Optional[pathlib.Path] = None) -> Optional[Dict]:
  """What a run records of the files-based `corpus` ('stdlib', 'packages'; None for another),
  read from `root` (None: where this interpreter has it): {'corpus', 'digest', 'versions',
  'pinned_digest', 'pinned_versions', 'matches'}. 'packages' is pinned (setup.py's versions,
  PACKAGES_DIGEST), so 'matches' says whether this machine's is the same text; 'stdlib' has
  no pin ('matches' None): it is the interpreter's, versioned by Python's version."""
  if corpus not in _MODULES:
    return None
  if corpus == 'packages':
    root = packages_root() if root is None else root
    versions, pinned = package_versions(root), (PACKAGES_DIGEST, PACKAGE_PINS)
  else:
    root = pathlib.Path(sysconfig.get_paths()['stdlib']) if root is None else root
    versions, pinned = {'python': platform.python_version()}, (None, None)
  found = digest(root, _MODULES[corpus](root), versions)
  return {'corpus': corpus, 'digest': found, 'versions': versions, 'pinned_digest': pinned[0],
          'pinned_versions': pinned[1],
          'matches': None if pinned[0] is None else found == pinned[0]}


def mismatch_warning(record: Optional[Dict]) -> Optional[str]:
  """One line naming a `corpus_record` whose text is not the pinned one; None if it is (or
  has no pin)."""
  if not record or record['matches'] is not False:
    return None
  versions = lambda v: ', '.join(f'{n} {v[n]}' for n in v)
  return (f"WARNING: the offline corpus {record['corpus']!r} here is not the pinned one: "
          f"sha256 {record['digest']} (pinned {record['pinned_digest']}); packages "
          f"{versions(record['versions'])} (pinned {versions(record['pinned_versions'])}). "
          'The run trains on this text: its numbers are not the README\'s.')


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
