"""Export a checkpoint: a training run of ours to T5X's native layout (--format=t5x, the
default), or a run or any checkpoint the project reads to a HuggingFace directory (--format=hf).

  python -m upcycle.export --model_dir=/tmp/moe --output_dir=/tmp/moe_t5x \\
    [--step=N] [--no_optimizer_state] [--no_verify]
  python -m upcycle.export --format=hf --model_dir=/tmp/llama --output_dir=/tmp/llama_hf \\
    [--step=N] [--max_shard_size=5GB] [--dtype=bfloat16] [--gin_file=models/llama/tiny.gin]

--model_dir is the run's MODEL_DIR (or the directory holding its `<step>/` checkpoints,
MODEL_DIR/checkpoints); --step defaults to the latest finished step.

Digests: what is exported is first compared with the digests the checkpoint carries (a step
of a run, an output of convert or export), reading each array once; changed bytes stop the
export in one line naming the array, before anything is written (--no_verify exports it as it
is). Either format's output records the CRC-32 of every array it holds in
`digests/process_0.json`, which `python -m upcycle.describe OUTPUT --verify` and every reader
here check.

--format=t5x writes OUTPUT_DIR/checkpoint_<step>/ as T5X's `Checkpointer.save` writes it
(`checkpoints/t5x_writer.py`): the parameters under `optimizer/target` in Flaxformer's (MoE)
names, and

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

--format=hf writes OUTPUT_DIR itself as `save_pretrained` does (`upcycle/hf_export.py`):
config.json, the weights as safetensors (shards of at most --max_shard_size, default 5GB, with
model.safetensors.index.json) in --dtype (bfloat16 or float32; default: the HF source's dtype,
else the stored one), a model card (README.md: the architecture, the source checkpoint and
step, the upcycling report's summary, the steps and tokens trained), and for a Llama-family
model what a chat user needs: the tokenizer the run keeps in MODEL_DIR/tokenizer/ (convert and
training copy an HF source's there) with its chat template and
special_tokens_map, generation_config.json (the source's, else the tokenizer's bos / eos / pad
ids), and in config.json the source's bos / eos (a list stays one) / pad ids and
max_position_embeddings; an MoE with `output_router_logits` true, so HF fine-tuning adds the
load-balancing loss (`router_aux_loss_coef`). A dense Llama is written as LlamaForCausalLM, one
with q/k/v biases alone as Qwen2ForCausalLM, one with a sliding window as MistralForCausalLM; a
dense T5 v1.1 as T5ForConditionalGeneration with its own lm_head, an MoE Llama as
MixtralForCausalLM, or where Mixtral cannot express it (MoE in some layers only, a shared
expert, raw top-k weights, q/k/v biases) as Qwen2MoeForCausalLM (what neither computes, e.g.
capacity that drops tokens, is refused naming the binding). T5 MoE models and ViT are refused
(use --format=t5x). --model_dir may also be one step of a run, a T5X or an HF checkpoint. The
model is gin's MODEL from --gin_file / --gin.KEY=VALUE, else the one the run's saved
MODEL_DIR/config.gin (or operative_config.gin; a convert output's config.gin) binds, its
overrides included, so no gin file need be repeated; an HF checkpoint names its own. Scanned
layers are unrolled. OUTPUT_DIR must not exist or be empty; it is written as OUTPUT_DIR.tmp-*
and renamed when complete (a second export into it while one runs is refused). The tokenizer
is refused in one line when it is not the one the step was trained with (whose digest the
step's data position records); a source without one is exported without, said in the last
line. A source that carries digests is compared with them first (--no_verify skips that).
"""

import argparse
import os
import sys
from typing import Any, List, Optional

from upcycle import (arguments, checkpoints, console, fields, gin_utils, hf_export, reachability,
                     startup)
from upcycle.checkpoints import hf, paths, t5x_export
from upcycle.data.tokenizer import TokenizerError

MODEL_MACRO = 'MODEL'


def build_parser() -> argparse.ArgumentParser:
  """export's own flags; with --format=hf the gin flags (gin_utils.parse_flags) are the rest."""
  parser = arguments.ArgumentParser(
      prog='python -m upcycle.export', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--model_dir', required=True,
                      help="the run's MODEL_DIR (or its checkpoints/ directory); with "
                           '--format=hf also any checkpoint the project reads')
  parser.add_argument('--step', type=int, default=None, help='default: the latest step')
  parser.add_argument('--output_dir', required=True,
                      help='t5x: T5X model directory, checkpoint_<step>/ is written into it; '
                           'hf: the HuggingFace directory itself')
  parser.add_argument('--format', choices=('t5x', 'hf'), default='t5x',
                      help="t5x: T5X's native checkpoint; hf: a HuggingFace directory")
  parser.add_argument('--no_optimizer_state', action='store_true',
                      help='t5x: parameters only, also for a T5XAdafactor run')
  parser.add_argument('--max_shard_size', default=hf_export.DEFAULT_MAX_SHARD_SIZE,
                      help='hf: the largest safetensors file (5GB, 200KB, 2GiB)')
  parser.add_argument('--no_verify', action='store_false', dest='verify',
                      help="export the checkpoint as it is, without comparing it with its "
                           'digests first')
  parser.add_argument('--dtype', choices=hf_export.DTYPES, default=None,
                      help="hf: the weights' dtype (default: the HF source's, else the stored "
                           'one)')
  return parser


def _model_from_gin() -> Any:
  """gin's MODEL: a T5 / Llama / ViT module, or its config."""
  value = gin_utils.macro_value(MODEL_MACRO)
  if value is None:
    raise t5x_export.ExportError(
        f'No gin macro {MODEL_MACRO}: give a model file (e.g. '
        f'--gin_file=models/llama/tiny.gin) that binds {MODEL_MACRO}.')
  return value


def _saved_config(model_dir: str) -> Optional[str]:
  """The config.gin (or operative_config.gin) of the run or `convert` output `model_dir` is,
  or holds (its MODEL_DIR, checkpoints/ or a step); None for an HF checkpoint, which names its
  own model."""
  path = paths.absolute(model_dir)
  if hf.is_hf_dir(path):
    return None
  parent = os.path.dirname(path)
  return gin_utils.saved_config([path, parent, os.path.dirname(parent)])


def _parse_saved_config(path: str) -> None:
  """`gin_utils.parse_saved_config`, its failures one ExportError line."""
  try:
    gin_utils.parse_saved_config(path)
  except (ValueError, ImportError, AttributeError, SyntaxError) as e:
    text = gin_utils.message(e).strip()
    former = gin_utils.former_hint(text)   # a config written before a rename
    if former:
      raise t5x_export.ExportError(f'{path}: {former}') from None
    raise t5x_export.ExportError(
        f'{path}: the run\'s model cannot be read from its saved gin config '
        f'({text.splitlines()[0]}). Fix: give the gin files of its model, e.g. '
        f'--gin_file=models/llama/tiny.gin.') from None


def main(argv: Optional[List[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  console.show_progress()
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  if rest and args.format != 'hf':
    parser.error(f'unrecognized arguments: {" ".join(rest)} (gin flags go with --format=hf)')
  if reachability.refused({'--model_dir': args.model_dir}):
    return 1
  startup.ready()
  try:
    if args.format == 't5x':
      t5x_export.export(args.model_dir, args.output_dir, step=args.step,
                        optimizer_state=not args.no_optimizer_state, verify=args.verify)
      return 0
    model_config = None
    gin_args, bindings = gin_utils.parse_flags(rest, 'gin flags of python -m upcycle.export')
    saved = None if gin_args.gin_file or bindings else _saved_config(args.model_dir)
    if gin_args.gin_file or bindings or saved:   # else the checkpoint names its model (HF)
      import gin  # pylint: disable=g-import-not-at-top
      gin.clear_config()   # each call parses its own flags
      if saved:
        _parse_saved_config(saved)
      else:
        gin_utils.parse_gin(gin_args, bindings, read=(MODEL_MACRO,))
      model_config = _model_from_gin()
    hf_export.export(args.model_dir, args.output_dir, model_config=model_config,
                     step=args.step, max_shard_size=args.max_shard_size, verify=args.verify,
                     dtype=args.dtype)
  except (t5x_export.ExportError, checkpoints.CheckpointError, fields.ConfigError,
          TokenizerError) as e:
    print(gin_utils.one_line(e, argv), file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  startup.begin()
  sys.exit(main())
