"""TensorFlow loads without its start-up lines on the terminal.

Loading TensorFlow 2.21 writes, from its shared libraries' initializers and before it reads
TF_CPP_MIN_LOG_LEVEL, lines such as
  WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
  I0000 00:00:1796303010.280102    6076 port.cc:153] oneDNN custom operations are on. ...
  I0000 00:00:1796303010.280611    6076 cudart_stub.cc:31] Could not find cuda drivers ...
to file descriptor 2, twice. `hide()` makes the first `import tensorflow` (whoever imports
it: seqio, a data module) run with file descriptor 2 on a temporary file, and writes back to
the terminal what it held less those lines: absl's INFO and WARNING lines and its notice
above. Errors (E, F lines) and everything else come through, after the import.
"""

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile
from typing import Iterator

_NOISE = re.compile(r'WARNING: All log messages before absl::InitializeLog\(\)|[IW]\d{4} ')


@contextlib.contextmanager
def _descriptor_2_filtered() -> Iterator[None]:
  """File descriptor 2 goes to a temporary file; then its lines, less `_NOISE`, to fd 2."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kept = [line for line in held.read().splitlines(keepends=True)
              if not _NOISE.match(line.decode(errors='replace'))]
      os.write(2, b''.join(kept))


class _QuietLoader(importlib.abc.Loader):
  """TensorFlow's own loader, its module run with `_descriptor_2_filtered`."""

  def __init__(self, loader: importlib.abc.Loader, finder: '_QuietFinder'):
    self._loader, self._finder = loader, finder

  def __getattr__(self, name: str):
    return getattr(self._loader, name)

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module) -> None:
    if self._finder in sys.meta_path:
      sys.meta_path.remove(self._finder)
    with _descriptor_2_filtered():
      self._loader.exec_module(module)


class _QuietFinder(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` as the path finder does, with `_QuietLoader` as its loader."""

  def find_spec(self, name, path=None, target=None):
    if name != 'tensorflow':
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader, self)
    return spec


def hide() -> None:
  """The next first `import tensorflow` of this process leaves its start-up lines out."""
  if 'tensorflow' in sys.modules or any(isinstance(f, _QuietFinder) for f in sys.meta_path):
    return
  sys.meta_path.insert(0, _QuietFinder())
