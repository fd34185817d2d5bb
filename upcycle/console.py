"""What the command-line entry points show: upcycle's log records as plain lines on stdout.

Library code reports through `logging.getLogger(__name__)` (absl-compatible: under
`absl.app` the records reach absl's handler). The entry points call `show_progress()`, so a
terminal shows upcycle's INFO messages without prefixes, as print would, and other libraries'
records only from WARNING on.
"""

import logging
import sys


class _CurrentStdout(logging.StreamHandler):
  """Writes to whatever `sys.stdout` is when a record arrives (pytest and notebooks swap it)."""

  @property
  def stream(self):
    return sys.stdout

  @stream.setter
  def stream(self, value):
    del value


def show_progress(level: int = logging.INFO) -> None:
  """Sends the `upcycle` loggers' records at `level` and above to stdout, once per process."""
  logger = logging.getLogger('upcycle')
  logger.setLevel(level)
  if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
    handler = _CurrentStdout()
    handler.setFormatter(logging.Formatter('%(message)s'))
    logger.addHandler(handler)
    logger.propagate = False   # TensorFlow / absl put a prefixing handler on the root logger
