"""A minimal safetensors reader and writer: memory-mapped, lazy, bfloat16 and float8 included.

Local files are memory-mapped; a file on gs:// is read by ranged reads (etils.epath through
gcsfs), the header once and each tensor's bytes when the tensor is read.

File layout: 8 bytes little-endian header length n, n bytes of JSON header
`{name: {'dtype': 'F32', 'shape': [...], 'data_offsets': [begin, end]}, '__metadata__': {...}}`,
then the raw little-endian C-order data; offsets are relative to the end of the header.
`write` pads the header with spaces to a multiple of 8 bytes, as the safetensors library does.
"""

import json
import os
import struct
from typing import Any, Dict, Mapping, Optional, Tuple

from etils import epath
import ml_dtypes
import numpy as np

from upcycle import progress
from upcycle.checkpoints import paths
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'F8_E4M3': ml_dtypes.float8_e4m3fn, 'F8_E5M2': ml_dtypes.float8_e5m2,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8,
    'U64': np.uint64, 'U32': np.uint32, 'U16': np.uint16, 'U8': np.uint8, 'BOOL': np.bool_,
}
DTYPE_NAMES = {np.dtype(dtype): name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20


def _size(path: str) -> int:
  return epath.Path(path).stat().length if paths.is_url(path) else os.path.getsize(path)


class _RangedObject:
  """The data bytes of a remote file, read range by range (`obj[begin:end]`, as a memmap)."""

  def __init__(self, path: str, start: int):
    self.path, self.start = path, start

  def __getitem__(self, key: slice) -> np.ndarray:
    with epath.Path(self.path).open('rb') as f:
      f.seek(self.start + key.start)
      data = f.read(key.stop - key.start)
    if len(data) != key.stop - key.start:
      raise checkpoint_error(self.path, 'the object is shorter than its header says (changed '
                             'while being read?)', expected=f'{key.stop - key.start} bytes',
                             found=f'{len(data)} bytes', fix='Re-upload the file')
    return np.frombuffer(data, np.uint8)


def read_header(path: str) -> Tuple[dict, int]:
  """-> (the JSON header, the byte offset where tensor data starts)."""
  size = _size(path)
  with epath.Path(path).open('rb') if paths.is_url(path) else open(path, 'rb') as f:
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

  A local file is memory-mapped once; each leaf is a view that the OS pages in when read. A
  gs:// object is read tensor by tensor, each leaf's bytes by one ranged read.
  """
  path = os.fspath(path)
  header, start = read_header(path)
  header.pop('__metadata__', None)
  data_bytes = _size(path) - start
  if paths.is_url(path):
    mapped = _RangedObject(path, start)
  else:
    mapped = (np.memmap(path, dtype=np.uint8, mode='r', offset=start, shape=(data_bytes,))
              if data_bytes else np.zeros((0,), np.uint8))
  tensors = {}
  for name, (dtype, shape, (begin, end)) in _entries(path, header, data_bytes).items():
    read = (lambda b=begin, e=end, d=dtype, s=shape: mapped[b:e].view(d).reshape(s))
    tensors[name] = LazyArray(shape, dtype, read, path, name)
  return tensors


def _entries(path: str, header: Mapping[str, Any], data_bytes: int
             ) -> Dict[str, Tuple[np.dtype, Tuple[int, ...], Tuple[int, int]]]:
  """The header's tensors checked as the safetensors library checks them: name -> (dtype,
  shape, (begin, end)), each range `prod(shape) * itemsize` bytes within the `data_bytes`
  data bytes, no two sharing a byte (one tensor given another's offsets would read its
  values); unused bytes, which the library also refuses, are accepted. A violation raises one
  line naming the file and the tensor."""
  entries = {}
  for name, info in header.items():
    if not isinstance(info, dict) or info.get('dtype') not in DTYPES:
      raise checkpoint_error(path, 'unsupported safetensors dtype', param=name,
                             expected=f'one of {sorted(DTYPES)}',
                             found=info.get('dtype') if isinstance(info, dict) else info,
                             fix='Convert the tensor to a supported dtype')
    dtype = np.dtype(DTYPES[info['dtype']])
    shape, offsets = info.get('shape'), info.get('data_offsets')
    well_formed = all(isinstance(x, list) and all(isinstance(i, int) and i >= 0 for i in x)
                      for x in (shape, offsets)) and len(offsets) == 2
    shape = tuple(shape) if well_formed else ()
    begin, end = offsets if well_formed else (0, -1)
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != want or end > data_bytes:
      raise checkpoint_error(
          path, 'tensor data does not fit the file (truncated or corrupt)', param=name,
          expected=f'{want} bytes for shape {info.get("shape")} {dtype} within {data_bytes} data '
                   'bytes',
          found=f'data_offsets {info.get("data_offsets")}', fix='Re-download or re-save the file')
    entries[name] = (dtype, shape, (begin, end))
  _check_disjoint(path, {name: entry[2] for name, entry in entries.items()})
  return entries


def _check_disjoint(path: str, ranges: Mapping[str, Tuple[int, int]]) -> None:
  """Raises naming the first tensor whose [begin, end) bytes overlap another's (empty ranges
  overlap nothing)."""
  previous = None   # (name, end) of the range reaching furthest so far
  for name, (begin, end) in sorted(ranges.items(), key=lambda item: item[1]):
    if begin == end:
      continue
    if previous is not None and begin < previous[1]:
      raise checkpoint_error(
          path, f"tensor data overlaps the bytes of tensor {previous[0]!r} (two tensors "
          'cannot share bytes)', param=name,
          expected=f'data_offsets starting at or after {previous[1]}',
          found=f'data_offsets {list(ranges[name])}', fix='Re-download or re-save the file')
    if previous is None or end > previous[1]:
      previous = (name, end)


def nbytes(leaf: Any) -> int:
  """The bytes `leaf` (an array or LazyArray) takes in a file, from its shape and dtype."""
  return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def write(path: str, tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None,
          done: Optional[progress.Progress] = None) -> None:
  """Writes `tensors` ({name: array or LazyArray}) as one .safetensors file at `path`.

  The header needs only shapes and dtypes, so the tensors are read (or computed, for a
  `LazyArray.map`) one at a time, in order, and written as they come: memory holds one.
  `done` counts each tensor written.
  """
  header: Dict[str, Any] = {'__metadata__': dict(metadata)} if metadata else {}
  offset = 0
  for name, leaf in tensors.items():
    dtype = np.dtype(leaf.dtype)
    if dtype not in DTYPE_NAMES:
      raise checkpoint_error(path, 'no safetensors dtype for this tensor', param=name,
                             expected=f'one of {sorted(DTYPES)}', found=dtype)
    end = offset + nbytes(leaf)
    header[name] = {'dtype': DTYPE_NAMES[dtype], 'shape': [int(d) for d in leaf.shape],
                    'data_offsets': [offset, end]}
    offset = end
  encoded = json.dumps(header, separators=(',', ':')).encode('utf-8')
  encoded += b' ' * (-len(encoded) % 8)
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(encoded)))
    f.write(encoded)
    for leaf in tensors.values():
      f.write(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8).data)
      if done is not None:
        done.update(1)
