"""Local and gs:// paths, one way: `etils.epath` (what orbax uses) for files and directories.

Checkpoint readers and writers take either; strings stay strings (a gs:// URL is kept as
given, a local path made absolute) so that messages and `Checkpoint.path` show what the user
passed. Arrays on gs:// are read by tensorstore's own GCS driver (zarr_leaf.py).
"""

import os
import re
from typing import Optional, Tuple

from etils import epath

_GCS = re.compile(r'gs://([^/]+)/?(.*)', re.DOTALL)


def is_url(path) -> bool:
  """True for gs:// (and other scheme://) paths."""
  return '://' in os.fspath(path)


def split_gcs(path) -> Optional[Tuple[str, str]]:
  """'gs://bucket/a/b' -> ('bucket', 'a/b'); None for local paths (and other schemes)."""
  m = _GCS.fullmatch(os.fspath(path))
  return (m.group(1), m.group(2)) if m else None


def absolute(path) -> str:
  """A local path made absolute; a URL without its trailing slash."""
  path = os.fspath(path)
  return path.rstrip('/') if is_url(path) else os.path.abspath(path)


def inside(path, directory) -> bool:
  """Whether local `path` is `directory` or lies below it (both resolved as the caller wants:
  `os.path.realpath` to see through links)."""
  return os.path.commonpath([os.fspath(path), os.fspath(directory)]) == os.fspath(directory)


def fresh(path) -> epath.Path:
  """`path` as an `epath.Path` whose next look at the store is a new one: epath's gs:// backend
  through gcsfs (where TensorFlow is not installed, or EPATH_USE_TF=false) keeps every
  directory listing it has read for the life of the process, so a process that reads a live
  run's MODEL_DIR again (lm_eval's harness, a notebook, a retention check) would see the steps
  of its first look, not those another process wrote or deleted since. The listings of `path`
  and its parents are dropped; tf.io.gfile, epath's gs:// backend with TensorFlow, keeps none."""
  path = epath.Path(path)
  if is_url(path):
    fs = getattr(path._backend, 'fs', None)   # pylint: disable=protected-access
    if fs is not None:
      fs(path).invalidate_cache(os.fspath(path))
  return path


def exists(path) -> bool:
  return fresh(path).exists()


def isdir(path) -> bool:
  return fresh(path).is_dir()


def isfile(path) -> bool:
  return fresh(path).is_file()


def listdir(path) -> list:
  """Names in directory `path` ([] if it does not exist)."""
  path = fresh(path)
  return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
