"""Checkpoint readers and writers, one file per format; `load` picks the format from the files.

  ckpt = upcycle.checkpoints.load('gs://bucket/t5_1_1_base/checkpoint_1000000')
  ckpt.params                      # this project's names, numpy leaves
  upcycle.checkpoints.load(path, lazy=True).params   # LazyArray leaves, read on demand
"""

import dataclasses
import os
from typing import Optional

from upcycle.checkpoints import formats, hf, orbax, orbax_tree, paths, t5x, validate, vit_npz
from upcycle.checkpoints.checkpoint import Checkpoint, ExpectedFn
from upcycle.checkpoints.errors import CheckpointError, checkpoint_error
from upcycle.checkpoints.lazy import LazyArray, materialize

FORMATS = tuple(formats.FORMATS)
_LOOKED_FOR = [f'{f.name}: {f.looked_for}' for f in formats.FORMATS.values()]


def detect_format(path: str) -> str:
  """The format of `path`, from the files present (nothing is parsed but .npz keys)."""
  path = os.fspath(path)
  if paths.split_gcs(path):
    if hf.is_hf_dir(path):
      return 'hf'
    if orbax.is_step_dir(path) or orbax.run_steps(path):
      return 'orbax'
    return t5x.find_checkpoint(path)[1]
  if os.path.isfile(path):
    if path.endswith('.npz'):
      kind = vit_npz.detect(vit_npz.read_npz(path))
      if kind:
        return kind
    elif os.path.basename(path) == t5x.CHECKPOINT_FILE:
      return 't5x'
  elif os.path.isdir(path):
    if hf.is_hf_dir(path):
      return 'hf'
    if orbax.is_step_dir(path) or orbax.run_steps(path):
      return 'orbax'
    if os.path.isfile(os.path.join(path, t5x.CHECKPOINT_FILE)):
      return 't5x'
    if orbax_tree.is_item_dir(os.path.join(path, t5x.STATE_DIR)):
      return 't5x_orbax'
    try:
      return t5x.find_checkpoint(path)[1]
    except CheckpointError:
      pass
  found = (sorted(os.listdir(path))[:12] if os.path.isdir(path) else
           'a file' if os.path.exists(path) else 'no such file or directory')
  raise checkpoint_error(path, 'unknown checkpoint format', expected='; '.join(_LOOKED_FOR),
                         found=found, fix=f'Pass format= one of {FORMATS} if detection is wrong')


def load(path: str, format: Optional[str] = None,  # pylint: disable=redefined-builtin
         expected: Optional[ExpectedFn] = None, lazy: bool = False,
         with_optimizer_state: bool = True) -> Checkpoint:
  """Reads any supported checkpoint into contract names; nothing is ever written.

  Args:
    path: file or directory (see `detect_format`); T5X and orbax (ours) accept gs:// paths.
    format: one of FORMATS, or None to detect it.
    expected: `description (or None) -> tree of shapes` to check the parameters against
      (names and shapes); a mismatch raises CheckpointError naming the parameter.
      `upcycle.pretrained.load(path, model_config=...)` passes the model's shapes.
    lazy: return LazyArray leaves (shape and dtype now, data on `np.asarray` or
      `leaf.read(index)`), for checkpoints larger than memory; by default every leaf is
      read into a numpy array, usable wherever a jax/numpy array is.
    with_optimizer_state: False leaves the optimizer state out (None), unread (evaluation,
      decoding).

  A run's MODEL_DIR (or its checkpoints/) is read at its latest step, a running trainer's
  too: when retention deletes that step while it is read, the new latest is read instead
  (`orbax.read_live`).
  """
  format = formats.of(format, path).name if format else detect_format(path)

  def finish(ckpt: Checkpoint) -> Checkpoint:
    if not with_optimizer_state:
      ckpt = dataclasses.replace(ckpt, optimizer_state=None)
    shapes = expected(ckpt.description) if expected else None
    if shapes is not None:
      validate.check_params(ckpt.params, shapes, ckpt.path)
    return ckpt if lazy else ckpt.read()

  if format in ('t5x', 't5x_orbax'):
    return finish(t5x.load(path))
  if format == 'orbax':
    return orbax.read_live(path, lambda step_dir: finish(orbax.load(
        step_dir, with_optimizer_state=with_optimizer_state)))
  if format == 'hf':   # checks the shapes itself, naming HuggingFace's tensors
    return hf.load_checkpoint(path, expected, lazy)
  return finish(vit_npz.load(path, lazy=True))   # vit_jax, big_vision


__all__ = ['Checkpoint', 'CheckpointError', 'FORMATS', 'LazyArray', 'detect_format',
           'load', 'materialize']
