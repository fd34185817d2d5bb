"""The streaming executor: a plan written to an orbax checkpoint one target leaf at a time.

The MoE params never exist in memory together: every target leaf is a `LazyArray` that orbax
reads when it writes it. A copied leaf is read from the dense checkpoint then; the leaves of
an MoE block come from `execute.block`, run when the block's first leaf is read (an expert
initializer needs the block's whole MLP at once: Drop-Upcycling shares units across wi_0,
wi_1 and wo). Each leaf is dropped as soon as it is written, and the dense MLP as soon as its
block is computed. Peak memory is therefore about one MoE block (its E expert copies of one
dense MLP) plus the write buffers of one leaf and tensorstore's OCDBT cache (orbax bounds it
at 100 MB), whatever the model size; the dense checkpoint stays lazy.

Values equal the eager executor's exactly: each block's draws depend only on the seed and
the block's path (`base.key_for`). (The jitted executor, as the restore hook runs it, can
differ in the last bit of the random router weights, where XLA fuses the scaling into the
sampler.)

The layout is what `upcycle.checkpoints.orbax.CheckpointManager` writes, `params` only:
`directory/<step>/params/` + `_CHECKPOINT_METADATA`, committed by orbax's rename when
every leaf is on disk.
"""

import logging
import os
from typing import Any, Dict, Mapping, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from upcycle import progress, tree
from upcycle.checkpoints import digests
from upcycle.checkpoints.errors import CheckpointError
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.orbax import PARAMS
from upcycle.upcycling import execute
from upcycle.upcycling.plan import Block, Plan

SOURCE = 'upcycle.convert'


class _QuietSourceErrors(logging.Filter):
  """Drops orbax's log, traceback included, of a source leaf refused while it is streamed (a
  NaN in the dense checkpoint): orbax's writer thread catches the CheckpointError and logs it,
  then the save fails with it and the caller reports it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], CheckpointError))


logging.getLogger('absl').addFilter(_QuietSourceErrors())


class _StreamingHandler(ocp.type_handlers.NumpyHandler):
  """Writes LazyArrays as numpy arrays (restored as such), strictly one after the other."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)

    async def write_all():
      done = progress.Progress('convert', 'arrays', total=len(values))
      for leaf, info, arg in zip(values, infos, args):
        array = leaf.read()
        await self._background_serialize([array], [info], [arg])
        del array
        done.update(1)
      done.finish()

    return [ocp.future.CommitFutureAwaitingContractedSignals(write_all(), name='upcycle_stream')]


class BlockValues:
  """The leaves of one MoE block: computed together on first read, handed out one by one."""

  def __init__(self, plan: Plan, block: Block, dense: Mapping[str, Any], rng: jax.Array):
    self.plan, self.block, self.dense, self.rng = plan, block, dense, rng
    self.made: Optional[Dict[str, Any]] = None

  def pop(self, path: str) -> np.ndarray:
    if self.made is None:
      mlp = {leaf.source: np.asarray(self.dense[leaf.source])
             for leaf in self.block.leaves if leaf.source}
      self.made = execute.block(self.plan, self.block, mlp, self.rng)
    return np.asarray(self.made.pop(path))


def leaves(plan: Plan, dense_params: Mapping[str, Any], seed: int) -> Dict[str, Any]:
  """The target tree with every leaf a LazyArray that computes it when read."""
  dense = tree.flatten(dense_params)
  rng = jax.random.PRNGKey(seed)
  out = {}
  for leaf in plan.copies:
    source = dense[leaf.source]
    out[leaf.path] = LazyArray(leaf.shape, leaf.dtype,
                               lambda leaf=leaf, source=source: np.asarray(
                                   execute.copy(leaf, source)), SOURCE, leaf.path)
  for block in plan.blocks:
    values = BlockValues(plan, block, dense, rng)
    for leaf in block.leaves:
      out[leaf.path] = LazyArray(leaf.shape, leaf.dtype,
                                 lambda path=leaf.path, values=values: values.pop(path),
                                 SOURCE, leaf.path)
  return tree.unflatten({path: out[path] for path in plan.order})


def write(directory: str, step: int, params: Mapping[str, Any]) -> None:
  """Writes `directory/<step>/params` from a tree of LazyArrays, one leaf in memory at a time,
  and `directory/<step>/digests/`, the CRC-32 of each array as it was written (`digests.py`)."""
  recorded: Dict[str, Any] = {}
  params = tree.unflatten(digests.recording(tree.flatten(params), recorded))
  # jax.Array's own handler beside ours: orbax keeps its array metadata on (and says nothing).
  registry = ocp.type_handlers.create_type_handler_registry(
      (LazyArray, _StreamingHandler()), (jax.Array, ocp.type_handlers.ArrayHandler()))
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(directory, options=options, item_names=(PARAMS,),
                                  item_handlers={PARAMS: handler})
  try:
    manager.save(int(step), args=ocp.args.Composite(**{PARAMS: ocp.args.PyTreeSave(params)}))
    manager.wait_until_finished()
  finally:
    manager.close()
  digests.write(os.path.join(directory, str(int(step))), {PARAMS: recorded})
