"""`SourceError`: a task whose data cannot be read, said with the task, what it reads and where.

The task usually comes from a gin macro that the last gin file setting it decides
(`MIXTURE_OR_TASK_NAME`: runs/ files set C4, data/ files the offline task), so a run that
silently got C4 is told so, with the offline task as the way out, instead of a TFDS or import
error about something it never asked for. Importing this module imports no TensorFlow (the
entry point names `SourceError` before any data is read).

How to prepare a TFDS dataset depends on what the pinned TFDS can do with it: a version it
only reads (C4 2.2.0) is copied in; one built with Apache Beam (C4 3.1.0) is built where Beam
is installed (it does not install beside the pinned TensorFlow and protobuf); any other is
built in place by `download_and_prepare` (the `tfds` command itself needs Beam).
"""

import os
from typing import Any, Optional, Tuple

from upcycle import fields


class SourceError(fields.ConfigError):
  """A seqio task's source failed to load: the task or data dir the configuration names
  (MIXTURE_OR_TASK_NAME, --tfds_data_dir) has no data, so every entry point ends it in one
  line, as it does a bad config value."""


def _prepare(builder: Any, name: str, data_dir: str, module: Optional[str]) -> str:
  """How to prepare TFDS `name` (its `builder`, which importing `module` may define) in
  `data_dir`, in words."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  buildable = sorted({str(builder.canonical_version), str(max(builder.versions))})
  if str(builder.version) not in buildable:
    return (f'the pinned TFDS {tfds.__version__} reads {name} but builds only version(s) '
            f'{", ".join(buildable)}: copy a prepared {name} into {data_dir}')
  if isinstance(builder, tfds.core.BeamBasedBuilder):
    return (f'it is built with Apache Beam (`tfds build {name} --data_dir={data_dir}` where '
            f'apache-beam and TFDS\'s extras for {builder.name} are installed; C4 downloads '
            f'~7 TB of Common Crawl)')
  imports = f'tensorflow_datasets as tfds, {module}' if module else 'tensorflow_datasets as tfds'
  return (f'prepare it there (python -c "import {imports}; '
          f"tfds.builder('{name}', data_dir='{data_dir}').download_and_prepare()\")")


def _tfds(source: Any, module: Optional[str]) -> Tuple[str, str]:
  """(what a seqio.TfdsDataSource reads, in words; how to prepare it)."""
  loader = source.tfds_dataset
  data_dir = loader.data_dir or os.environ.get(
      'TFDS_DATA_DIR', os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))
  try:
    prepare = _prepare(loader.builder, loader.name, data_dir, module)
  except Exception:  # pylint: disable=broad-except  (no builder of that name: nothing to build)
    prepare = f'prepare {loader.name} in {data_dir}'
  return (f'TFDS {loader.name} from TFDS_DATA_DIR={data_dir}',
          f'{prepare}, or pass --tfds_data_dir=<where it is prepared>')


def source_error(name: str, task: Any, error: BaseException,
                 module: Optional[str] = None) -> SourceError:
  """The error for seqio task `name` (registered by importing `module`, if any), whose source
  raised `error` when its dataset was built."""
  import seqio  # pylint: disable=g-import-not-at-top
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top
  if isinstance(task.source, seqio.TfdsDataSource):
    reads, prepare = _tfds(task.source, module)
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
