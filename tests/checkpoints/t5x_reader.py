"""An independent minimal reader of T5X's native format, following t5x/checkpoints.py
(`Checkpointer.restore` / `_read_ts`): msgpack with flax's ext types, tensorstore specs whose
kvstore path is relative to the checkpoint directory. It shares no code with upcycle.

  raw, state = read('/out/checkpoint_3')
  raw['optimizer']['target']   the msgpack as stored (specs in place of zarr leaves)
  state['target']              every leaf a numpy array (zarr leaves read)
"""

import os

import ml_dtypes
import msgpack
import numpy as np
import tensorstore as ts


def ext_hook(code, data):
  """flax's msgpack ext types: 1 an ndarray, 3 a numpy scalar (T5X's `state/step`)."""
  shape, dtype, buffer = msgpack.unpackb(data, raw=False)
  array = np.frombuffer(buffer, dtype=getattr(ml_dtypes, dtype, None) or np.dtype(dtype))
  array = array.reshape(shape)
  return array[()] if code == 3 else array


def _resolve(node, checkpoint_dir):
  if isinstance(node, dict) and {'driver', 'kvstore', 'metadata'} <= set(node):
    spec = {**node, 'kvstore': {**node['kvstore']}, 'metadata': dict(node['metadata'])}
    del spec['metadata']['chunks'], spec['metadata']['compressor']   # as T5X's _read_ts
    spec['kvstore']['path'] = os.path.join(checkpoint_dir, spec['kvstore']['path'])
    return ts.open(spec).result().read().result()
  if isinstance(node, dict):
    return {k: _resolve(v, checkpoint_dir) for k, v in node.items()}
  return node


def read(checkpoint_dir):
  """checkpoint_<step>/ -> (the msgpack as stored, its `optimizer` tree with arrays read)."""
  with open(os.path.join(checkpoint_dir, 'checkpoint'), 'rb') as f:
    raw = msgpack.unpackb(f.read(), ext_hook=ext_hook, raw=False)
  return raw, _resolve(raw['optimizer'], checkpoint_dir)


def by_path(node, prefix=''):
  """Nested dicts -> {'a/b/c': leaf}, stopping at spec dicts."""
  if isinstance(node, dict) and not {'driver', 'kvstore'} <= set(node):
    out = {}
    for k, v in node.items():
      out.update(by_path(v, f'{prefix}/{k}' if prefix else k))
    return out
  return {prefix: node}
