"""Where the upcycling report goes: one summary on the console, every leaf in a file.

A plan's report lists every target leaf (about 300 lines for T5 Base). The restore hooks and
`python -m upcycle.convert` log its summary, naming `<directory>/upcycling_report.txt`, which
holds the whole report, written whole (a temporary file renamed; on gs:// one object). The
trainer says which directory (`kept_in(MODEL_DIR)` around its restore hook);
`python -m upcycle.aot`, which writes nothing, logs the summary naming the file the run will
write (`planned`); a hook called with neither, as notebooks call them, logs the whole report.
"""

import contextlib
import contextvars
import logging
import os
from typing import Iterator, Optional

from etils import epath

from upcycle.checkpoints import paths
from upcycle.upcycling.report import UpcycleReport

REPORT_FILE = 'upcycling_report.txt'

_DIRECTORY: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    'upcycling_report_directory', default=None)
_PLANNED: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    'upcycling_report_planned', default=None)


@contextlib.contextmanager
def kept_in(directory: str) -> Iterator[None]:
  """Reports shown (`show`) in the block go to `directory`/REPORT_FILE."""
  token = _DIRECTORY.set(directory)
  try:
    yield
  finally:
    _DIRECTORY.reset(token)


@contextlib.contextmanager
def planned(directory: str) -> Iterator[None]:
  """Reports shown (`show`) in the block log their summary only, naming `directory`/
  REPORT_FILE, where the run will write the whole report; nothing is written."""
  token = _PLANNED.set(os.path.join(directory, REPORT_FILE))
  try:
    yield
  finally:
    _PLANNED.reset(token)


def write(report: UpcycleReport, directory: str) -> str:
  """Writes the whole report to `directory`/REPORT_FILE (created whole); returns its path."""
  path = os.path.join(directory, REPORT_FILE)
  text = str(report) + '\n'
  if paths.is_url(path):
    epath.Path(path).write_text(text)   # one object: there whole or not at all
    return path
  os.makedirs(directory, exist_ok=True)
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)
  return path


def summary(report: UpcycleReport, path: str, written: bool = True) -> str:
  """The console's lines for `report` kept at `path` (or to be, not `written`): its
  summary, growth notes, the file."""
  notes = ''.join(f'\n  {note}' for note in report.notes)
  when = '' if written else ' (written when the run restores it)'
  return f'{report.summary()}{notes}\nFull upcycling report (every leaf): {path}{when}'


def show(report: UpcycleReport, log: logging.Logger) -> None:
  """Logs `report`'s summary and writes the whole report where `kept_in` says; without a
  directory, logs the whole report."""
  directory = _DIRECTORY.get()
  if directory is None and _PLANNED.get() is not None:
    log.info('%s', summary(report, _PLANNED.get(), written=False))
    return
  if directory is None:
    log.info('%s', report)
    return
  log.info('%s', summary(report, write(report, directory)))
