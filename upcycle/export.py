"""Export a training run of ours to T5X's native checkpoint layout.

  python -m upcycle.export --model_dir=/tmp/moe --output_dir=/tmp/moe_t5x \\
    [--step=N] [--no_optimizer_state]

--model_dir is the run's MODEL_DIR (or the directory holding its `<step>/` checkpoints,
MODEL_DIR/checkpoints); --step defaults to the latest finished step. Written:
OUTPUT_DIR/checkpoint_<step>/ as T5X's `Checkpointer.save` writes it (`checkpoints/t5x_writer.py`):
the parameters under `optimizer/target` in Flaxformer's (MoE) names, and

  - a run trained with `optimizers.T5XAdafactor`: its slots as T5X's `state/param_states`
    (`{<param path>: {v_row, v_col, v, m}}`, the same layout) and `state/step` = the state's
    count, the step T5X's Adafactor runs on (the run's step unless the run's state says
    otherwise; the directory is named after it);
  - any other optimizer (optax Adafactor, AdamW, ...): the parameters only, with the run's step,
    said in one log line: T5X could not use those slots (restore with
    `fallback_to_scratch`, docs/checkpoints.md, "Restoring in T5X"). So does --no_optimizer_state.

The checkpoint is read one leaf at a time (lazy leaves), so memory holds one array. The run is
only read; an output inside its checkpoint directory, or an existing
OUTPUT_DIR/checkpoint_<step>, is refused before anything is written. A failed export (a full
disk) removes its partial `checkpoint_<step>.tmp-*`; a killed one's is removed by the next
export of that step. The T5X writer writes
local directories: export there, then copy to gs:// (`gcloud storage cp -r`). The trainer
exports its final step the same way with `TrainConfig.export_t5x` (MODEL_DIR/t5x/).
"""

import argparse
import sys
from typing import List, Optional

from upcycle import checkpoints, console, reachability
from upcycle.checkpoints import t5x_export


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m upcycle.export', description=__doc__, allow_abbrev=False,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--model_dir', required=True,
                      help="the run's MODEL_DIR (or its checkpoints/ directory)")
  parser.add_argument('--step', type=int, default=None, help='default: the latest step')
  parser.add_argument('--output_dir', required=True,
                      help='T5X model directory; checkpoint_<step>/ is written into it')
  parser.add_argument('--no_optimizer_state', action='store_true',
                      help='parameters only, also for a T5XAdafactor run')
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  console.show_progress()
  args = build_parser().parse_args(argv)
  if reachability.refused({'--model_dir': args.model_dir}):
    return 1
  try:
    t5x_export.export(args.model_dir, args.output_dir, step=args.step,
                      optimizer_state=not args.no_optimizer_state)
  except (t5x_export.ExportError, checkpoints.CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
