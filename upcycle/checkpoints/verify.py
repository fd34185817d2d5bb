"""Reads every array of a checkpoint, one at a time, to prove that its data is all there.

Metadata (what `describe` prints) can be intact while a data file is missing or truncated;
only reading finds that, and only the digests a training step recorded at save
(`digests.py`) find bytes that changed but still decode. The first unreadable or changed
leaf raises a CheckpointError naming the parameter and the file.
"""

from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from upcycle import progress
from upcycle.checkpoints import digests
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import CheckpointError
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.orbax import OPTIMIZER, PARAMS

Entries = Dict[str, Any]   # one item's recorded digests: {path: {'dtype', 'shards'}}


def _lazy(tree: Any, recorded: Optional[Entries] = None) -> List[Tuple[LazyArray, Any]]:
  """(leaf, its recorded digests or None) of each LazyArray leaf."""
  return [(leaf, (recorded or {}).get(leaf.param)) for leaf in jax.tree.leaves(tree)
          if isinstance(leaf, LazyArray)]


def _read(lazy: List[Tuple[LazyArray, Any]], done: Optional[progress.Progress] = None) -> int:
  """Reads each array (and drops it), comparing it with its digests, counting them in `done`;
  returns how many."""
  for leaf, entry in lazy:
    changed = digests.check_array(entry, np.asarray(leaf), leaf.source, leaf.param)
    if changed:
      raise CheckpointError(changed)
    if done is not None:
      done.update(1)
  return len(lazy)


def verify_tree(tree: Any) -> int:
  """Reads each LazyArray leaf of `tree`; returns how many were read."""
  return _read(_lazy(tree))


def verify(ckpt: Checkpoint, recorded: Optional[Dict[str, Entries]] = None) -> int:
  """Reads every parameter and optimizer-state array of `ckpt` (progress: arrays read, rate,
  ETA), comparing each with the digests `recorded` at save (`digests.read`), if given;
  returns how many."""
  recorded = recorded or {}
  lazy = (_lazy(ckpt.params, recorded.get(PARAMS)) +
          _lazy(ckpt.optimizer_state, recorded.get(OPTIMIZER)))
  done = progress.Progress('verify', 'arrays', total=len(lazy))
  count = _read(lazy, done)
  done.finish()
  return count
