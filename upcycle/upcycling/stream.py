"""Upcycling straight to an orbax checkpoint on disk, one target leaf at a time.

The MoE params never exist in memory together: orbax asks for each leaf when it writes it.
A copied leaf is read from the dense checkpoint then; an expert or router leaf comes from the
surgery restricted to its MoE block, run when the block's first leaf is asked for (an expert
initializer needs the block's whole MLP at once: Drop-Upcycling shares units across wi_0,
wi_1 and wo). Each leaf is dropped as soon as it is written, and the dense MLP as soon as its
block is computed. Peak memory is therefore about one MoE block (its E expert copies of one
dense MLP) plus the write buffers of one leaf and tensorstore's OCDBT cache (orbax bounds it
at 100 MB), whatever the model size; the dense checkpoint stays lazy.

Values equal eager `surgery.upcycle` exactly: each block's draws depend only on the seed and
the block's path (`base.key_for`), so upcycling block by block changes nothing. (A jitted
surgery, as the restore hook runs, can differ in the last bit of the random router weights,
where XLA fuses the scaling into the sampler.)

The layout is what `upcycle.checkpoints.orbax.CheckpointManager` writes, `params` only:
`directory/<step>/params/` + `_CHECKPOINT_METADATA`, committed by orbax's rename when
every leaf is on disk. Multi-source initializers (FromCheckpoints, Merge) are not
supported here (they need every source in memory).
"""

import functools
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from upcycle.checkpoints.orbax import PARAMS
from upcycle.upcycling import paths
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.report import COPIED, UpcycleReport
from upcycle.upcycling.routers import RouterInit
from upcycle.upcycling.surgery import upcycle


class _Leaf:
  """A target leaf that is computed when orbax writes it."""

  def __init__(self, shape: Tuple[int, ...], dtype: Any, compute: Callable[[], np.ndarray]):
    self.shape, self.dtype, self.compute = tuple(shape), np.dtype(dtype), compute

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class _StreamingHandler(ocp.type_handlers.NumpyHandler):
  """Writes `_Leaf`s as numpy arrays (restored as such), strictly one after the other."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)

    async def write_all():
      for leaf, info, arg in zip(values, infos, args):
        array = leaf.compute()
        if array.shape != leaf.shape or array.dtype != leaf.dtype:
          raise AssertionError(f'{info.name}: computed {array.shape} {array.dtype}, expected '
                               f'{leaf.shape} {leaf.dtype}')
        await self._background_serialize([array], [info], [arg])
        del array

    return [ocp.future.CommitFutureAwaitingContractedSignals(write_all(), name='upcycle_stream')]


class _Block:
  """The leaves of one MoE block: computed together on first use, handed out one by one."""

  def __init__(self, dense: Mapping[str, Any], sources, sub_target, settings: Dict[str, Any]):
    self.dense, self.sources = dense, sorted(sources)
    self.sub_target, self.settings = sub_target, settings
    self.made: Optional[Dict[str, Any]] = None

  def pop(self, path: str) -> np.ndarray:
    if self.made is None:
      inputs = paths.unflatten({p: np.asarray(self.dense[p]) for p in self.sources})
      params, _ = upcycle(inputs, self.sub_target, **self.settings)
      self.made = paths.flatten(params)
    return np.asarray(self.made.pop(path))


def plan(dense_params: Mapping[str, Any], target: Mapping[str, Any], *,
         experts: Union[str, ExpertInit] = 'copy', router: Union[str, RouterInit] = 'normal',
         seed: int = 0, cast: bool = False) -> UpcycleReport:
  """The surgery's report, traced without reading any data (every check included)."""
  dense = {p: jax.ShapeDtypeStruct(paths.shape_of(x), x.dtype)
           for p, x in paths.flatten(dense_params).items()}
  reports = []

  def trace(tree):
    params, report = upcycle(tree, target, experts=experts, router=router,
                             rng=jax.random.PRNGKey(seed), cast=cast)
    reports.append(report)
    return params

  jax.eval_shape(trace, paths.unflatten(dense))
  return reports[-1]


def _copy_fn(leaf: Any, dtype) -> Callable[[], np.ndarray]:
  def compute():
    x = np.asarray(leaf)
    return x if x.dtype == dtype else np.asarray(jnp.asarray(x).astype(dtype))
  return compute


def leaves(dense_params: Mapping[str, Any], target: Mapping[str, Any], report: UpcycleReport, *,
           experts: Union[str, ExpertInit] = 'copy', router: Union[str, RouterInit] = 'normal',
           seed: int = 0, cast: bool = False) -> Dict[str, Any]:
  """The target tree with every leaf a `_Leaf` that computes it on demand."""
  dense = paths.flatten(dense_params)
  tgt = paths.flatten(target)
  roles = paths.classify(tgt)
  by_path = {e.path: e for e in report.entries}
  layers: Dict[str, list] = {}
  for path, role in roles.items():
    if role.kind != 'copy':
      layers.setdefault(role.layer, []).append(path)
  settings = dict(experts=experts, router=router, rng=jax.random.PRNGKey(seed), cast=cast)
  out = {}
  for members in layers.values():
    sources = {by_path[p].source for p in members if by_path[p].source}
    block = _Block(dense, sources, paths.unflatten({p: tgt[p] for p in members}), settings)
    for path in members:
      out[path] = _Leaf(tgt[path].shape, tgt[path].dtype, functools.partial(block.pop, path))
  for path, entry in by_path.items():
    if entry.action == COPIED:
      out[path] = _Leaf(tgt[path].shape, tgt[path].dtype,
                        _copy_fn(dense[entry.source], np.dtype(tgt[path].dtype)))
  return paths.unflatten({path: out[path] for path in tgt})


def write(directory: str, step: int, tree: Mapping[str, Any]) -> None:
  """Writes `directory/<step>/params` from a tree of `_Leaf`s, one leaf in memory at a time."""
  registry = ocp.type_handlers.create_type_handler_registry((_Leaf, _StreamingHandler()))
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(directory, options=options, item_names=(PARAMS,),
                                  item_handlers={PARAMS: handler})
  try:
    manager.save(int(step), args=ocp.args.Composite(**{PARAMS: ocp.args.PyTreeSave(tree)}))
    manager.wait_until_finished()
  finally:
    manager.close()

