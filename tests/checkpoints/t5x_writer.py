"""Writes T5X-layout checkpoints for tests, with msgpack and tensorstore only (not the reader).

The layout is what T5X's Checkpointer.save produces:
  checkpoint_N/checkpoint   msgpack {'version': 3, 'optimizer': {'target': ..., 'state':
                            {'step': int32, 'param_states': ...}}}
  checkpoint_N/target.a.b/  zarr array of a partitioned leaf (its spec sits in the msgpack)
"""

import dataclasses
import os
from typing import Dict, Optional

import msgpack
import numpy as np
import tensorstore as ts


@dataclasses.dataclass
class Layout:
  """How each leaf is stored, by '/'-joined path under the train state ('target/...').

  Leaves not listed are inline msgpack arrays.
  """

  zarr: Dict[str, str] = dataclasses.field(default_factory=dict)  # path -> 'gzip' | 'zstd'
  driver: str = 'file'                    # kvstore driver written in the spec: file | gfile
  chunked: Dict[str, int] = dataclasses.field(default_factory=dict)  # path -> chunk elements
  drop_zarray: bool = False               # delete .zarray files (as in the T5X fixture copy)


def _pack_array(x: np.ndarray) -> bytes:
  return msgpack.packb((list(x.shape), x.dtype.name, x.tobytes('C')), use_bin_type=True)


def _default(obj):
  if isinstance(obj, np.ndarray):
    return msgpack.ExtType(1, _pack_array(obj))
  if isinstance(obj, np.generic):
    return msgpack.ExtType(3, _pack_array(np.asarray(obj)))
  raise TypeError(f'cannot pack {type(obj)}')


def _chunk(x: np.ndarray, size: int) -> dict:
  flat = x.reshape(-1)
  pieces = [flat[i:i + size] for i in range(0, flat.size, size)]
  return {'__msgpack_chunked_array__': True,
          'shape': {str(i): d for i, d in enumerate(x.shape)},
          'chunks': {str(i): p for i, p in enumerate(pieces)}}


def _write_zarr(directory: str, name: str, x: np.ndarray, compressor: str, driver: str) -> dict:
  relative = name.replace('/', '.')
  chunks = [max(1, d // 2) for d in x.shape]  # Several chunks per array.
  metadata = {'chunks': chunks, 'compressor': {'id': compressor, 'level': 1},
              'shape': list(x.shape)}
  spec = {'driver': 'zarr', 'dtype': x.dtype.name, 'metadata': metadata,
          'kvstore': {'driver': 'file', 'path': os.path.join(directory, relative)}}
  ts.open(spec, create=True, open=True).result().write(x).result()
  return {**spec, 'kvstore': {'driver': driver, 'path': relative}}


def _encode(node, prefix: str, directory: str, layout: Layout):
  if isinstance(node, dict):
    return {k: _encode(v, f'{prefix}/{k}' if prefix else k, directory, layout)
            for k, v in node.items()}
  if prefix in layout.zarr:
    return _write_zarr(directory, prefix, node, layout.zarr[prefix], layout.driver)
  if prefix in layout.chunked:
    return _chunk(node, layout.chunked[prefix])
  return node


def write(model_dir: str, step: int, target: dict, param_states: Optional[dict] = None,
          layout: Optional[Layout] = None) -> str:
  """Writes model_dir/checkpoint_{step}; returns that directory."""
  layout = layout or Layout()
  directory = os.path.join(model_dir, f'checkpoint_{step}')
  os.makedirs(directory)
  state = {'target': target, 'state': {'step': np.int32(step),
                                       'param_states': param_states or {}}}
  encoded = _encode(state, '', directory, layout)
  with open(os.path.join(directory, 'checkpoint'), 'wb') as f:
    f.write(msgpack.packb({'version': 3, 'optimizer': encoded}, default=_default,
                          use_bin_type=True))
  if layout.drop_zarray:
    for root, _, files in os.walk(directory):
      if '.zarray' in files:
        os.remove(os.path.join(root, '.zarray'))
  return directory


def adafactor_states(params: dict, seed: int = 1) -> dict:
  """T5X Adafactor slots per parameter: factored v_row/v_col for matrices, v otherwise."""
  rng = np.random.default_rng(seed)

  def slots(x):
    if isinstance(x, dict):
      return {k: slots(v) for k, v in x.items()}
    zero = np.zeros((1,), np.float32)
    if x.ndim >= 2:
      return {'v_row': rng.random(x.shape[:-1]).astype(np.float32),
              'v_col': rng.random(x.shape[:-2] + x.shape[-1:]).astype(np.float32),
              'v': zero, 'm': zero}
    return {'v_row': zero, 'v_col': zero, 'v': rng.random(x.shape).astype(np.float32), 'm': zero}

  return slots(params)
