"""Lazy leaves stored as zarr arrays through tensorstore (T5X partitioned leaves, orbax).

A T5X spec looks like `{'driver': 'zarr', 'dtype': 'bfloat16', 'kvstore': {'driver':
'file' | 'gfile' | 'gcs', 'path': 'target.encoder.layers_0.mlp.wi_0.kernel'}, 'metadata':
{'shape': [...], 'chunks': [...], 'compressor': {'id': 'gzip' | 'zstd', ...}}}` with the path
relative to the checkpoint directory (older gcs specs put `path` beside `kvstore`).
Reading maps the path onto the checkpoint's own location, as T5X does: the local
filesystem for a local directory whatever driver wrote it, the `gcs` driver (with the
directory's bucket) for a `gs://` one.
"""

import os
from typing import Any, Dict, Optional, Tuple

import numpy as np
import tensorstore as ts

from upcycle.checkpoints import ocdbt_files, paths
from upcycle.checkpoints.errors import CheckpointError, checkpoint_error
from upcycle.checkpoints.flax_msgpack import dtype_from_name
from upcycle.checkpoints.lazy import LazyArray

_DRIVERS = ('file', 'gfile', 'gcs')


def is_spec(x: Any) -> bool:
  """True for the dicts T5X writes in place of a partitioned leaf."""
  return isinstance(x, dict) and 'driver' in x and 'kvstore' in x


def kvstore_for(checkpoint_dir: str, relative: str) -> Dict[str, Any]:
  """The kvstore of a leaf stored at `relative` under `checkpoint_dir` (local or gs://)."""
  relative = relative.rstrip('/') + '/'
  gcs = paths.split_gcs(checkpoint_dir)
  if gcs:
    bucket, base = gcs
    return {'driver': 'gcs', 'bucket': bucket, 'path': f'{base.rstrip("/")}/{relative}'.lstrip('/')}
  return {'driver': 'file', 'path': os.path.join(os.fspath(checkpoint_dir), relative)}


def from_t5x_spec(spec: Dict[str, Any], checkpoint_dir: str, param: str, source: str) -> LazyArray:
  """A T5X tensorstore spec dict -> LazyArray read from `checkpoint_dir`."""
  kvstore = spec['kvstore']
  relative = kvstore.get('path', spec.get('path'))
  metadata = dict(spec.get('metadata') or {})
  if spec.get('driver') != 'zarr' or kvstore.get('driver') not in _DRIVERS or not relative:
    raise checkpoint_error(
        source, 'unsupported tensorstore spec', param=param,
        expected=f"driver 'zarr', kvstore driver in {_DRIVERS} with a path",
        found={k: spec.get(k) for k in ('driver', 'kvstore', 'path')})
  dtype_name = spec.get('dtype') or metadata.get('dtype')
  if 'shape' not in metadata or not dtype_name:
    raise checkpoint_error(source, 'tensorstore spec has no shape or dtype', param=param,
                           expected="metadata.shape and dtype", found=spec)
  dtype = dtype_from_name(dtype_name)
  return zarr_array(kvstore_for(checkpoint_dir, relative), tuple(metadata['shape']), dtype,
                    param, source, metadata=metadata)


def zarr_array(kvstore: Dict[str, Any], shape: Tuple[int, ...], dtype: np.dtype, param: str,
               source: str, metadata: Optional[Dict[str, Any]] = None,
               driver: str = 'zarr') -> LazyArray:
  """A lazy zarr array; `metadata` stands in for a missing `.zarray` (assume_metadata)."""
  read = lambda index=None: _read(kvstore, shape, dtype, param, source, metadata, driver, index)
  return LazyArray(shape, dtype, read, source, param, read_block=read)


def _location(kvstore: Dict[str, Any]) -> str:
  if kvstore['driver'] == 'gcs':
    return f"gs://{kvstore['bucket']}/{kvstore['path']}"
  if kvstore['driver'] == 'ocdbt':
    return f"{kvstore['base']} (ocdbt key {kvstore['path']})"
  return kvstore['path']


def _has_zarray(kvstore: Dict[str, Any]) -> bool:
  store = ts.KvStore.open(kvstore).result()
  return store.read('.zarray').result().state == 'value'


def _read(kvstore, shape, dtype, param, source, metadata, driver, index=None) -> np.ndarray:
  """Opens the array (from its .zarray, else from the spec's metadata) and reads [index]."""
  # Checkpoints are immutable once written: no revalidation reads (as orbax reads them).
  spec = {'driver': driver, 'kvstore': kvstore, 'fill_missing_data_reads': False,
          'recheck_cached_data': False, 'recheck_cached_metadata': False}
  where = _location(kvstore)
  try:
    if driver == 'zarr' and metadata is not None and not _has_zarray(kvstore):
      if 'chunks' not in metadata:
        raise checkpoint_error(
            source, f'{where} has no .zarray and the spec does not say how it is chunked',
            param=param, expected='metadata.chunks in the spec', found=metadata,
            fix='Copy the .zarray file of this array from the source checkpoint')
      spec['metadata'] = {**metadata, 'dtype': metadata.get('dtype', _zarr_dtype(dtype))}
      store = ts.open(spec, open=True, assume_metadata=True).result()
    else:
      store = ts.open(spec, open=True).result()
    array = (store if index is None else store[index]).read().result()
  except CheckpointError:
    raise
  except ValueError as e:  # tensorstore reports every failure as ValueError.
    missing = 'is missing' in str(e) or 'NOT_FOUND' in str(e)
    what = 'a zarr chunk or array file is missing' if missing else 'the zarr array cannot be read'
    if kvstore['driver'] == 'ocdbt' and kvstore['base'].startswith('file://'):
      what += f": {ocdbt_files.damage(kvstore['base'][len('file://'):], kvstore['path'])}"
    raise checkpoint_error(
        source, what + f' (under {where})', param=param,
        expected=f'{shape} {dtype}', found=str(e).split(' [')[0],
        fix=f'The checkpoint copy is incomplete or corrupt; copy {where} again from the source'
        ) from e
  if (index is None and tuple(array.shape) != tuple(shape)) or array.dtype != dtype:
    raise checkpoint_error(source, f'zarr array at {where} disagrees with its spec', param=param,
                           expected=f'{shape} {dtype}', found=f'{array.shape} {array.dtype}',
                           fix='The checkpoint is inconsistent; re-export it')
  return array


def _zarr_dtype(dtype: np.dtype) -> str:
  """Zarr v2 dtype string; tensorstore spells bfloat16 'bfloat16'."""
  return 'bfloat16' if dtype.name == 'bfloat16' else dtype.str
