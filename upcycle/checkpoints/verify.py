"""Reads every array of a checkpoint, one at a time, to prove that its data is all there.

Metadata (what `inspect` prints) can be intact while a data file is missing or truncated;
only reading finds that. The first unreadable leaf raises a CheckpointError naming the
parameter and the file.
"""

from typing import Any

import jax
import numpy as np

from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.lazy import LazyArray


def verify_tree(tree: Any) -> int:
  """Reads each LazyArray leaf of `tree` (and drops it); returns how many were read."""
  count = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, LazyArray):
      np.asarray(leaf)
      count += 1
  return count


def verify(ckpt: Checkpoint) -> int:
  """Reads every parameter and optimizer-state array of `ckpt`; returns how many."""
  return verify_tree(ckpt.params) + verify_tree(ckpt.optimizer_state)
