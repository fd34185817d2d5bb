"""T5X checkpoints, native ("legacy") msgpack + tensorstore format and the orbax-era layout.

Legacy: `checkpoint_N/checkpoint` is flax msgpack of
`{'version': 3, 'optimizer': {'target': params, 'state': {'step', 'param_states'}}}`;
partitioned leaves are tensorstore zarr specs with paths relative to `checkpoint_N/`
(see zarr_leaf.py), small leaves are inline. Orbax era: `checkpoint_N/state/` is an
orbax PyTree of `{'target': ..., 'state': ...}` (see orbax_tree.py).

`load` accepts a checkpoint directory, its `checkpoint` file, or a model directory
(the highest `checkpoint_N` is read), locally or on `gs://` (legacy format).
Parameters come back without the `target/` prefix, in contract names; the optimizer
state is T5X's `state` as stored (Adafactor `param_states/<param path>/{v_row, v_col,
v, m}` and `step`). Every leaf is lazy.
"""

import os
import re
from typing import Any, Optional, Tuple

import numpy as np
import tensorstore as ts

from upcycle.checkpoints import flax_msgpack, orbax_tree, paths, zarr_leaf
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import checkpoint_error

CHECKPOINT_FILE = 'checkpoint'
STATE_DIR = 'state'
_STEP_DIR = re.compile(r'checkpoint_(\d+)')


def _gcs_store(path: str) -> Tuple[Any, str]:
  bucket, key = paths.split_gcs(path)
  return ts.KvStore.open({'driver': 'gcs', 'bucket': bucket}).result(), key.rstrip('/')


def _read_bytes(path: str) -> bytes:
  if paths.split_gcs(path):
    store, key = _gcs_store(path)
    result = store.read(key).result()
    if result.state != 'value':
      raise checkpoint_error(path, 'no such file', fix='Check the gs:// path')
    return bytes(result.value)
  with open(path, 'rb') as f:
    return f.read()


def _exists(directory: str, name: str) -> bool:
  if paths.split_gcs(directory):
    store, key = _gcs_store(f'{directory.rstrip("/")}/{name}')
    return store.read(key).result().state == 'value'
  return os.path.exists(os.path.join(directory, name))


def _step_dirs(model_dir: str) -> dict:
  """step -> checkpoint directory, for finished `checkpoint_N` directories only."""
  if paths.split_gcs(model_dir):
    store, base = _gcs_store(model_dir)
    prefix = f'{base}/' if base else ''
    keys = store.list(ts.KvStore.KeyRange(prefix + 'checkpoint_', prefix + 'checkpoint`')).result()
    steps = {}
    for key in keys:
      m = re.fullmatch(re.escape(prefix) + r'checkpoint_(\d+)/checkpoint', key.decode())
      if m:
        steps[int(m.group(1))] = f'{model_dir.rstrip("/")}/checkpoint_{m.group(1)}'
    return steps
  steps = {}
  for name in os.listdir(model_dir):
    m = _STEP_DIR.fullmatch(name)
    full = os.path.join(model_dir, name)
    if m and (os.path.isfile(os.path.join(full, CHECKPOINT_FILE)) or
              orbax_tree.is_item_dir(os.path.join(full, STATE_DIR))):
      steps[int(m.group(1))] = full
  return steps


def find_checkpoint(path: str) -> Tuple[str, str]:
  """Any accepted path -> (checkpoint directory, 't5x' or 't5x_orbax')."""
  path = os.fspath(path)
  local = not paths.split_gcs(path)
  if not local:
    path = path.rstrip('/')
  if local and os.path.isfile(path):
    if os.path.basename(path) != CHECKPOINT_FILE:
      raise checkpoint_error(path, 'not a T5X checkpoint file', expected=f"'{CHECKPOINT_FILE}'",
                             found=repr(os.path.basename(path)),
                             fix='Pass the checkpoint_N directory or its checkpoint file')
    return os.path.dirname(os.path.abspath(path)), 't5x'
  if local and not os.path.isdir(path):
    raise checkpoint_error(path, 'no such file or directory', fix='Check the path')
  if _exists(path, CHECKPOINT_FILE):
    return path, 't5x'
  if local and orbax_tree.is_item_dir(os.path.join(path, STATE_DIR)):
    return path, 't5x_orbax'
  steps = _step_dirs(path)
  if steps:
    return find_checkpoint(steps[max(steps)])
  raise checkpoint_error(
      path, 'not a T5X checkpoint or model directory',
      expected=f"'{CHECKPOINT_FILE}' (legacy), '{STATE_DIR}/_METADATA' (orbax era) or "
      'checkpoint_N/ sub-directories', found=sorted(os.listdir(path))[:10] if local else 'none',
      fix='Pass the checkpoint_N directory or the model directory holding it')


def _lazy_leaves(tree: Any, checkpoint_dir: str, source: str, prefix: str = '') -> Any:
  """Replaces every tensorstore spec in a decoded msgpack tree by a LazyArray."""
  if zarr_leaf.is_spec(tree):
    return zarr_leaf.from_t5x_spec(tree, checkpoint_dir, prefix, source)
  if isinstance(tree, dict):
    return {k: _lazy_leaves(v, checkpoint_dir, source, f'{prefix}/{k}' if prefix else k)
            for k, v in tree.items()}
  return tree


def _step(state: Any) -> Optional[int]:
  if isinstance(state, dict) and 'step' in state:
    return int(np.asarray(state['step']))
  return None


def _split(optimizer: Any, source: str) -> Tuple[dict, Any]:
  if not isinstance(optimizer, dict) or 'target' not in optimizer:
    raise checkpoint_error(source, 'no parameters', expected="an 'optimizer/target' tree",
                           found=sorted(optimizer) if isinstance(optimizer, dict) else optimizer,
                           fix='This is not a T5X training checkpoint')
  return optimizer['target'] or {}, optimizer.get('state')


def _has_placeholders(tree: Any) -> bool:
  if isinstance(tree, dict):
    return any(_has_placeholders(v) for v in tree.values())
  return isinstance(tree, str) and tree.startswith('PLACEHOLDER://')


def _load_legacy(checkpoint_dir: str) -> Checkpoint:
  source = f'{checkpoint_dir.rstrip("/")}/{CHECKPOINT_FILE}'
  contents = flax_msgpack.restore(_read_bytes(source), source)
  if _has_placeholders(contents):
    raise checkpoint_error(
        source, 'an early (2022) orbax layout: leaves are PLACEHOLDER:// names without shapes',
        expected="inline arrays or tensorstore specs, or 'state/_METADATA'", found='placeholders',
        fix='Restore it with the T5X/orbax version that wrote it and save it again')
  # Version >= 1 wraps the train state in 'optimizer'; version 0 is a bare flax state.
  optimizer = contents.get('optimizer', contents)
  target, state = _split(optimizer, source)
  target = _lazy_leaves(target, checkpoint_dir, source)
  state = _lazy_leaves(state, checkpoint_dir, source, 'state')
  return Checkpoint(params=target, step=_step(state), optimizer_state=state, format='t5x',
                    path=checkpoint_dir)


def _load_orbax(checkpoint_dir: str) -> Checkpoint:
  state_dir = os.path.join(checkpoint_dir, STATE_DIR)
  target, state = _split(orbax_tree.read(state_dir), state_dir)
  return Checkpoint(params=target, step=_step(state), optimizer_state=state,
                    format='t5x_orbax', path=checkpoint_dir)


def load(path: str) -> Checkpoint:
  """T5X checkpoint (directory, its `checkpoint` file, or model directory) -> Checkpoint."""
  checkpoint_dir, kind = find_checkpoint(path)
  return _load_legacy(checkpoint_dir) if kind == 't5x' else _load_orbax(checkpoint_dir)
