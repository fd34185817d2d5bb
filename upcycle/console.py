"""What the command-line entry points show: upcycle's log records as plain lines on stdout.

Library code reports through `logging.getLogger(__name__)` (absl-compatible: under
`absl.app` the records reach absl's handler). The entry points call `show_progress()` first,
so a terminal shows upcycle's messages without prefixes, as print would (warnings on stderr),
and other libraries' records only from WARNING on. Not shown: TensorFlow's start-up lines
(oneDNN, CUDA drivers: `tensorflow_banner`) and its later C++ log lines below FATAL
(TF_CPP_MIN_LOG_LEVEL=3, unless the user set another value than the '1' JAX's import sets),
seqio's warning that a function task is read uncached (every task is; the data position is in
the checkpoints), and libtpu's errors off a TPU VM (`platforms.choose`).
"""

import logging
import os
import sys

from upcycle import platforms, tensorflow_banner

# What `import jax` sets TF_CPP_MIN_LOG_LEVEL to where it is unset: taken as unset.
_JAX_DEFAULT = '1'
# seqio's warning for every FunctionDataSource task read with shuffling (the offline tasks).
_UNCACHED_TASK = 'Using an uncached FunctionDataset'


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
  output, as `describe --json`'s). A later call replaces an earlier one's handlers. Also keeps
  TensorFlow's and seqio's noise off the terminal, JAX off libtpu away from a TPU VM
  (module doc) and JAX's persistent compilation cache on (`platforms.cache_compilations`)."""
  platforms.choose()
  platforms.cache_compilations()
  _quiet_tensorflow()
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


def _not_uncached_task_warning(record: logging.LogRecord) -> bool:
  return not str(record.msg).startswith(_UNCACHED_TASK)


def _quiet_tensorflow() -> None:
  """TensorFlow's start-up lines, its C++ log below FATAL (read when TensorFlow loads: the
  entry points load it later, when they read data) and seqio's uncached-task warning are not
  shown."""
  tensorflow_banner.hide()
  if os.environ.get('TF_CPP_MIN_LOG_LEVEL', _JAX_DEFAULT) == _JAX_DEFAULT:
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
  absl_logger = logging.getLogger('absl')
  if _not_uncached_task_warning not in absl_logger.filters:
    absl_logger.addFilter(_not_uncached_task_warning)
