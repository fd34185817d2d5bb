"""What a plan does to one leaf: applied to a parameter and to each optimizer slot of it alike.

  Copy()              the source as it is
  Tile(count)         the source repeated along a new leading axis, `[*s] -> [count, *s]`
                      (experts' moments from the dense MLP's)
  Take(axis, index)   the source at `index` along `axis`: grown experts and layers copy old
                      ones, a narrower shared expert keeps the first d_ff units
  Fresh()             nothing of the source: the leaf as its initializer makes it (routers;
                      their slots as `optimizer.init` makes them)

An op also says where it moves each of the source's axes (`moves`), so a factored second
moment, which keeps some of its parameter's axes, can be carried by applying the op to the
factors (`on_factor`) wherever the op only moves axes the layout factors over.
"""

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np


def _numpy_for(x: Any):
  """jnp for jax arrays and tracers, numpy for numpy and lazily read arrays."""
  return jnp if isinstance(x, jax.Array) else np


@dataclasses.dataclass(frozen=True)
class Copy:
  """The source as it is."""

  def apply(self, x: Any) -> Any:
    return x

  def shape(self, source_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(source_shape)

  def moves(self, axis: int) -> Optional[int]:
    """Where the source's `axis` lands in the result; None: the op reads along it."""
    return axis

  def on_factor(self, x: Any, kept: Tuple[int, ...]) -> Any:
    """The op applied to a factor of the source that keeps the source's axes `kept`."""
    return x

  def note(self) -> str:
    return ''


@dataclasses.dataclass(frozen=True)
class Tile:
  """`count` copies of the source along a new leading axis."""

  count: int

  def apply(self, x: Any) -> Any:
    xp = _numpy_for(x)
    x = xp.asarray(x)
    return xp.broadcast_to(x[None], (self.count,) + x.shape)

  def shape(self, source_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return (self.count,) + tuple(source_shape)

  def moves(self, axis: int) -> Optional[int]:
    return axis + 1

  def on_factor(self, x: Any, kept: Tuple[int, ...]) -> Any:
    return self.apply(x)

  def note(self) -> str:
    return f'tiled x{self.count}'


@dataclasses.dataclass(frozen=True)
class Take:
  """The source at `index` along `axis` (`jnp.take`)."""

  axis: int
  index: Tuple[int, ...]

  def apply(self, x: Any) -> Any:
    xp = _numpy_for(x)
    return xp.take(xp.asarray(x), xp.asarray(self.index), axis=self.axis)

  def shape(self, source_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    shape = list(source_shape)
    shape[self.axis] = len(self.index)
    return tuple(shape)

  def moves(self, axis: int) -> Optional[int]:
    return None if axis == self.axis else axis

  def on_factor(self, x: Any, kept: Tuple[int, ...]) -> Any:
    xp = _numpy_for(x)
    return xp.take(xp.asarray(x), xp.asarray(self.index), axis=kept.index(self.axis))

  def note(self) -> str:
    return f'axis {self.axis} <- {list(self.index)}'


@dataclasses.dataclass(frozen=True)
class Fresh:
  """Nothing of the source: the target's initializer decides."""

  def note(self) -> str:
    return 'fresh'


Op = Any  # Copy | Tile | Take | Fresh
COPY = Copy()
FRESH = Fresh()
