"""`CheckpointError`: reader errors name the file, the parameter, expected vs found, and the fix."""

from typing import Any, Optional

# How a write onto a full disk fails: tensorstore's status, the OS's words.
FULL_DISK = ('RESOURCE_EXHAUSTED', 'No space left on device')


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as asked. Raised before anything is written."""


def checkpoint_error(source: Any, what: str, *, param: Optional[str] = None,
                     expected: Any = None, found: Any = None,
                     fix: Optional[str] = None) -> CheckpointError:
  """Builds the one message format all readers use.

  `<source>: parameter '<param>': <what>. Expected <expected>, found <found>. <fix>`
  """
  message = f'{source}: '
  if param is not None:
    message += f'parameter {param!r}: '
  message += what.rstrip('.') + '.'
  if expected is not None or found is not None:
    message += f' Expected {expected}, found {found}.'
  if fix:
    message += ' ' + fix.rstrip('.') + '.'
  return CheckpointError(message)
