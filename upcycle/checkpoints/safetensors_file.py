"""A minimal safetensors reader: memory-mapped, lazy, bfloat16 and float8 included.

File layout: 8 bytes little-endian header length n, n bytes of JSON header
`{name: {'dtype': 'F32', 'shape': [...], 'data_offsets': [begin, end]}, '__metadata__': {...}}`,
then the raw little-endian C-order data; offsets are relative to the end of the header.
"""

import json
import os
import struct
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'F8_E4M3': ml_dtypes.float8_e4m3fn, 'F8_E5M2': ml_dtypes.float8_e5m2,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8,
    'U64': np.uint64, 'U32': np.uint32, 'U16': np.uint16, 'U8': np.uint8, 'BOOL': np.bool_,
}
_MAX_HEADER_BYTES = 100 * 2**20


def read_header(path: str) -> Tuple[dict, int]:
  """-> (the JSON header, the byte offset where tensor data starts)."""
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise checkpoint_error(path, 'not a safetensors file: shorter than its 8-byte header length',
                             expected='>= 8 bytes', found=f'{size} bytes',
                             fix='Re-download or re-save the file')
    (length,) = struct.unpack('<Q', prefix)
    if length > min(size - 8, _MAX_HEADER_BYTES):
      raise checkpoint_error(path, 'safetensors header length is impossible (truncated file?)',
                             expected=f'<= {size - 8} bytes', found=f'{length} bytes',
                             fix='Re-download or re-save the file')
    try:
      header = json.loads(f.read(length))
    except ValueError as e:
      raise checkpoint_error(path, f'safetensors header is not JSON ({e})',
                             fix='Re-download or re-save the file') from e
  return header, 8 + length


def load(path: str) -> Dict[str, LazyArray]:
  """Maps every tensor of a .safetensors file without reading it: name -> LazyArray.

  The file is memory-mapped once; each leaf is a view that the OS pages in when read.
  """
  path = os.fspath(path)
  header, start = read_header(path)
  header.pop('__metadata__', None)
  data_bytes = os.path.getsize(path) - start
  mapped = (np.memmap(path, dtype=np.uint8, mode='r', offset=start, shape=(data_bytes,))
            if data_bytes else np.zeros((0,), np.uint8))
  tensors = {}
  for name, info in header.items():
    if info.get('dtype') not in DTYPES:
      raise checkpoint_error(path, 'unsupported safetensors dtype', param=name,
                             expected=f'one of {sorted(DTYPES)}', found=info.get('dtype'),
                             fix='Convert the tensor to a supported dtype')
    dtype = np.dtype(DTYPES[info['dtype']])
    shape = tuple(info['shape'])
    begin, end = info['data_offsets']
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != want or begin < 0 or end > data_bytes:
      raise checkpoint_error(
          path, 'tensor data does not fit the file (truncated or corrupt)', param=name,
          expected=f'{want} bytes for {shape} {dtype} within {data_bytes} data bytes',
          found=f'data_offsets [{begin}, {end}]', fix='Re-download or re-save the file')
    read = (lambda b=begin, e=end, d=dtype, s=shape: mapped[b:e].view(d).reshape(s))
    tensors[name] = LazyArray(shape, dtype, read, path, name)
  return tensors
