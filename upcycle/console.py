"""What the command-line entry points show: upcycle's log records as plain lines on stdout.

Library code reports through `logging.getLogger(__name__)` (absl-compatible: under
`absl.app` the records reach absl's handler). The entry points call `show_progress()`, so a
terminal shows upcycle's messages without prefixes, as print would (warnings on stderr), and
other libraries' records only from WARNING on.
"""

import logging
import sys


class _Current(logging.StreamHandler):
  """Writes to whatever `sys.<name>` is when a record arrives (pytest and notebooks swap it)."""

  def __init__(self, name: str):
    super().__init__()
    self._name = name

  @property
  def stream(self):
    return getattr(sys, self._name)

  @stream.setter
  def stream(self, value):
    del value


def show_progress(level: int = logging.INFO, info_to: str = 'stdout') -> None:
  """Sends the `upcycle` loggers' records at `level` and above to the terminal: warnings and
  errors to stderr, the rest to `info_to` ('stdout', or 'stderr' where stdout is the command's
  output, as `inspect --json`'s). A later call replaces an earlier one's handlers."""
  logger = logging.getLogger('upcycle')
  logger.setLevel(level)
  for handler in [h for h in logger.handlers if isinstance(h, _Current)]:
    logger.removeHandler(handler)
  out, err = _Current(info_to), _Current('stderr')
  out.addFilter(lambda record: record.levelno < logging.WARNING)
  err.setLevel(logging.WARNING)
  for handler in (out, err):
    handler.setFormatter(logging.Formatter('%(message)s'))
    logger.addHandler(handler)
  logger.propagate = False   # TensorFlow / absl put a prefixing handler on the root logger
