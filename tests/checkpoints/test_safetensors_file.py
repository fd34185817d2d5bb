"""The small safetensors reader agrees with the safetensors library, bfloat16 included."""

import ml_dtypes
import numpy as np
import pytest
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
