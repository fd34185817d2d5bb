"""Dense checkpoint leaves read straight onto the mesh, each device reading only its block.

The restore hook feeds the dense leaves to one jitted surgery whose outputs are
sharded like the MoE state. Its inputs are placed by shardings derived from the
outputs they feed:

  copied leaf P         <- the sharding of target leaf P (same shape)
  dense MLP leaf X/Y    <- the sharding of X/expert/Y without its leading
                           (expert) axis, e.g. P('expert', None, 'model') ->
                           P(None, 'model'): the dense MLP is split over
                           'model' like each expert, and replicated over
                           'expert' (every expert group needs all of it);
                           the shared expert X/shared_expert/Y reads it
                           there too (without X/expert/Y: like its own leaf)

so no device holds more of a dense leaf than its expert needs, and no host
ever holds E copies. A mesh axis that does not divide a dimension is dropped
from that dimension (replicated instead of failing).
"""

from typing import Any, Callable, Dict, Mapping, Tuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from upcycle.checkpoints.lazy import LazyArray
from upcycle.upcycling.plan import Plan


def _axis_size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([mesh.shape[a] for a in axes]))


def fit(sharding: NamedSharding, shape: Tuple[int, ...], drop_leading: bool = False
        ) -> NamedSharding:
  """`sharding` for an array of `shape`: spec entries that do not divide their dim dropped.

  Args:
    sharding: a NamedSharding of the target leaf.
    shape: the shape of the array to place.
    drop_leading: drop the spec's first entry (the expert axis of `[E, ...]`).
  """
  spec = list(sharding.spec)
  if drop_leading:
    spec = spec[1:]
  spec = (spec + [None] * len(shape))[:len(shape)]
  spec = [axes if dim % _axis_size(sharding.mesh, axes) == 0 else None
          for axes, dim in zip(spec, shape)]
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def replicated(sharding: NamedSharding) -> NamedSharding:
  return NamedSharding(sharding.mesh, PartitionSpec())


def source_shardings(plan: Plan, target: Mapping[str, Any]) -> Dict[str, NamedSharding]:
  """{dense path: sharding} for every dense leaf the plan makes something from.

  Args:
    plan: the upcycling plan (which target leaf comes from which dense leaf).
    target: flat {path: leaf with .sharding} of the target params.
  """
  out = {}
  for leaf in plan.copies:
    out.setdefault(leaf.source, fit(target[leaf.path].sharding, leaf.source_shape))
  for block in plan.blocks:
    for leaf in block.experts.values():
      out.setdefault(leaf.source, fit(target[leaf.path].sharding, leaf.source_shape,
                                      drop_leading=True))
    for leaf in block.shared.values():
      out.setdefault(leaf.source, fit(target[leaf.path].sharding, leaf.source_shape))
  return out


def _block_reader(leaf: Any) -> Callable[[Tuple[slice, ...]], np.ndarray]:
  """index -> leaf[index], each distinct block read once (replicas share one read).

  A leaf that cannot read blocks (e.g. a transposed HF tensor) is read whole,
  once, and sliced.
  """
  blocks: Dict[Any, np.ndarray] = {}
  by_block = isinstance(leaf, LazyArray) and leaf.reads_blocks and leaf.ndim

  def read(index):
    key = tuple((s.start, s.stop, s.step) for s in index) if by_block else None
    if key not in blocks:
      blocks[key] = np.asarray(leaf.read(index) if by_block else np.asarray(leaf))
    return blocks[key] if by_block else np.asarray(blocks[key][index])

  return read


def read(leaf: Any, sharding: NamedSharding) -> jax.Array:
  """A dense leaf (numpy, LazyArray) as a global jax.Array placed by `sharding`.

  Only the blocks of this process's devices are read (`LazyArray.read(index)`),
  so on a pod each host reads its part of the checkpoint; the blocks are
  released once the array is on its devices.
  """
  shape = tuple(int(d) for d in np.shape(leaf))
  return jax.make_array_from_callback(shape, sharding, _block_reader(leaf))
