"""Writes T5X native checkpoints, the layout `t5x.checkpoints.Checkpointer.save` produces.

  MODEL_DIR/checkpoint_<step>/checkpoint
      flax msgpack of {'version': 3, 'optimizer': {'target': params,
                        'state': {'step': int32 scalar, 'param_states': slots}}}
  MODEL_DIR/checkpoint_<step>/digests/process_0.json
      the CRC-32 of every array written (`digests.write`), which every reader of this
      project checks (`describe --verify` too); T5X ignores it
  MODEL_DIR/checkpoint_<step>/target.encoder.layers_1.mlp.expert.wi_0.kernel/
      one zarr array per array leaf (as T5X writes every partitioned leaf), whose
      tensorstore spec stands in the msgpack in place of the leaf:
      {'driver': 'zarr', 'dtype': 'float32', 'kvstore': {'driver': 'file', 'path':
       'target.encoder....kernel/'}, 'metadata': {'chunks': [...], 'compressor':
       {'id': 'gzip', 'level': 1}, 'shape': [...]}}

As in T5X: the zarr path is the '/'-joined state-dict path with '.' for '/', relative to the
checkpoint directory (T5X resolves it against wherever the checkpoint lies); chunks are the
largest shape dividing the array with at most 64 MiB per chunk (`chunk_shape`); version 3
stores bfloat16 natively. Scalars and T5X Adafactor's `[1]` placeholder slots stay inline in
the msgpack (T5X reads either form for any leaf). Leaves may be `LazyArray`s: each is read,
written and dropped in turn, so memory holds one leaf at a time.

The step directory is written as `checkpoint_<step>.tmp-<time>-<pid>` and renamed when complete
(T5X's own convention), so readers never see a partial checkpoint (`atomic_dir`: a failed write
removes it, the next write of the step removes a killed one's, and writers of one step hold
`checkpoint_<step>.tmp.lock`, so a second one is refused). On gs:// (no rename) it is
written in place and the `checkpoint` msgpack last: T5X (`checkpoints.all_steps`) and this
project's reader take a step to exist only once that file does. The zarr specs stay relative
(`'driver': 'file'`), as T5X resolves them against the checkpoint's own location (gcs there).
"""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import flax.serialization
import jax
import numpy as np
import tensorstore as ts

from upcycle import progress, tree
from upcycle.checkpoints import atomic_dir, digests, gcs, paths, zarr_leaf
from upcycle.optimizer_state import adafactor

VERSION = 3
CHUNK_BYTES = 64 * 2**20   # T5X's _DESIRED_CHUNK_SIZE_BYTES
COMPRESSOR = {'id': 'gzip', 'level': 1}
CHECKPOINT_FILE = 'checkpoint'


def chunk_shape(shape: Sequence[int], max_elements: int) -> List[int]:
  """The zarr chunk shape T5X chooses: each dimension a divisor of the array's, at most
  `max_elements` in all; starting from the whole shape, the largest dimension is lowered
  to its next smaller divisor until the chunk fits."""
  divisors = [[d for d in range(1, size + 1) if size % d == 0] for size in shape]
  while int(np.prod([f[-1] for f in divisors], dtype=np.int64)) > max_elements:
    largest = max(range(len(shape)), key=lambda i: (divisors[i][-1], -i))
    divisors[largest].pop()
  return [f[-1] for f in divisors]


def leaf_name(path: str) -> str:
  """'target/encoder/layers_0/mlp/wi_0/kernel' -> 'target.encoder.layers_0.mlp.wi_0.kernel'."""
  return path.replace('/', '.')


def spec(path: str, shape: Sequence[int], dtype: Any) -> dict:
  """The tensorstore spec T5X writes into the msgpack for the array at state-dict `path`."""
  dtype = np.dtype(dtype)
  chunks = chunk_shape(shape, max(1, CHUNK_BYTES // dtype.itemsize))
  return {'driver': 'zarr', 'dtype': dtype.name,
          'kvstore': {'driver': 'file', 'path': leaf_name(path) + '/'},
          'metadata': {'chunks': chunks, 'compressor': dict(COMPRESSOR),
                       'shape': [int(d) for d in shape]}}


def _inline(leaf: Any) -> bool:
  return int(np.prod(np.shape(leaf), dtype=np.int64)) <= 1


def _write_leaf(directory: str, path: str, leaf: Any) -> Any:
  """Writes one array under `directory` (zarr) or returns it for the msgpack.

  An abstract leaf (`jax.ShapeDtypeStruct`) writes the array's metadata and no chunks: it
  reads as zeros (zarr's fill value), for tools that need a checkpoint's names and shapes only
  (`benchmarks/tpu_fit.py` compiles restores of full-size models this way).
  """
  if isinstance(leaf, np.generic):   # a numpy scalar stays one (msgpack ext type 3, as T5X's step)
    return leaf
  abstract = isinstance(leaf, jax.ShapeDtypeStruct)
  array = leaf if abstract else np.asarray(leaf)
  if _inline(array):
    return np.zeros(array.shape, array.dtype) if abstract else array
  leaf_spec = spec(path, array.shape, array.dtype)
  absolute = {**leaf_spec,
              'kvstore': zarr_leaf.kvstore_for(directory, leaf_spec['kvstore']['path'])}
  store = ts.open(absolute, create=True, open=False).result()
  if not abstract:
    store.write(array).result()
  return leaf_spec


# The digest items of the msgpack's two trees, as T5X's reader returns them (`digests.py`).
_ITEMS = {'target': 'params', 'state': 'optimizer_state'}


def _encode(node: Any, path: str, directory: str, done: progress.Progress,
            recorded: Dict[str, Dict[str, Any]]) -> Any:
  """`node` with its array leaves written (`_write_leaf`); each written array's digest goes
  into `recorded[item][path in the item]`."""
  if isinstance(node, Mapping):
    return {str(k): _encode(v, tree.join(path, str(k)), directory, done, recorded)
            for k, v in node.items()}
  if not isinstance(node, jax.ShapeDtypeStruct):
    node = np.asarray(node) if not isinstance(node, np.generic) else node
    top, name = path.split('/', 1)
    recorded.setdefault(_ITEMS[top], {})[name] = digests.whole(node)
  written = _write_leaf(directory, path, node)
  done.update(1)
  return written


def write(model_dir: str, step: int, params: Mapping[str, Any],
          param_states: Optional[Mapping[str, Any]] = None) -> str:
  """Writes `model_dir/checkpoint_<step>` in T5X's native format; returns that directory.

  Args:
    model_dir: the T5X model directory (created if missing).
    step: the training step (`state/step`, int32, and the directory name); T5X's Adafactor
      runs on this step, so with `param_states` it is the state's `count`.
    params: nested dict in this project's (= T5X/Flaxformer) names; numpy, jax or lazy leaves.
    param_states: optional T5X optimizer slots, `{<param path>: {'v_row', 'v_col', 'v',
      'm'}}` for Adafactor (`adafactor_param_states` builds them from `T5XAdafactorState`);
      None writes an empty `param_states`, for T5X to initialize (docs/checkpoints.md, "Restoring in
      T5X").

  Raises:
    FileExistsError: `checkpoint_<step>` exists already (an empty directory is replaced), or
      another write of it is running (nothing is written).
  """
  if paths.is_url(model_dir):
    return _write_gcs(paths.absolute(model_dir), step, params, param_states)
  final = os.path.join(os.path.abspath(os.fspath(model_dir)), f'checkpoint_{int(step)}')
  taken = (f'{final} already exists; T5X checkpoints are never overwritten. Fix: write another '
           f'step or into another model directory.')
  writer = atomic_dir.write_of(final, fix='write into another model directory', taken=taken)
  with atomic_dir.create(final, writer) as tmp:
    data = _serialize(tmp, step, params, param_states)
    with open(os.path.join(tmp, CHECKPOINT_FILE), 'wb') as f:
      f.write(data)
  return final


def _serialize(directory: str, step: int, params: Mapping[str, Any],
               param_states: Optional[Mapping[str, Any]]) -> bytes:
  """Writes the array leaves under `directory`, and their digests (`digests.write`); returns
  the `checkpoint` msgpack."""
  state = {'target': params,
           'state': {'step': np.int32(step), 'param_states': param_states or {}}}
  done = progress.Progress(f'checkpoint_{int(step)}', 'arrays', total=len(tree.flatten(state)))
  recorded: Dict[str, Dict[str, Any]] = {}
  written = _encode(state, '', directory, done, recorded)
  digests.write(directory, recorded)
  done.finish()
  return flax.serialization.msgpack_serialize({'version': VERSION, 'optimizer': written})


def _write_gcs(model_dir: str, step: int, params: Mapping[str, Any],
               param_states: Optional[Mapping[str, Any]]) -> str:
  """`write` on gs://: in place, the `checkpoint` file (the step's marker) last."""
  final = f'{model_dir}/checkpoint_{int(step)}'
  if gcs.has_content(final):
    unfinished = ('' if gcs.is_object(f'{final}/{CHECKPOINT_FILE}') else
                  f' (it has no {CHECKPOINT_FILE} file: a write that did not finish; delete it '
                  f'with `gcloud storage rm -r {final}` to write it again)')
    raise FileExistsError(f'{final} already exists{unfinished}; T5X checkpoints are never '
                          f'overwritten. Fix: write another step or into another model directory.')
  gcs.write_bytes(f'{final}/{CHECKPOINT_FILE}', _serialize(final, step, params, param_states))
  return final


def adafactor_param_states(state: adafactor.T5XAdafactorState) -> dict:
  """`T5XAdafactorState` -> T5X's `param_states` tree of `{v_row, v_col, v, m}` dicts."""
  flat = {}
  for path, slots in tree.flatten(state.param_states).items():  # ParamSlots are not mappings
    if not adafactor.is_slots(slots):
      raise TypeError(f'param_states/{path}: expected ParamSlots, found {type(slots).__name__}; '
                      f'pass the state of optimizers.T5XAdafactor.')
    flat[path] = {k: np.asarray(getattr(slots, k)) for k in adafactor.SLOTS}
  return tree.unflatten(flat)
