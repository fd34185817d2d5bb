"""The gs:// paths a run is configured with are reached once at start, in bounded time.

Without credentials, with a misspelt bucket or no route to GCS, the storage clients retry
silently for minutes at the first read or write. The entry points instead ask each bucket the
configuration names whether it exists (through `etils.epath`, as everything else does), waiting
at most UPCYCLE_GCS_TIMEOUT_SECONDS (default 30), and stop with one line naming the binding,
the path and what to do.
"""

import logging
import os
import sys
import threading
from typing import Any, Callable, Dict, Mapping, Optional

TIMEOUT_ENV = 'UPCYCLE_GCS_TIMEOUT_SECONDS'
TIMEOUT_SECONDS = 30.0
CREDENTIALS = ('credentials: `gcloud auth application-default login` here, or on a VM a service '
               'account that may read and write the bucket')


def gin_paths() -> Dict[str, str]:
  """{binding: path} of every gs:// string the parsed gin configuration binds."""
  import gin  # pylint: disable=g-import-not-at-top
  found = {}
  config = gin.config._CONFIG  # pylint: disable=protected-access
  for (scope, selector), parameters in config.items():
    for name, value in parameters.items():
      if isinstance(value, str) and value.startswith('gs://'):
        binding = (scope if selector == 'gin.macro' else
                   '/'.join(filter(None, (scope, f'{selector}.{name}'))))
        found[binding] = value
  return found


def _within(seconds: float, fn: Callable[[], Any]) -> Dict[str, Any]:
  """{'value': fn()}, {'error': what it raised}, or {} when it did not return in time."""
  outcome: Dict[str, Any] = {}

  def call():
    try:
      outcome['value'] = fn()
    except Exception as e:  # pylint: disable=broad-except  (reported by the caller)
      outcome['error'] = e

  thread = threading.Thread(target=call, daemon=True)   # left behind if GCS never answers
  thread.start()
  thread.join(seconds)
  return outcome


def check(paths: Mapping[str, str], timeout: Optional[float] = None) -> None:
  """Stops (SystemExit, one line) unless every bucket of `paths` ({binding: gs:// path})
  answers that it exists within `timeout` seconds (None: UPCYCLE_GCS_TIMEOUT_SECONDS)."""
  found = problem(paths, timeout)
  if found:
    raise SystemExit(found)


def refused(paths: Mapping[str, Optional[str]]) -> bool:
  """Whether `problem(paths)` finds an unreachable bucket, which is then printed on stderr as
  `error: <reason>` (for command-line tools, which return their exit status)."""
  found = problem(paths)
  if found:
    print(f'error: {found}', file=sys.stderr)
  return bool(found)


def problem(paths: Mapping[str, Optional[str]], timeout: Optional[float] = None) -> Optional[str]:
  """The one-line reason the first unreachable bucket of the gs:// ones of `paths` ({binding
  or flag: path}; other paths are skipped) fails, or None when every one answers in time."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  if timeout is None:
    timeout = float(os.environ.get(TIMEOUT_ENV, TIMEOUT_SECONDS))
  checked = set()
  for binding, path in paths.items():
    if not str(path or '').startswith('gs://'):
      continue
    bucket = 'gs://' + path[len('gs://'):].split('/', 1)[0]
    if bucket in checked:
      continue
    checked.add(bucket)
    gcsfs_log = logging.getLogger('gcsfs')
    level = gcsfs_log.level
    gcsfs_log.setLevel(logging.ERROR)   # its retries' warnings: the outcome is reported below
    try:
      outcome = _within(timeout, epath.Path(bucket).exists)
    finally:
      gcsfs_log.setLevel(level)
    where = f'{binding}={path}'
    if not outcome:
      return (f'{where}: {bucket} did not answer within {timeout:.0f} s; check the '
              f'network and the {CREDENTIALS} ({TIMEOUT_ENV} sets the wait).')
    if 'error' in outcome:
      error = (str(outcome['error']).strip().splitlines() or [type(outcome['error']).__name__])[0]
      return f'{where}: cannot reach {bucket} ({error}); check the {CREDENTIALS}.'
    if not outcome['value']:
      return (f'{where}: the bucket {bucket} does not exist or these credentials cannot '
              'see it; check its name and that the account may read and write it.')
  return None
