"""Reads a checkpoint's arrays back to prove that its data is all there and unchanged.

Metadata (what `describe` prints) can be intact while a data file is missing or truncated;
only reading finds that, and only digests (`digests.py`: recorded by every training step at
save, and by `convert` and `export` for what they write) find bytes that changed but still
decode. The first unreadable or changed leaf raises a CheckpointError naming the parameter
and the file.

  verify(ckpt, recorded)   every array read (`describe --verify`)
  check(ckpt)              the arrays that carry digests compared with them: what every reader
                           a user runs calls before using a checkpoint (eval, infer, export,
                           convert, the restore hooks); `--no_verify` (a hook's `verify=False`)
                           skips it, and the refusal says so
  dataset_damage(...)      the same for a step's data position (resume, describe, the hooks)
"""

import os
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from upcycle import progress, tree
from upcycle.checkpoints import digests, formats, hf, orbax
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import CheckpointError
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.orbax import OPTIMIZER, PARAMS

Entries = Dict[str, Any]   # one item's recorded digests: {path: {'dtype', 'shards'}}
Array = Tuple[str, Any, Optional[Dict[str, Any]]]   # (name, leaf, its recorded entry or None)

NO_VERIFY = '--no_verify'


def _arrays(ckpt: Checkpoint, recorded: Dict[str, Entries]) -> List[Array]:
  """Every array of `ckpt`'s parameters and optimizer state (as loaded) that is read lazily
  or has a digest, named as its digests name it: a step of ours by its stored name, a
  HuggingFace directory by its tensors' names (as stored, before the reader transposes
  them: the digests `export` records), other formats by the path in the tree read."""
  if formats.of(ckpt.format).hf_directory and recorded:
    entries = recorded.get(PARAMS, {})
    return [(name, leaf, entries.get(name)) for name, leaf in hf.read_tensors(ckpt.path)[0].items()]
  arrays = []
  for item, items_tree in ((PARAMS, ckpt.params), (OPTIMIZER, ckpt.optimizer_state)):
    entries = recorded.get(item, {})
    if items_tree is None:
      continue
    if formats.of(ckpt.format).run_step:
      arrays += [(leaf.param, leaf, entries.get(leaf.param)) for leaf in jax.tree.leaves(items_tree)
                 if isinstance(leaf, LazyArray)]
    else:
      arrays += [(path, leaf, entries.get(path)) for path, leaf in tree.flatten(items_tree).items()
                 if isinstance(leaf, LazyArray) or path in entries]
  return arrays


def _read(arrays: List[Array], source: str, done: progress.Progress, fix: str = '') -> int:
  """Reads each array (and drops it), comparing it with its digests, counting them in `done`;
  returns how many. A changed one raises CheckpointError ending with `fix`."""
  for name, leaf, entry in arrays:
    changed = digests.check_array(entry, np.asarray(leaf), getattr(leaf, 'source', source), name)
    if changed:
      raise CheckpointError(changed + (f'. {fix}' if fix else ''))
    done.update(1)
  done.finish()
  return len(arrays)


def verify_tree(items_tree: Any) -> int:
  """Reads each LazyArray leaf of `items_tree`; returns how many were read."""
  lazy = [('', leaf, None) for leaf in jax.tree.leaves(items_tree) if isinstance(leaf, LazyArray)]
  return _read(lazy, '', progress.Progress('verify', 'arrays', total=len(lazy)))


COPY_AGAIN = 'Fix: copy the checkpoint again from its source.'


def verify(ckpt: Checkpoint, recorded: Optional[Dict[str, Entries]] = None) -> int:
  """Reads every parameter and optimizer-state array of `ckpt` (progress: arrays read, rate,
  ETA), comparing each with the digests `recorded` for it (`digests.read`), if given;
  returns how many. A changed array's CheckpointError ends with `COPY_AGAIN`."""
  arrays = _arrays(ckpt, recorded or {})
  return _read(arrays, ckpt.path, progress.Progress('verify', 'arrays', total=len(arrays)),
               fix=COPY_AGAIN)


def refusal(skip: str) -> str:
  """The end of every refusal of changed bytes: what to do, and how to read them anyway."""
  return f'{COPY_AGAIN.rstrip(".")}, or pass {skip} to read it as it is.'


def check(ckpt: Checkpoint, skip: str = NO_VERIFY) -> bool:
  """Compares every array of `ckpt` (its parameters, and its optimizer state if it was loaded
  with it) that carries a digest with it, reading each once; whether `ckpt` has digests (one
  without is not read here).

  Raises:
    CheckpointError: one line naming the array whose bytes changed (or the digest file that
      is unreadable), the fix and `skip`, the flag or binding that reads it anyway.
  """
  try:
    recorded = digests.read(ckpt.path)
  except CheckpointError as e:
    raise CheckpointError(f'{str(e).rstrip(".")}; {refusal(skip)}') from e
  if recorded is None:
    return False
  arrays = [array for array in _arrays(ckpt, recorded) if array[2] is not None]
  _read(arrays, ckpt.path, progress.Progress('verify', 'arrays', total=len(arrays)),
        fix=refusal(skip))
  return True


def dataset_state(step_dir: str) -> Optional[dict]:
  """The data position saved with the step at `step_dir` (`orbax.dataset_state`; None if it
  has none). Raises CheckpointError in one line when its `dataset/` item is unreadable."""
  try:
    return orbax.dataset_state(step_dir)
  except Exception as e:  # pylint: disable=broad-except  (orbax and json raise many kinds)
    lines = [line for line in str(e).splitlines() if line.strip()]
    raise CheckpointError(
        f'{os.path.join(step_dir, orbax.DATASET)}: the data position is unreadable '
        f'({type(e).__name__}: {lines[-1][:200] if lines else ""}); the data changed on '
        f'disk') from e


def dataset_damage(step_dir: str, recorded: Optional[Dict[str, Entries]]) -> Optional[str]:
  """Why the data position saved with the step at `step_dir` cannot be used: its `dataset/`
  item is unreadable, or differs from its digest (`recorded`, the step's digests); None if
  it reads and matches, or the step has none."""
  try:
    value = dataset_state(step_dir)
  except CheckpointError as e:
    return str(e)
  if value is None or recorded is None:
    return None
  return digests.check_json(recorded, value, os.path.join(step_dir, orbax.DATASET))
