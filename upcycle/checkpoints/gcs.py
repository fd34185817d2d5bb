"""Directories of objects on gs://, through tensorstore's GCS driver: list, copy, delete.

GCS has no directories and no rename. A "directory" `gs://b/d` is the objects whose names start
with `d/` (plus, from some clients, empty placeholder objects ending in `/`); moving it means
copying each object and deleting the originals, one request at a time, so a reader can see it
half-copied or half-deleted. The checkpoint formats say "complete" with a file written last
(`MARKERS`: orbax's `commit_success.txt`, which it writes on GCS in place of its rename, and
T5X's `checkpoint` msgpack, by which T5X lists its steps): `copy_tree` copies those last and
`delete_tree` deletes them first, so a directory never looks complete while it is not.

Object values pass through this process, one object at a time (tensorstore has no server-side
copy): orbax's data files on GCS are up to ~400 MiB, T5X's zarr chunks up to 64 MiB.
"""

from typing import List, Tuple

import tensorstore as ts

from upcycle.checkpoints.paths import split_gcs

MARKERS = ('commit_success.txt', 'checkpoint')


def _bucket(url: str) -> Tuple[ts.KvStore, str]:
  """gs://bucket/a/b -> (the bucket's kvstore, 'a/b')."""
  parts = split_gcs(url)
  if parts is None:
    raise ValueError(f'{url} is not a gs:// URL.')
  bucket, key = parts
  return ts.KvStore.open({'driver': 'gcs', 'bucket': bucket}).result(), key.rstrip('/')


def _keys_starting_with(store: ts.KvStore, prefix: str) -> List[str]:
  """Every key beginning with `prefix` (listed as a key range, checked again here)."""
  end = prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ''
  found = store.list(ts.KvStore.KeyRange(prefix, end)).result()
  return sorted(k for k in (key.decode() for key in found) if k.startswith(prefix))


def names(url: str) -> List[str]:
  """The objects of directory `url`, by name relative to it ('' and 'x/' are placeholders)."""
  store, key = _bucket(url)
  prefix = f'{key}/' if key else ''
  return [k[len(prefix):] for k in _keys_starting_with(store, prefix)]


def names_starting_with(url_prefix: str) -> List[str]:
  """Every object whose gs:// URL starts with `url_prefix`, as full URLs."""
  store, key = _bucket(url_prefix)
  bucket = split_gcs(url_prefix)[0]
  return [f'gs://{bucket}/{k}' for k in _keys_starting_with(store, key)]


def is_object(url: str) -> bool:
  store, key = _bucket(url)
  return bool(key) and store.read(key).result().state == 'value'


def has_content(url: str) -> bool:
  """True if `url` is an object, or a directory holding more than placeholders."""
  return is_object(url) or any(not n.endswith('/') for n in names(url))


def read_bytes(url: str) -> bytes:
  store, key = _bucket(url)
  result = store.read(key).result()
  if result.state != 'value':
    raise FileNotFoundError(f'{url}: no such object.')
  return bytes(result.value)


def write_bytes(url: str, data: bytes) -> None:
  store, key = _bucket(url)
  store.write(key, data).result()


def _is_marker(name: str) -> bool:
  return name.rsplit('/', 1)[-1] in MARKERS


def _markers_deepest_first(relative: List[str]) -> List[str]:
  return sorted((n for n in relative if _is_marker(n)), key=lambda n: (-n.count('/'), n))


def copy_tree(src: str, dst: str) -> int:
  """Copies every object of directory `src` to the same name under `dst`, the `MARKERS` last
  (the deepest first, so a step's own marker comes after its items'). Returns the count."""
  store, src_key = _bucket(src)
  dst_store, dst_key = _bucket(dst)
  relative = names(src)
  markers = _markers_deepest_first(relative)
  for name in [n for n in relative if not _is_marker(n)] + markers:
    value = store.read(f'{src_key}/{name}').result()
    if value.state != 'value':
      raise FileNotFoundError(f'{src}/{name} vanished while {src} was being copied to {dst}.')
    dst_store.write(f'{dst_key}/{name}', value.value).result()
  return len(relative)


def delete_tree(url: str) -> None:
  """Deletes the object `url` and every object of directory `url`, the `MARKERS` first."""
  store, key = _bucket(url)
  if not key:
    raise ValueError(f'{url} is a whole bucket; delete_tree deletes directories only.')
  relative = names(url)
  markers = _markers_deepest_first(relative)
  for name in markers + [n for n in relative if n not in markers]:
    store.write(f'{key}/{name}', None).result()
  store.write(key, None).result()
