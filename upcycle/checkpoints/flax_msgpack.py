"""Decoding flax's msgpack serialization (T5X's `checkpoint` file, flax checkpoints).

Flax writes a msgpack map whose array leaves are ext types:
  code 1: ndarray, itself msgpack `(shape, dtype_name, raw C-order bytes)`;
  code 2: Python complex, msgpack `(real, imag)`;
  code 3: numpy scalar, packed like an ndarray of shape ().
Arrays over flax's MAX_CHUNK_SIZE (2**30 bytes) become
`{'__msgpack_chunked_array__': True, 'shape': {'0': d0, ...}, 'chunks': {'0': flat0, ...}}`:
the flattened array cut into 1-D pieces, keys the decimal indices.
"""

from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from upcycle.checkpoints.errors import checkpoint_error

_NDARRAY, _COMPLEX, _SCALAR = 1, 2, 3
CHUNKED = '__msgpack_chunked_array__'


def dtype_from_name(name: str) -> np.dtype:
  """numpy dtype from a numpy or ml_dtypes name ('float32', 'bfloat16', 'float8_e4m3fn')."""
  if hasattr(ml_dtypes, name):
    return np.dtype(getattr(ml_dtypes, name))
  return np.dtype(name)


def _ndarray(data: bytes) -> np.ndarray:
  shape, dtype_name, buffer = msgpack.unpackb(data, raw=True)
  if isinstance(dtype_name, bytes):
    dtype_name = dtype_name.decode()
  return np.frombuffer(buffer, dtype=dtype_from_name(dtype_name)).reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
  if code == _NDARRAY:
    return _ndarray(data)
  if code == _SCALAR:
    return _ndarray(data)[()]
  if code == _COMPLEX:
    real, imag = msgpack.unpackb(data)
    return complex(real, imag)
  return msgpack.ExtType(code, data)


def _indexed(d: dict) -> list:
  return [d[str(i)] for i in range(len(d))]


def _unchunk(tree: Any) -> Any:
  """Replaces every chunked-array dict by the array it stands for."""
  if not isinstance(tree, dict):
    return tree
  if tree.get(CHUNKED):
    shape = tuple(int(d) for d in _indexed(tree['shape']))
    return np.concatenate([np.ravel(c) for c in _indexed(tree['chunks'])]).reshape(shape)
  return {k: _unchunk(v) for k, v in tree.items()}


def restore(data: bytes, source: str) -> Any:
  """msgpack bytes -> nested dicts with numpy leaves (and whatever else was stored)."""
  try:
    tree = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
  except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, StackError.
    raise checkpoint_error(
        source, f'not a readable msgpack file ({type(e).__name__}: {e})',
        expected='a complete flax/T5X msgpack checkpoint', found=f'{len(data)} bytes',
        fix='The file is truncated or corrupt; copy it again from its source') from e
  if not isinstance(tree, dict):
    raise checkpoint_error(source, 'msgpack content is not a map', expected='dict',
                           found=type(tree).__name__)
  try:
    return _unchunk(tree)
  except (KeyError, ValueError, TypeError) as e:
    raise checkpoint_error(source, f'malformed {CHUNKED} entry ({e})',
                           fix='The file is corrupt; copy it again from its source') from e
