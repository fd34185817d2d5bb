"""python -m upcycle.lm_eval --checkpoint=... --tasks=...: score a decoder-only checkpoint on
lm-evaluation-harness tasks without exporting it.

  python -m upcycle.lm_eval --checkpoint=/tmp/llama_hf --tasks=hellaswag,openbookqa \\
    --output_dir=/tmp/llama_hf_lm_eval
  python -m upcycle.lm_eval --checkpoint=/tmp/moe/checkpoints/300 --tasks=triviaqa \\
    --num_fewshot=4 --gin_file=models/llama/tiny.gin --gin_file=moe/mixtral.gin \\
    --num_expert_partitions=2 --output_dir=/tmp/moe/lm_eval

--checkpoint is any checkpoint `upcycle.pretrained.load` reads: an HF directory (it names its
model), or a run's checkpoints/ (its latest step) or one of its steps, or another format, with
the gin files of its model (--gin_file, --gin.KEY=VALUE: the files it was trained with, MoE
and scan_layers included). Its parameters are placed on a mesh of all devices
(--num_expert_partitions, --num_model_partitions) by --logical_axis_rules ('default', or
'fsdp': split over 'data' x 'expert' too), all three as in training, and every request runs
there (`upcycle.harness`: the scores lm-eval's HuggingFace backend gives on the exported model).
The tokenizer is the checkpoint's own (an HF directory's, a run's tokenizer/), or
--tokenizer's, refused in one line when it is not the one the weights were trained with.
The checkpoint is read as `python -m upcycle.eval` reads one (`pretrained.load_on_mesh`): a
running trainer's MODEL_DIR at its latest step, read again at the new latest step when
retention deletes it mid-read; a checkpoint that carries digests (a step of a training run, an
output of convert or export) is first compared with them, reading every parameter once:
changed bytes stop it in one line naming the array. --no_verify skips that and scores the
checkpoint as it is.

--tasks are lm-eval task or group names, comma-separated; --include_path adds a directory of
task YAML files (a local JSONL as `dataset_path: json`, `dataset_kwargs: {data_files: ...}`).
lm-eval downloads a named task's data set on first use. --num_fewshot, --limit (examples per
task; below 1 a fraction), --gen_kwargs (a generation task's arguments, e.g.
max_gen_toks=64) are lm-eval's own. Generation is greedy; a task that samples is refused.

Prints the scores ('<task>/<metric>', '<task>/<metric>/<filter>' for a filter other than
lm-eval's 'none'); with --output_dir writes them with the checkpoint and lm-eval's own
results (per task: its scores, n-shot, version) as eval_results.json, appends a row to
metrics.jsonl and writes TensorBoard scalars (tensorboard/eval) at the checkpoint's step, as
`python -m upcycle.eval` does; --log_samples adds each task's requests and responses as
samples/<task>.jsonl. Errors a user can cause end in one line and exit status 1.
"""

import argparse
import sys
from typing import List, Optional

from upcycle import console, fields, gin_utils, startup


def build_parser() -> argparse.ArgumentParser:
  """lm_eval's own flags; the gin flags (gin_utils.parse_flags) are the rest."""
  parser = argparse.ArgumentParser(
      prog='python -m upcycle.lm_eval', description=__doc__, allow_abbrev=False,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help="an HF directory, a run's checkpoints/ or one of its steps, any "
                           'format upcycle.pretrained.load reads (with --gin_file: its model)')
  parser.add_argument('--tasks', required=True, help='lm-eval task names, comma-separated')
  parser.add_argument('--format', default=None, help='checkpoint format (default: detected)')
  parser.add_argument('--tokenizer', default=None,
                      help="default: the checkpoint's own (an HF directory's, a run's tokenizer/)")
  parser.add_argument('--include_path', default=None, help='a directory of task YAML files')
  parser.add_argument('--num_fewshot', type=int, default=None, help="default: the task's")
  parser.add_argument('--limit', type=float, default=None,
                      help='examples per task (below 1: a fraction); default: all')
  parser.add_argument('--gen_kwargs', default=None,
                      help="generation arguments over the tasks', e.g. max_gen_toks=64")
  parser.add_argument('--batch_size', type=int, default=8, help='requests per batch')
  parser.add_argument('--max_length', type=int, default=None,
                      help="the longest row scored; default: lm-eval's hf backend's for the "
                           "exported config.json (max_position_embeddings, else the HF class's)")
  parser.add_argument('--max_gen_toks', type=int, default=256,
                      help="new tokens per generation at most, unless the task says")
  parser.add_argument('--num_expert_partitions', type=int, default=1)
  parser.add_argument('--num_model_partitions', type=int, default=1)
  parser.add_argument('--logical_axis_rules', default='default',
                      help="where the parameters live on the mesh, the training run's "
                           "LOGICAL_AXIS_RULES: 'default' or 'fsdp' (split over 'data' x "
                           "'expert' too)")
  parser.add_argument('--output_dir', default=None,
                      help='eval_results.json, metrics.jsonl and tensorboard/ go here')
  parser.add_argument('--log_samples', action='store_true',
                      help='also write samples/<task>.jsonl to --output_dir')
  parser.add_argument('--no_tensorboard', action='store_true')
  parser.add_argument('--no_verify', action='store_false', dest='verify',
                      help='score the checkpoint as it is, without comparing it with its '
                           'digests first')
  return parser


def main(argv: Optional[List[str]] = None) -> int:
  """Parses the flags and runs `harness.evaluate_checkpoint`; 0, or 1 after one line."""
  argv = sys.argv[1:] if argv is None else list(argv)
  console.show_progress()
  args, rest = build_parser().parse_known_args(argv)
  # pylint: disable=g-import-not-at-top  (lm-eval's imports are heavy: only when run)
  from upcycle import harness
  from upcycle.checkpoints import CheckpointError
  from upcycle.data.tokenizer import TokenizerError
  # pylint: enable=g-import-not-at-top
  try:
    gin_args, bindings = gin_utils.parse_flags(rest, 'gin flags of python -m upcycle.lm_eval')
    model_config = None
    if gin_args.gin_file or bindings:   # else the checkpoint names its model (HF)
      import gin  # pylint: disable=g-import-not-at-top
      gin.clear_config()   # each call parses its own flags
      gin_utils.parse_gin(gin_args, bindings, read=(harness.MODEL_MACRO,))
      model_config = gin_utils.macro_value(harness.MODEL_MACRO)
    startup.ready()
    harness.evaluate_checkpoint(
        args.checkpoint, args.tasks, model_config=model_config, format=args.format,
        tokenizer=args.tokenizer, include_path=args.include_path,
        num_fewshot=args.num_fewshot, limit=args.limit, gen_kwargs=args.gen_kwargs,
        batch_size=args.batch_size, max_length=args.max_length,
        max_gen_toks=args.max_gen_toks, num_expert_partitions=args.num_expert_partitions,
        num_model_partitions=args.num_model_partitions,
        logical_axis_rules=args.logical_axis_rules, output_dir=args.output_dir,
        log_samples=args.log_samples, tensorboard=not args.no_tensorboard, verify=args.verify)
  except (fields.ConfigError, CheckpointError, TokenizerError, harness.HarnessError) as e:
    print(gin_utils.one_line(e, argv), file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  startup.begin()
  sys.exit(main())
