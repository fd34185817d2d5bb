"""A param tree made by taking the leaves of another: by path, whole or along one axis.

Growing a trained checkpoint, with more experts (`expert_growth.py`) or more layers
(`depth_growth.py`), makes every target leaf from one source leaf:

  target P  <- source S (P itself, or the same leaf of another layer), whole, or
               jnp.take(S, index, axis): experts `[E, ...] -> [E', ...]` with index =
               (0, ..., E-1, the sources of the new experts), router `[d, E] -> [d, E']`

A `Remap` is decided from shapes alone (every check runs before anything is read), prints
as its report, and runs eagerly or under `jax.jit` (`run`); the optimizer state follows the
same takes (`remap_optimizer.py`).
"""

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import tree


@dataclasses.dataclass(frozen=True)
class Take:
  """One target leaf and the source leaf it is taken from.

  Attributes:
    path: the target path.
    source: the source path.
    shape: the target shape.
    source_shape: the source shape.
    axis: the axis taken along; None takes the whole source leaf.
    index: the source position of every target position along `axis`.
  """

  path: str
  source: str
  shape: Tuple[int, ...]
  source_shape: Tuple[int, ...]
  axis: Optional[int] = None
  index: Tuple[int, ...] = ()

  def __call__(self, value: Any) -> Any:
    """The target value from the source value (or any array of the source's shape).

    jax arrays (and tracers) give jax arrays; numpy and lazy arrays are read and taken on
    the host, giving numpy arrays.
    """
    if isinstance(value, jax.Array):
      return value if self.axis is None else jnp.take(value, jnp.asarray(self.index), self.axis)
    x = np.asarray(value)
    return x if self.axis is None else np.take(x, self.index, self.axis)

  def describe(self) -> str:
    if self.axis is None:
      return '' if self.source == self.path else f'<- {self.source}'
    return f'axis {self.axis} <- {list(self.index)}'


@dataclasses.dataclass(frozen=True)
class Remap:
  """Every target leaf's source, and where the run starts.

  Attributes:
    title: what was done, for the report ('grow experts', 'grow depth').
    takes: one per target leaf, in target order.
    unused: source leaves nothing is taken from.
    notes: one line per grown MoE block or layer stack.
    step: the step the grown model starts at.
  """

  title: str
  takes: Tuple[Take, ...]
  unused: Tuple[str, ...]
  notes: Tuple[str, ...]
  step: int = 0

  def by_path(self) -> Dict[str, Take]:
    return {t.path: t for t in self.takes}

  def __str__(self) -> str:
    moved = sum(t.axis is not None or t.source != t.path for t in self.takes)
    lines = [f'{self.title}: {len(self.takes)} target leaves, {moved} grown or taken from '
             f'another path, {len(self.takes) - moved} copied; {len(self.unused)} source '
             f'leaves unused.'] + [f'  {n}' for n in self.notes]
    rows = [(t.path, str(t.shape), t.describe()) for t in self.takes if t.describe()]
    if rows:
      widths = [max(len(r[i]) for r in rows) for i in range(2)]
      lines.append('')
      lines += ['  '.join((r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2])) for r in rows]
    if self.unused:
      lines += ['', 'source leaves left unused:'] + [f'  {p}' for p in self.unused]
    return '\n'.join(line.rstrip() for line in lines)


def checked(path: str, leaf: Any, source: str, source_leaf: Any, fix: str) -> Take:
  """The whole-leaf take of `path` from `source`, whose shape and dtype must be the target's."""
  if source_leaf is None:
    raise ValueError(f'Target leaf {path} {tree.shape_of(leaf)} is taken from the checkpoint '
                     f'leaf {source}, which does not exist. Fix: {fix}.')
  for what, want, got in (('shape', tree.shape_of(leaf), tree.shape_of(source_leaf)),
                          ('dtype', jnp.dtype(leaf.dtype).name,
                           jnp.dtype(source_leaf.dtype).name)):
    if want != got:
      raise ValueError(f'Target leaf {path} has {what} {want} but checkpoint leaf {source} has '
                       f'{got}. Fix: {fix}.')
  return Take(path, source, tree.shape_of(leaf), tree.shape_of(source_leaf))


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


def run(remap: Remap, source: Mapping[str, Any]) -> Dict[str, Any]:
  """The target param tree (nested, in target order); traceable under `jax.jit`.

  Args:
    remap: the remap.
    source: nested or flat dict of source values (numpy, lazy or jax arrays, or tracers).
  """
  flat = tree.flatten(source)
  return tree.unflatten({t.path: t(flat[t.source]) for t in remap.takes})
