"""The small safetensors reader agrees with the safetensors library, bfloat16 included, and
refuses the headers it refuses."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from upcycle.checkpoints import CheckpointError, lazy, safetensors_file


def test_matches_library_for_every_common_dtype(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {
      'f32': rng.normal(size=(3, 5)).astype(np.float32),
      'bf16': rng.normal(size=(4, 2)).astype(ml_dtypes.bfloat16),
      'f16': rng.normal(size=(7,)).astype(np.float16),
      'i64': np.arange(6, dtype=np.int64).reshape(2, 3),
      'u8': np.arange(5, dtype=np.uint8),
      'flag': np.array([True, False]),
      'scalar': np.array(3.5, np.float32),
      'empty': np.zeros((0, 4), np.float32),
  }
  path = str(tmp_path / 'x.safetensors')
  save_file(tensors, path)
  loaded = safetensors_file.load(path)
  assert loaded.keys() == tensors.keys()
  for name, want in tensors.items():
    leaf = loaded[name]
    assert isinstance(leaf, lazy.LazyArray)
    assert leaf.shape == want.shape and leaf.dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=name)


def test_bad_files(tmp_path):
  short = tmp_path / 'short.safetensors'
  short.write_bytes(b'\x01\x02')
  with pytest.raises(CheckpointError, match=r'short.safetensors: not a safetensors file'):
    safetensors_file.load(str(short))
  huge = tmp_path / 'huge.safetensors'
  huge.write_bytes((10**6).to_bytes(8, 'little') + b'{}')
  with pytest.raises(CheckpointError, match=r'header length is impossible'):
    safetensors_file.load(str(huge))


def _edited(path, edit):
  """Rewrites the header of the safetensors file at `path` as `edit(header)` leaves it (the
  tensor bytes kept), as a broken tool or a hand edit would; returns `path`."""
  with open(path, 'rb') as f:
    length = int.from_bytes(f.read(8), 'little')
    header, data = json.loads(f.read(length)), f.read()
  edit(header)
  encoded = json.dumps(header).encode()
  with open(path, 'wb') as f:
    f.write(len(encoded).to_bytes(8, 'little') + encoded + data)
  return path


def _two_layers(tmp_path):
  path = str(tmp_path / 'model.safetensors')
  save_file({f'model.layers.{i}.mlp.gate_proj.weight': np.full((2, 3), i, np.float32)
             for i in range(2)}, path)
  return path


def _offsets(name, offsets):
  def edit(header):
    header[name]['data_offsets'] = offsets
  return edit


_NAMED = r"parameter 'model\.layers\.1\.mlp\.gate_proj\.weight': "


@pytest.mark.parametrize('offsets, message', [
    # layer 1's gate given layer 0's bytes
    ([0, 24], r"parameter 'model.layers.1.mlp.gate_proj.weight': tensor data overlaps the bytes "
              r"of tensor 'model.layers.0.mlp.gate_proj.weight' \(two tensors cannot share "
              r"bytes\). Expected data_offsets starting at or after 24, found data_offsets "
              r"\[0, 24\]. Re-download or re-save the file.$"),
    ([12, 36], _NAMED + 'tensor data overlaps'),
    ([40, 64], r"parameter 'model.layers.1.mlp.gate_proj.weight': tensor data does not fit "
               r'the file \(truncated or corrupt\). Expected 24 bytes for shape \[2, 3\] '
               r'float32 within 48 data bytes, found data_offsets \[40, 64\]'),
    ([36, 24], _NAMED + r'tensor data does not fit the file'),   # end before begin
    ([24, 40], _NAMED + r'tensor data does not fit the file'),   # fewer bytes than the shape
])
def test_offsets_the_library_refuses_are_refused(tmp_path, offsets, message):
  path = _edited(_two_layers(tmp_path), _offsets('model.layers.1.mlp.gate_proj.weight', offsets))
  with pytest.raises(SafetensorError):   # the reference: the library refuses the same file
    with safe_open(path, 'np') as f:
      f.get_tensor('model.layers.1.mlp.gate_proj.weight')
  with pytest.raises(CheckpointError, match=r'^' + re.escape(path) + ': ' + message):
    safetensors_file.load(path)


def test_empty_tensors_share_offsets_with_their_neighbours(tmp_path):
  path = str(tmp_path / 'x.safetensors')
  tensors = {'a': np.ones((2,), np.float32), 'b': np.zeros((0, 3), np.float32),
             'c': np.full((1,), 2.0, np.float32)}
  save_file(tensors, path)
  loaded = safetensors_file.load(path)
  with safe_open(path, 'np') as f:
    for name in tensors:
      np.testing.assert_array_equal(np.asarray(loaded[name]), f.get_tensor(name))
