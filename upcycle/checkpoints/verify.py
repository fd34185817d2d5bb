"""Reads every array of a checkpoint, one at a time, to prove that its data is all there.

Metadata (what `inspect` prints) can be intact while a data file is missing or truncated;
only reading finds that. The first unreadable leaf raises a CheckpointError naming the
parameter and the file.
"""

from typing import Any, List, Optional

import jax
import numpy as np

from upcycle import progress
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.lazy import LazyArray


def _lazy(tree: Any) -> List[LazyArray]:
  return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, LazyArray)]


def _read(lazy: List[LazyArray], done: Optional[progress.Progress] = None) -> int:
  """Reads each array (and drops it), counting them in `done`; returns how many."""
  for leaf in lazy:
    np.asarray(leaf)
    if done is not None:
      done.update(1)
  return len(lazy)


def verify_tree(tree: Any) -> int:
  """Reads each LazyArray leaf of `tree`; returns how many were read."""
  return _read(_lazy(tree))


def verify(ckpt: Checkpoint) -> int:
  """Reads every parameter and optimizer-state array of `ckpt` (progress: arrays read, rate,
  ETA); returns how many."""
  lazy = _lazy(ckpt.params) + _lazy(ckpt.optimizer_state)
  done = progress.Progress('verify', 'arrays', total=len(lazy))
  count = _read(lazy, done)
  done.finish()
  return count
