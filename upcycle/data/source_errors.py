"""`SourceError`: a task whose data cannot be read, said with the task, what it reads and where.

The task usually comes from a gin macro that the last gin file setting it decides
(`MIXTURE_OR_TASK_NAME`: runs/ files set C4, data/ files the offline task), so a run that
silently got C4 is told so, with the offline task as the way out, instead of a TFDS or import
error about something it never asked for. Importing this module imports no TensorFlow (the
entry point names `SourceError` before any data is read).
"""

import os
from typing import Any, Tuple


class SourceError(RuntimeError):
  """A seqio task's source failed to load."""


def _tfds(source: Any) -> Tuple[str, str]:
  """(what a seqio.TfdsDataSource reads, in words; how to prepare it)."""
  loader = source.tfds_dataset
  data_dir = loader.data_dir or os.environ.get(
      'TFDS_DATA_DIR', os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))
  return (f'TFDS {loader.name} from TFDS_DATA_DIR={data_dir}',
          f'prepare it there (tfds build {loader.name} --data_dir={data_dir}) or pass '
          f'--tfds_data_dir=<where it is prepared>')


def source_error(name: str, task: Any, error: BaseException) -> SourceError:
  """The error for seqio task `name`, whose source raised `error` when its dataset was built."""
  import seqio  # pylint: disable=g-import-not-at-top
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top
  if isinstance(task.source, seqio.TfdsDataSource):
    reads, prepare = _tfds(task.source)
  else:
    reads, prepare = str(task.source), 'check that source'
  lines = str(error).strip().splitlines()
  cause = f'{type(error).__name__}: {lines[-1]}' if lines else type(error).__name__
  return SourceError(
      f'task {name} reads {reads}, which failed to load ({cause}). Fix: {prepare}; or use the '
      f"offline task '{tasks.OFFLINE_TASK}' "
      f'(--gin.MIXTURE_OR_TASK_NAME="\'{tasks.OFFLINE_TASK}\'", or '
      f'--gin_file=data/offline_span_corruption.gin after the runs/ file: the last gin file '
      f'that sets MIXTURE_OR_TASK_NAME decides the task).')
