"""Where the upcycling report goes: one summary on the console, every leaf in a file.

A plan's report lists every target leaf (about 300 lines for T5 Base). The restore hooks and
`python -m upcycle.convert` log its summary, naming `<directory>/upcycling_report.txt`, which
holds the whole report, written whole (a temporary file renamed; on gs:// one object). The
trainer says which directory (`kept_in(MODEL_DIR)` around its restore hook, which writes the file
once the hook has read the checkpoint: a start that fails leaves none);
`python -m upcycle.aot`, which writes nothing, logs the summary naming the file the run will
write (`planned`); a hook called with neither, as notebooks call them, logs the whole report.
"""

import contextlib
import contextvars
import logging
import os
from typing import Iterator, List, Optional, Tuple

from etils import epath

from upcycle.checkpoints import paths
from upcycle.upcycling.report import UpcycleReport

REPORT_FILE = 'upcycling_report.txt'

# (directory, the reports shown in `kept_in`'s block, which it writes there at its end)
_Kept = Tuple[str, List[UpcycleReport]]
_DIRECTORY: contextvars.ContextVar[Optional[_Kept]] = contextvars.ContextVar(
    'upcycling_report_directory', default=None)
_PLANNED: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    'upcycling_report_planned', default=None)


@contextlib.contextmanager
def kept_in(directory: str) -> Iterator[None]:
  """Reports shown (`show`) in the block go to `directory`/REPORT_FILE, written when the block
  ends without an error (a start that fails leaves no report of a run that never began)."""
  shown: List[UpcycleReport] = []
  token = _DIRECTORY.set((directory, shown))
  try:
    yield
  finally:
    _DIRECTORY.reset(token)
  for report in shown:
    write(report, directory)


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
  """Logs `report`'s summary, naming the file where `kept_in` writes the whole report at the
  end of its block; without a directory, logs the whole report."""
  kept = _DIRECTORY.get()
  if kept is None and _PLANNED.get() is not None:
    log.info('%s', summary(report, _PLANNED.get(), written=False))
    return
  if kept is None:
    log.info('%s', report)
    return
  directory, shown = kept
  shown.append(report)
  log.info('%s', summary(report, os.path.join(directory, REPORT_FILE)))
