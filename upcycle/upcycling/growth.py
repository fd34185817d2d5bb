"""What growing a trained checkpoint, with more experts (`expert_growth.py`) or more layers
(`depth_growth.py`), shares: a plan (`plan.Plan`) without MoE blocks to initialize, whose every
target leaf is taken from one checkpoint leaf:

  target P  <- source S (P itself, or the same leaf of another layer), whole, or
               jnp.take(S, index, axis): experts `[E, ...] -> [E', ...]` with index =
               (0, ..., E-1, the sources of the new experts), router `[d, E] -> [d, E']`

so it runs through the plan's executors (eagerly, inside the restore hook's sharded jit, to
disk) and prints as the plan's report; the optimizer state follows the same ops
(`optimizer_state/carry.py`).
"""

from typing import Any, Mapping, Optional, Sequence, Tuple

import jax.numpy as jnp

from upcycle import leaf_ops, tree
from upcycle.upcycling.plan import Leaf, Plan


def taken(path: str, leaf: Any, source: str, source_leaf: Any, fix: str,
          axis: Optional[int] = None, index: Tuple[int, ...] = ()) -> Leaf:
  """The target leaf `path` taken from checkpoint leaf `source`: whole (shape and dtype must be
  the target's) or along `axis` at `index` (the dtype must be the target's)."""
  if source_leaf is None:
    raise ValueError(f'Target leaf {path} {tree.shape_of(leaf)} is taken from the checkpoint '
                     f'leaf {source}, which does not exist. Fix: {fix}.')
  checks = [('dtype', jnp.dtype(leaf.dtype).name, jnp.dtype(source_leaf.dtype).name)]
  if axis is None:
    checks.insert(0, ('shape', tree.shape_of(leaf), tree.shape_of(source_leaf)))
  for what, want, got in checks:
    if want != got:
      raise ValueError(f'Target leaf {path} has {what} {want} but checkpoint leaf {source} has '
                       f'{got}. Fix: {fix}.')
  op = leaf_ops.COPY if axis is None else leaf_ops.Take(axis, tuple(index))
  return Leaf(path, tree.shape_of(leaf), jnp.dtype(leaf.dtype).name, source,
              tree.shape_of(source_leaf), op=op)


def grown(leaves: Sequence[Leaf], source: Mapping[str, Any], notes: Sequence[str],
          step: int) -> Plan:
  """The growth plan of `leaves` (one per target leaf, in target order) from the flat
  checkpoint tree `source`; `notes` say what grew, one line per block or stack."""
  used = {leaf.source for leaf in leaves}
  return Plan(copies=tuple(leaves), blocks=(), unused=tuple(p for p in source if p not in used),
              experts=None, router=None, shared='copy', order=tuple(l.path for l in leaves),
              step=int(step), notes=tuple(notes))


def source_indices(spec: Any, *, count: int, bound: int, binding: str, expected: str,
                   grows: str, what: str, fix: str) -> Tuple[int, ...]:
  """`spec` read as `count` source positions, each in [0, bound), or a one-line error.

  Args:
    spec: a sequence of ints (from gin or Python).
    count, bound: how many, and the exclusive upper bound of each.
    binding: the name of `spec` in errors.
    expected: what `spec` may be, for a spec that is no list ('one of (...) or a list ...').
    grows: what grows, for the error ('mlp, which grows from 2 to 4 experts').
    what: what the positions are ('source indices').
    fix: what to do instead.
  """
  try:
    indices = tuple(int(i) for i in spec)
  except (TypeError, ValueError):
    raise ValueError(f'{binding}={spec!r}: expected {expected}.') from None
  if len(indices) != count or any(not 0 <= i < bound for i in indices):
    raise ValueError(f'{binding}={list(indices)} for {grows}: expected {count} {what}, each in '
                     f'[0, {bound}). Fix: {fix}.')
  return indices
