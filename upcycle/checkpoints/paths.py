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


def isdir(path) -> bool:
  return epath.Path(path).is_dir()


def isfile(path) -> bool:
  return epath.Path(path).is_file()


def listdir(path) -> list:
  """Names in directory `path` ([] if it does not exist)."""
  path = epath.Path(path)
  return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
