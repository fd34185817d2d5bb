"""Describe a checkpoint without loading its data: format, step, sizes, tree, model.

  python -m upcycle.describe PATH [--format F] [--json] [--verify]
  python -m upcycle.describe HF_DIR --gin

Only metadata is read (shapes and dtypes), so this is cheap on any checkpoint size.
--verify then reads every array (parameters and optimizer state, one at a time) and exits
with status 1 naming the parameter and the file if any data is missing or unreadable, or an
array's bytes differ from the CRC-32 recorded when it was written (by a training step, or by
convert or export for their outputs; a checkpoint without digests says so); for a training
step also if an item it was saved with is gone, or its data position (dataset/) is unreadable
or differs from its digest.

PATH may be a step that a running trainer deletes meanwhile (it keeps its last
TrainConfig.keep_checkpoints steps): that is said, with exit status 0, not reported as damage.
A step that resume set aside (MODEL_DIR/corrupt_checkpoints/<step>-<time>) is inspected as
any step is.

--gin prints the model file of a HuggingFace directory (Llama, Mistral, Qwen2, Mixtral): what
`--gin_file=models/hf.gin --gin.HF_MODEL=...` builds from its config.json, as a gin file to
keep or edit (`upcycle.hf_model.gin_file`).
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import numpy as np
from etils import epath

from upcycle import (arguments, checkpoints, console, fields, hf_model, pretrained, reachability,
                     startup, tree)
from upcycle.checkpoints import describe, digests, formats, orbax, paths, verify


def summary(ckpt: checkpoints.Checkpoint) -> Dict[str, Any]:
  """The facts `describe` prints, as a JSON-ready dict."""
  params = tree.leaves_by_path(ckpt.params)
  optimizer = tree.leaves_by_path(ckpt.optimizer_state)
  return {
      'path': ckpt.path,
      'format': ckpt.format,
      'step': ckpt.step,
      'num_parameters': int(sum(int(np.prod(x.shape)) for x in params.values())),
      'num_bytes': int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                           for x in params.values())),
      'num_arrays': len(params),
      'optimizer_state': ckpt.optimizer_state is not None,
      'optimizer_arrays': len(optimizer),
      'model': _model(ckpt.params),
      'model_config': repr(ckpt.model_config) if ckpt.model_config is not None else None,
      'notes': list(ckpt.notes),
      'params': [{'path': p, 'shape': list(x.shape), 'dtype': str(np.dtype(x.dtype))}
                 for p, x in sorted(params.items())],
  }


def _model(params: Any) -> str:
  """What the parameters are; a scanned layout is described as the layers it unrolls to."""
  if not tree.is_scanned(params):
    return describe.describe(params)
  return f'{describe.describe(tree.unroll_scanned(params))}; layers stored scanned'


def _human(num_bytes: int) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if num_bytes < 1024 or unit == 'GiB':
      return f'{num_bytes:.1f} {unit}' if unit != 'B' else f'{num_bytes} B'
    num_bytes /= 1024
  return ''


def format_text(info: Dict[str, Any]) -> str:
  lines = [
      f"path:            {info['path']}",
      f"format:          {info['format']}",
      f"step:            {info['step']}",
      f"parameters:      {info['num_parameters']:,} in {info['num_arrays']} arrays, "
      f"{_human(info['num_bytes'])}",
      f"optimizer state: " + (f"yes ({info['optimizer_arrays']} arrays)"
                              if info['optimizer_state'] else 'no'),
      f"model:           {info['model']}",
  ]
  lines += [f'note:            {n}' for n in info['notes']]
  width = max([len(p['path']) for p in info['params']] + [4])
  lines.append('parameter tree:')
  lines += [f"  {p['path']:<{width}}  {str(tuple(p['shape'])):<20} {p['dtype']}"
            for p in info['params']]
  return '\n'.join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = arguments.ArgumentParser(prog='python -m upcycle.describe', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('path', help='checkpoint file or directory (T5X, orbax, HF, .npz)')
  parser.add_argument('--format', choices=checkpoints.FORMATS, default=None,
                      help='skip format detection')
  parser.add_argument('--json', action='store_true', help='print JSON instead of text')
  parser.add_argument('--verify', action='store_true',
                      help='read every array to check that all data is present')
  parser.add_argument('--gin', action='store_true',
                      help="print an HF directory's model as a gin file (models/hf.gin's model)")
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  console.show_progress(info_to='stderr')   # stdout holds the report (or its JSON)
  args = build_parser().parse_args(argv)
  path = args.path
  if reachability.refused({'path': path}):
    return 1
  if args.gin:
    try:
      print(hf_model.gin_file(path, named=path), end='', flush=True)
    except fields.ConfigError as e:
      print(f'error: {e}', file=sys.stderr)
      return 1
    return 0
  startup.ready()
  existed = epath.Path(path).exists()
  try:
    ckpt = pretrained.load(path, format=args.format, lazy=True)
    path = ckpt.path   # a MODEL_DIR's latest step
    info = summary(ckpt)
    print(json.dumps(info, indent=1) if args.json else format_text(info), flush=True)
    if args.verify:
      print(_verified(ckpt), file=sys.stderr)
  except checkpoints.CheckpointError as e:
    if existed and orbax.vanishing(path):
      print(f'note: {path} was deleted by retention while being read (a running trainer keeps '
            f'its last TrainConfig.keep_checkpoints steps); that is not damage. Inspect a newer '
            f'step.', file=sys.stderr)
      return 0
    print(f'error: {e}', file=sys.stderr)
    return 1
  return 0


def _verified(ckpt: checkpoints.Checkpoint) -> str:
  """Reads every array of `ckpt`, checking a training step's items and its data position, and
  the digests of any checkpoint that has them (a training step, an output of convert or
  export); the line saying what was verified. Raises CheckpointError naming what is damaged."""
  run_step = formats.of(ckpt.format).run_step
  if run_step:
    missing = orbax.missing_items(ckpt.path)
    if missing:
      raise checkpoints.checkpoint_error(
          ckpt.path, f'damaged: {" and ".join(f"{item}/" for item in missing)} '
          f'{"is" if len(missing) == 1 else "are"} missing, saved with the step',
          fix='The checkpoint copy is incomplete; copy the step again from its source')
  recorded = digests.read(ckpt.path)
  count = verify.verify(ckpt, recorded)
  if run_step:
    damaged = verify.dataset_damage(ckpt.path, recorded)
    if damaged:
      raise checkpoints.CheckpointError(
          f'{damaged}. The checkpoint copy is corrupt; copy the step again from its source.')
  when = 'the step was saved' if run_step else 'it was written'
  if recorded is None:
    why = ('saved before they were recorded' if run_step else
           'written before they were recorded, or by another program')
    return (f'verified: all {count} arrays read back complete. This '
            f'{"step" if run_step else "checkpoint"} carries no digests ({why}): '
            f'changed bytes that still decode are not found.')
  return (f'verified: all {count} arrays read back complete and match the digests recorded '
          f'when {when}.')


if __name__ == '__main__':
  startup.begin()
  sys.exit(main())
