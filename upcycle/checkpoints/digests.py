"""A CRC-32 of every array shard a training step saves, so that changed bytes are found.

Orbax's OCDBT files guard their manifest and B-tree with CRC-32C, but store array chunks
(zstd frames without a content checksum, raw blocks where the data does not compress)
unchecked: a flipped bit in a data file mostly reads back as other numbers, silently. So at
save every process records the CRC-32 of the shards it holds the first replica of (each
shard once over a pod) in its own file of the step's `digests/` item, which orbax writes with
the other items, before it renames the step into place:

  digests/process_<i>.json = {"format": 1, "algorithm": "crc32", "process_count": N,
    "items": {"params": {"decoder/layers_0/mlp/wi_0/kernel":
                            {"dtype": "float32", "shards": {"0:32,0:64": 3735928559}}}, ...}}

A shard is named by its index, `start:stop` per axis. The data position (the `dataset/` item,
JSON) is recorded in process 0's file as the item `dataset` with one entry, `metadata`, of
dtype 'json': the CRC of its canonical JSON (`json_crc`).

The outputs of `convert` and `export` record what they wrote the same way, in
`<output>/digests/process_0.json` (one process): a T5X `checkpoint_<step>/` keys its arrays by
their path in the tree its reader returns (items `params` and `optimizer_state`, T5X's
`state`), a HuggingFace directory by tensor name (item `params`), each array whole
(`whole`, `recording`, `write`).

Every reader checks what it reads against them (`verify.check`: eval, infer, export, convert,
the restore hooks; resume and `describe --verify` too); `--no_verify` (the hooks'
`verify=False`) skips that.
"""

import json
import os
import zlib
from typing import Any, Dict, Iterator, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from upcycle.checkpoints import gcs, paths
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

DIGESTS = 'digests'
FORMAT = 1
DATASET, METADATA, JSON = 'dataset', 'metadata', 'json'   # the data position's entry


def filename(process: int) -> str:
  return f'process_{process}.json'


def shard_key(index: Tuple[slice, ...], shape: Tuple[int, ...]) -> str:
  """'0:32,0:64': the block `index` selects of an array of `shape` ('' for a scalar)."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return ','.join('%d:%d' % s.indices(n)[:2] for s, n in zip(index, shape))


def _index(key: str) -> Tuple[slice, ...]:
  return tuple(slice(*map(int, part.split(':'))) for part in key.split(',') if part)


def crc(array: np.ndarray) -> int:
  """CRC-32 of the array's bytes in C order."""
  return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _named_leaves(tree: Any) -> Iterator[Tuple[str, Any]]:
  """(path, leaf), the path being orbax's stored name with '/' for '.'."""
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield '/'.join(ocp.tree.str_keypath(keypath)), leaf


def _own_shards(leaf: Any) -> Iterator[Tuple[str, np.ndarray]]:
  """(shard key, host data) of the shards of `leaf` whose first replica this process holds; a
  host value is process 0's, whole."""
  if isinstance(leaf, jax.Array):
    for shard in leaf.addressable_shards:
      if shard.replica_id == 0:
        yield shard_key(shard.index, leaf.shape), np.asarray(shard.data)
  elif jax.process_index() == 0:
    array = np.asarray(leaf)
    yield shard_key((), array.shape), array


def json_crc(value: Any) -> int:
  """CRC-32 of `value`'s canonical JSON (sorted keys, no spaces): what a JSON item's digest is
  of, whatever spacing its writer used."""
  return zlib.crc32(json.dumps(value, sort_keys=True, separators=(',', ':')).encode())


def record(items: Dict[str, Any], dataset: Optional[dict] = None) -> Dict[str, Any]:
  """This process's record of `items` ({item name: tree of arrays}), ready for JSON; with the
  data position `dataset` (the `dataset/` item), process 0 records its digest too."""
  recorded = {}
  for item, tree in items.items():
    arrays = {}
    for path, leaf in _named_leaves(tree):
      shards = {key: crc(data) for key, data in _own_shards(leaf)}
      if shards:
        arrays[path] = {'dtype': str(np.dtype(leaf.dtype)), 'shards': shards}
    recorded[item] = arrays
  if dataset is not None and jax.process_index() == 0:
    recorded[DATASET] = {METADATA: {'dtype': JSON, 'shards': {'': json_crc(dataset)}}}
  return {'format': FORMAT, 'algorithm': 'crc32', 'process_count': jax.process_count(),
          'items': recorded}


def read(step_dir: str) -> Optional[Dict[str, Dict[str, Any]]]:
  """{item: {path: {'dtype', 'shards'}}} merged over the processes' files; None when the step
  has no digests (saved before they were recorded).

  Raises CheckpointError when a process's file is missing or unreadable (damage).
  """
  directory = os.path.join(step_dir, DIGESTS)
  if not paths.isdir(directory):
    return None
  merged: Dict[str, Dict[str, Any]] = {}
  count, process = 1, 0
  while process < count:
    path = os.path.join(directory, filename(process))
    try:
      one = json.loads(epath.Path(path).read_text())
      count = int(one['process_count'])
      items = one['items']
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise checkpoint_error(path, f'the digest file is missing or unreadable ({e})',
                             fix='The checkpoint copy is incomplete or corrupt') from e
    for item, arrays in items.items():
      for array, entry in arrays.items():
        merged.setdefault(item, {}).setdefault(
            array, {'dtype': entry['dtype'], 'shards': {}})['shards'].update(entry['shards'])
    process += 1
  return merged


def _differs(source: str, path: str, key: str, got: int, saved: int) -> str:
  return (f"{source}: parameter '{path}'" + (f' (shard {key})' if key else '') +
          f': its bytes differ from the digest recorded when the step was saved (crc32 '
          f'{got:08x}, saved {saved:08x}); the data changed on disk')


def check_array(entry: Optional[Dict[str, Any]], array: np.ndarray, source: str,
                path: str) -> Optional[str]:
  """Why the host `array` is not the one saved (the first shard whose CRC differs); None if
  every recorded shard matches, or none is recorded, or the dtype was changed on reading."""
  if entry is None or entry['dtype'] != str(array.dtype):
    return None
  for key, saved in entry['shards'].items():
    got = crc(array[_index(key)])
    if got != saved:
      return _differs(source, path, key, got, saved)
  return None


def check_tree(arrays: Dict[str, Any], tree: Any, source: str) -> Optional[str]:
  """Why the restored `tree` is not the one saved, given its item's recorded `arrays`: the
  first shard this process holds (first replica) whose CRC differs; None if all match.

  Shards of another layout than the saved one (a resharded restore) are not checked.
  """
  for path, leaf in _named_leaves(tree):
    entry = arrays.get(path)
    if entry is None or entry['dtype'] != str(np.dtype(leaf.dtype)):
      continue
    if not isinstance(leaf, jax.Array):
      reason = check_array(entry, np.asarray(leaf), source, path)
      if reason:
        return reason
      continue
    for shard in leaf.addressable_shards:
      key = shard_key(shard.index, leaf.shape)
      if shard.replica_id == 0 and key in entry['shards']:
        got = crc(np.asarray(shard.data))
        if got != entry['shards'][key]:
          return _differs(source, path, key, got, entry['shards'][key])
  return None


def check_json(recorded: Dict[str, Any], value: Any, source: str) -> Optional[str]:
  """Why the data position `value` read from `source` is not the one saved, given the step's
  `recorded` digests; None if it matches or none was recorded."""
  entry = recorded.get(DATASET, {}).get(METADATA)
  if entry is None:
    return None
  got, saved = json_crc(value), entry['shards']['']
  if got == saved:
    return None
  return (f'{source}: the data position differs from the digest recorded when the step was '
          f'saved (crc32 {got:08x}, saved {saved:08x}); the data changed on disk')


def whole(array: np.ndarray) -> Dict[str, Any]:
  """The entry of an array written whole: its dtype and the CRC of its one shard."""
  array = np.asarray(array)
  return {'dtype': str(array.dtype), 'shards': {shard_key((), array.shape): crc(array)}}


def recording(leaves: Dict[str, Any], sink: Dict[str, Any]) -> Dict[str, LazyArray]:
  """`leaves` ({name: array or LazyArray}) as LazyArrays that, when a writer reads one whole,
  put its entry (`whole`) into `sink[name]`: the digests of exactly what was written."""

  def read(name: str, leaf: Any) -> np.ndarray:
    array = np.asarray(leaf)
    sink[name] = whole(array)
    return array

  return {name: LazyArray(np.shape(leaf), leaf.dtype,
                          lambda name=name, leaf=leaf: read(name, leaf),
                          getattr(leaf, 'source', ''), name)
          for name, leaf in leaves.items()}


def write(directory: str, items: Dict[str, Dict[str, Any]]) -> None:
  """Writes `directory/digests/process_0.json`, the record of a one-process writer (convert,
  export): `items` is {item: {name: entry}}, local or gs://."""
  data = json.dumps({'format': FORMAT, 'algorithm': 'crc32', 'process_count': 1,
                     'items': items}).encode()
  path = os.path.join(directory, DIGESTS, filename(0))
  if paths.is_url(directory):
    gcs.write_bytes(path, data)
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(data)
