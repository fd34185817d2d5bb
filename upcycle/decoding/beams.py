"""Batch-first pytrees with a beam axis: expand `[batch, ...]` to `[batch * beams, ...]`,
reorder beams. Scalars (e.g. a decoding cache's `position`) are shared and left alone."""

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
PyTree = Any


def expand(tree: PyTree, beams: int) -> PyTree:
  """`[batch, ...]` -> `[batch * beams, ...]`, each example repeated `beams` times in a row."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beams, axis=0), tree)


def gather(tree: PyTree, indices: Array) -> PyTree:
  """Reorders flat beams: `[batch * old_beams, ...]` -> `[batch * new_beams, ...]`.

  `indices` `[batch, new_beams]` names, per example, the old beam each new beam copies.
  """
  batch, new_beams = indices.shape

  def take(x):
    if x.ndim == 0:
      return x
    grouped = x.reshape((batch, -1) + x.shape[1:])
    picked = grouped[jnp.arange(batch)[:, None], indices]
    return picked.reshape((batch * new_beams,) + x.shape[1:])

  return jax.tree.map(take, tree)


def take_beams(x: Array, indices: Array) -> Array:
  """`[batch, old_beams, ...]` -> `[batch, new_beams, ...]` by `indices` `[batch, new_beams]`."""
  return x[jnp.arange(x.shape[0])[:, None], indices]
