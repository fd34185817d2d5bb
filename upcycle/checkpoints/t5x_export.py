"""Writes a training run of ours (orbax, `checkpoints/orbax.py`) as a T5X checkpoint: the
parameters under `optimizer/target`, and a `T5XAdafactor` run's slots as T5X's
`state/param_states` (`python -m upcycle.export` documents the layout and its cases).

The run is only read, one leaf at a time; an output inside its checkpoints, on gs:// or an
existing `checkpoint_<step>` is refused before anything is written (`ExportError`), and a
failed write leaves nothing (`t5x_writer.write`). What is exported is first compared with the
step's digests (`verify.check`), and the output records the digests of what it holds.
"""

import dataclasses
import logging
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from upcycle import checkpoints, tree
from upcycle.checkpoints import orbax, paths, t5x_writer, verify as verify_lib
from upcycle.optimizer_state import adafactor
from upcycle.checkpoints.errors import FULL_DISK

log = logging.getLogger(__name__)


class ExportError(ValueError):
  """An export refused before anything was written."""


class AlreadyExported(ExportError):
  """OUTPUT_DIR/checkpoint_<step> exists already (exports never overwrite)."""


def run_steps(model_dir: str) -> Tuple[str, Dict[int, str]]:
  """(the directory holding the run's step directories, {step: step directory})."""
  model_dir = paths.absolute(model_dir)
  steps = orbax.run_steps(model_dir)
  if steps:
    return os.path.dirname(next(iter(steps.values()))), steps
  raise ExportError(
      f'{model_dir}: no finished checkpoint of a run here. Expected '
      f'{orbax.RUN_CHECKPOINTS}/<step>/ (as the trainer writes) or <step>/ directories, found '
      f'{paths.listdir(model_dir)[:10] or "nothing"}. Fix: pass the run\'s MODEL_DIR as '
      f'--model_dir.')


def pick_step(root: str, steps: Dict[int, str], step: Optional[int]) -> int:
  """`step`, or the latest of `steps` (`run_steps`) when None; ExportError if the run in
  `root` has no such step."""
  step = max(steps) if step is None else int(step)
  if step not in steps:
    raise ExportError(f'{root}: no finished checkpoint for step {step}; the run has steps '
                      f'{sorted(steps)}. Fix: pass one of them as --step, or none for the '
                      f'latest ({max(steps)}).')
  return step


def t5x_param_states(optimizer_state, params: Mapping) -> Optional[dict]:
  """T5X's `param_states` (the stored, lazy leaves) when the run's stored optimizer state is
  `optimizers.T5XAdafactor`'s (`{'count', 'param_states': {<param path>: {v_row, v_col, v,
  m}}}` for exactly the params), else None."""
  if not (isinstance(optimizer_state, Mapping) and
          set(optimizer_state) == {'count', 'param_states'}):
    return None
  stored = tree.flatten(optimizer_state['param_states'])
  wanted = [f'{path}/{slot}' for path in tree.flatten(params) for slot in adafactor.SLOTS]
  if set(stored) != set(wanted):
    return None
  return tree.unflatten({key: stored[key] for key in wanted})


def unrolled_param_states(slots: Mapping, params: Mapping) -> dict:
  """A scanned run's T5X `param_states` unrolled like its parameters (`tree.unroll_scanned`).

  A used slot of a scanned parameter has the layer axis first (`v_row [layers, d_model]`);
  an unused one is T5X's placeholder `[1]` whatever the layers (`adafactor.UNUSED`), so each
  unrolled layer gets a placeholder of its own (T5X's restore wants `[1]` in every slot that
  is not used).
  """
  flat_params = tree.flatten(params)
  layered = {}
  for path, leaf in tree.flatten(slots).items():
    layers = tree.shape_of(flat_params[path.rsplit('/', 1)[0]])[0]
    unused = tree.is_scanned({path: leaf}) and tree.shape_of(leaf) == adafactor.UNUSED.shape
    layered[path] = np.tile(adafactor.UNUSED, (layers, 1)) if unused else leaf
  return tree.unroll_scanned(tree.unflatten(layered))


def check_output(output_dir: str, source: str, *, writer: str, source_name: str) -> None:
  """Refuses, before anything is read or written, an output on gs:// (`writer` writes local
  directories) or inside the checkpoint `source` (`source_name`, which is only ever read)."""
  if paths.is_url(output_dir):
    raise ExportError(f'--output_dir={output_dir}: {writer} writes local directories. '
                      f'Fix: export to a local directory, then copy it (gcloud storage cp -r).')
  if not paths.is_url(source):
    out, source = os.path.realpath(output_dir), os.path.realpath(source)
    if paths.inside(out, source):
      raise ExportError(f'--output_dir={output_dir} lies inside {source_name} {source}, which '
                        f'an export only reads. Fix: choose a directory outside it.')


def written(write: Callable[[], str], *, what: str, nbytes: Callable[[], int]) -> str:
  """`write()`, an exporter's writer (`t5x_writer.write`, `hf_writer.write`; they leave
  nothing behind when they fail), with its refusals and a full disk as one-line ExportErrors:
  `what` is 'Exporting ... to <where>', `nbytes()` what the arrays need."""
  try:
    return write()
  except FileExistsError as e:   # another export into the same place started meanwhile
    raise ExportError(str(e)) from None
  except (OSError, ValueError) as e:
    if not any(marker in str(e) for marker in FULL_DISK):
      raise
    raise ExportError(
        f'{what} failed: no space left on device; the partial checkpoint was removed. It needs up '
        f'to {nbytes() / 2**20:.1f} MiB (the arrays uncompressed). Fix: free space there, or '
        f'pass another --output_dir.') from None


def export(model_dir: str, output_dir: str, step: Optional[int] = None,
           optimizer_state: bool = True, verify: bool = True) -> str:
  """Writes step `step` (default: the latest) of the run in `model_dir` as
  `output_dir/checkpoint_<step>/` in T5X's layout (module docstring); returns that directory.
  With `verify`, what is exported is first compared with the step's digests.

  Raises:
    ExportError: no finished checkpoint in `model_dir`, no step `step`, an output inside the
      run's checkpoints or on gs://; AlreadyExported: the output step exists.
    CheckpointError: the step's bytes differ from its digests (`verify.check`).
  """
  root, steps = run_steps(model_dir)
  output_dir = paths.absolute(output_dir)
  check_output(output_dir, root, writer='the T5X writer', source_name="the run's checkpoints")
  step = pick_step(root, steps, step)
  ckpt = stored = checkpoints.load(steps[step], format='orbax', lazy=True)
  slots = t5x_param_states(ckpt.optimizer_state, ckpt.params)
  if tree.is_scanned(ckpt.params):   # T5X's models are unrolled: layers_{i}
    log.info('%s holds scanned layers: exporting them unrolled (layers_0, layers_1, ...).',
             ckpt.path)
    slots = None if slots is None else unrolled_param_states(slots, ckpt.params)
    ckpt = dataclasses.replace(ckpt, params=tree.unroll_scanned(ckpt.params))
  out_step = step
  if not optimizer_state:
    log.info('Exporting the parameters only (no optimizer state asked for).')
  elif slots is None:
    what = ('has no optimizer state' if ckpt.optimizer_state is None else
            "holds an optimizer state that is not optimizers.T5XAdafactor's, whose slots T5X "
            "could not use")
    log.info('%s %s: exporting the parameters only.', ckpt.path, what)
  else:
    out_step = int(np.asarray(ckpt.optimizer_state['count']))
    if out_step != step:
      log.info("Run step %d: T5X's Adafactor runs on state/step, so the export is at the "
               "optimizer state's count, %d.", step, out_step)
  target = os.path.join(output_dir, f'checkpoint_{out_step}')
  if os.path.exists(target):
    raise AlreadyExported(f'{target} already exists; an export never overwrites. Fix: delete '
                          f'it, or pass another --output_dir.')
  slots = slots if optimizer_state else None
  if verify:   # the arrays as stored (before unrolling), the slots if they are exported
    verify_lib.check(dataclasses.replace(
        stored, optimizer_state=stored.optimizer_state if slots is not None else None))
  arrays = {'params': ckpt.params, 'slots': slots or {}}
  path = written(lambda: t5x_writer.write(output_dir, out_step, ckpt.params, slots),
                 what=f'Exporting step {out_step} to {target}',
                 nbytes=lambda: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                                    for x in tree.flatten(arrays).values()))
  log.info('Wrote %s (T5X, step %d%s).', path, out_step,
           ', with T5X Adafactor state' if slots is not None else '')
  return path
