"""The fit table: the paper's upcycled models, and dense Llamas, compiled for Cloud TPU v4 slices
with upcycle.aot.

  python benchmarks/tpu_fit.py [--rows t5-base-v4-64,...] [--workdir /tmp/tpu_fit]

Each row is one `python -m upcycle.aot` run (a subprocess), with the gin files and bindings the
row's `launch/tpu_vm.py train` command passes: the train step, the upcycling restore hook and
the eval step compiled by the TPU compiler (libtpu) for the slice, one device per chip. The
restore hook reads a dense T5X checkpoint of the model's size written here with names and
shapes only (`t5x_writer` with abstract leaves: no array data). Prints a markdown table and
writes benchmarks/results/tpu_fit.json (every row's upcycle.aot JSON and command).

T5 v1.1 + `moe/paper_t5.gin` (E = 32 in every other layer), batch 256 x 512/114 (T5X's t5_1_1
pretraining examples), on a mesh with data 2 with two copies of each expert
(`grouping.Flaxformer.num_expert_replicas = 2`, Flaxformer's rule there); ViT +
`moe/paper_vit.gin` (E = 32 in every other block), batch 4096 at 224 x 224 (the paper's vision
batch, big_vision's). bfloat16 activations and full remat (the model gins' pod defaults),
layers scanned (`--gin.SCAN_LAYERS=True`: a pod compiles unrolled layers too, only slower). The
ViT rows restore without the dense optimizer state (`runs/vit_upcycle.gin` reuses it; a scanned
model cannot take unrolled slots, and the checkpoint written here has none). Llama-3.2-1B and
Llama-3.1-8B: dense pretraining (runs/llm_pretrain.gin, AdamW) at batch 128 x 4096 tokens,
bfloat16 activations, full remat, scanned layers, `LOGICAL_AXIS_RULES='fsdp'` (parameters and
AdamW moments split over 'data'), gradient accumulation where the step needs it; no restore
hook. Llama -> Mixtral (`drop-8x1.5b`, `drop-8x3.7b`, `llama3.1-8x8b`): the same with
`moe/mixtral.gin` (8 experts in every layer, top 2, dropless 'ragged' with megablox's kernels),
8 expert partitions (the dropless block expert parallel, `upcycle/moe/exchange.py`); the
`-ragged-dot` rows multiply with `jax.lax.ragged_dot` instead, the `-indices` rows hold every token
in capacity slots. A row that does not fit is still a row (`upcycle.aot` exits 2 with its JSON
written). `--merge FILE` keeps the rows of an earlier JSON that this run does not redo.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, NamedTuple, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from upcycle import aot  # pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
T5 = ('--gin_file=moe/paper_t5.gin', '--gin_file=runs/upcycle.gin', '--gin.BATCH_SIZE=256',
      "--gin.MIXTURE_OR_TASK_NAME='c4_span_corruption'")
# The dense checkpoint written here has no optimizer state to reuse (names and shapes only).
VIT = ('--gin_file=moe/paper_vit.gin', '--gin_file=runs/vit_upcycle.gin',
       '--gin.BATCH_SIZE=4096', '--gin.restore.Restore.reuse_optimizer_state=False')
LLAMA = ('--gin_file=runs/llm_pretrain.gin', '--gin.BATCH_SIZE=128',
         "--gin.TASK_FEATURE_LENGTHS={'targets': 4096}", "--gin.ACTIVATION_DTYPE='bfloat16'",
         "--gin.REMAT_POLICY='full'", "--gin.LOGICAL_AXIS_RULES='fsdp'",
         "--gin.MIXTURE_OR_TASK_NAME='offline_stdlib_text'")
# Llama -> Mixtral (moe/mixtral.gin: E = 8, top 2, every layer, dropless 'ragged' dispatch with
# megablox's kernels), trained as the Llamas above; '-ragged-dot' rows multiply with
# jax.lax.ragged_dot instead, '-indices' rows hold every token in capacity slots.
MIXTRAL = LLAMA + ('--gin_file=moe/mixtral.gin',)
INDICES = ("--gin.moe.MoeConfig.dispatch='indices'",)
RAGGED_DOT = ("--gin.moe.MoeConfig.grouped_kernel='ragged_dot'",)
SLICES = {'v4-32': 'v4:2x2x4', 'v4-64': 'v4:2x4x4', 'v4-128': 'v4:4x4x4',
          'v4-256': 'v4:4x4x8'}   # name: topology


class Row(NamedTuple):
  model_gin: str
  family: Tuple[str, ...]           # the family's gin files and bindings
  tpu: str                          # the Cloud TPU name, a key of SLICES
  expert_partitions: int
  model_partitions: int = 1
  upcycles: bool = True             # restores (upcycles) a dense checkpoint written here


def _rows(name: str, model_gin: str, family: Tuple[str, ...],
          layouts: Dict[str, Tuple[int, int, Tuple[str, ...]]],
          upcycles: bool = True) -> Dict[str, Row]:
  """{'<name>-<slice>': Row} for {slice: (expert partitions, model partitions, more flags)}."""
  return {f'{name}-{tpu}': Row(model_gin, family + extra, tpu, experts, model, upcycles)
          for tpu, (experts, model, extra) in layouts.items()}


def _microbatches(n: int) -> Tuple[str, ...]:
  return () if n == 1 else (f'--gin.trainer.TrainConfig.num_microbatches={n}',)


EVEN = {'v4-32': (16, 1, ()), 'v4-64': (32, 1, ()), 'v4-128': (32, 1, ())}
# On data 2 x expert 32 the T5 stacks route as Flaxformer does there: R = 2 copies of each
# expert, so 64 groups split over the 64 batch shards (with R = 1, 32 groups span 2 devices
# each: T5 Base's train step accessed 163 GB per chip instead of 52).
FLAXFORMER_R2 = tuple(f'--gin.{stack}/grouping.Flaxformer.num_expert_replicas=2'
                      for stack in ('encoder', 'decoder'))
T5_EVEN = {**EVEN, 'v4-128': (32, 1, FLAXFORMER_R2)}
ROWS = {
    **_rows('t5-base', 'models/t5_1_1/base.gin', T5, T5_EVEN),
    **_rows('t5-large', 'models/t5_1_1/large.gin', T5, T5_EVEN),
    **_rows('t5-xl', 'models/t5_1_1/xl.gin', T5, {
        'v4-32': (8, 2, ('--gin.trainer.TrainConfig.num_microbatches=2',)),
        'v4-64': (32, 1, ()), 'v4-128': (32, 2, ())}),
    **_rows('vit-b16', 'models/vit/b16.gin', VIT, {t: EVEN[t] for t in ('v4-64', 'v4-128')}),
    **_rows('vit-l16', 'models/vit/l16.gin', VIT, {t: EVEN[t] for t in ('v4-64', 'v4-128')}),
    **_rows('llama3.2-1b', 'models/llama/llama3_2_1b.gin', LLAMA, {
        'v4-32': (1, 1, _microbatches(2)), 'v4-64': (1, 1, ()), 'v4-128': (1, 1, ())},
        upcycles=False),
    # The loss's logits 8 slices of the sequence at a time (LOSS_CHUNKS), against the row
    # above whose whole float32 logits need 2 microbatches (and the 8B's below).
    **_rows('llama3.2-1b-loss8', 'models/llama/llama3_2_1b.gin', LLAMA + ('--gin.LOSS_CHUNKS=8',),
            {'v4-32': (1, 1, ())}, upcycles=False),
    **_rows('llama3.2-1b-loss8-mb2', 'models/llama/llama3_2_1b.gin',
            LLAMA + ('--gin.LOSS_CHUNKS=8',), {'v4-32': (1, 1, _microbatches(2))}, upcycles=False),
    **_rows('llama3.1-8b', 'models/llama/llama3_1_8b.gin', LLAMA, {
        'v4-32': (1, 1, _microbatches(4)), 'v4-64': (1, 1, _microbatches(2)),
        'v4-128': (1, 1, ())}, upcycles=False),
    **_rows('llama3.1-8b-loss8-mb2', 'models/llama/llama3_1_8b.gin',
            LLAMA + ('--gin.LOSS_CHUNKS=8',), {'v4-64': (1, 1, _microbatches(2))}, upcycles=False),
    **_rows('drop-8x1.5b', 'models/llama/drop_upcycling_1_5b.gin', MIXTRAL, {
        'v4-64': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('drop-8x1.5b-ragged-dot', 'models/llama/drop_upcycling_1_5b.gin',
            MIXTRAL + RAGGED_DOT, {
        'v4-64': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('drop-8x1.5b-indices', 'models/llama/drop_upcycling_1_5b.gin', MIXTRAL + INDICES, {
        'v4-64': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('drop-8x3.7b', 'models/llama/drop_upcycling_3_7b.gin', MIXTRAL, {
        'v4-128': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('drop-8x3.7b-ragged-dot', 'models/llama/drop_upcycling_3_7b.gin',
            MIXTRAL + RAGGED_DOT, {
        'v4-128': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('drop-8x3.7b-indices', 'models/llama/drop_upcycling_3_7b.gin', MIXTRAL + INDICES, {
        'v4-128': (8, 1, _microbatches(4))}, upcycles=False),
    **_rows('llama3.1-8x8b', 'models/llama/llama3_1_8b.gin', MIXTRAL, {
        'v4-128': (8, 1, _microbatches(16)), 'v4-256': (8, 1, _microbatches(4))},
        upcycles=False),
    **_rows('llama3.1-8x8b-ragged-dot', 'models/llama/llama3_1_8b.gin',
            MIXTRAL + RAGGED_DOT, {
        'v4-128': (8, 1, _microbatches(8)), 'v4-256': (8, 1, _microbatches(4))},
        upcycles=False),
    **_rows('llama3.1-8x8b-indices', 'models/llama/llama3_1_8b.gin', MIXTRAL + INDICES, {
        'v4-128': (8, 1, _microbatches(8))}, upcycles=False),
}


def dense_checkpoint(model_gin: str, workdir: str) -> str:
  """A dense T5X checkpoint of `model_gin`'s size with names and shapes only (cached)."""
  directory = os.path.join(workdir, 'dense', os.path.basename(model_gin)[:-4] +
                           ('_vit' if '/vit/' in model_gin else '_t5'))
  if os.path.isdir(os.path.join(directory, 'checkpoint_1000000')):
    return os.path.join(directory, 'checkpoint_1000000')
  import dataclasses  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top
  from upcycle import gin_utils, tree  # pylint: disable=g-import-not-at-top
  from upcycle.models import families  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import t5x_writer  # pylint: disable=g-import-not-at-top
  from upcycle.convert import target_from_gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_utils.parse_files_and_bindings([model_gin], [], finalize=False)
  config = dataclasses.replace(target_from_gin(), scan_layers=False)
  dense = (dataclasses.replace(config, encoder_moe=None, decoder_moe=None)
           if hasattr(config, 'encoder_moe') else dataclasses.replace(config, moe=None))
  return t5x_writer.write(directory, 1_000_000, tree.unbox(families.abstract_params(dense)))


def flags(name: str, workdir: str):
  """The row's training flags (what `launch/tpu_vm.py train -- ...` passes)."""
  row = ROWS[name]
  restore = ([f"--gin.INITIAL_CHECKPOINT_PATH='{dense_checkpoint(row.model_gin, workdir)}'"]
             if row.upcycles else [])
  return [f'--gin_file={row.model_gin}', *row.family, '--gin.SCAN_LAYERS=True',
          f"--gin.MODEL_DIR='gs://BUCKET/{name}'", '--gin.TRAIN_STEPS=1100000', *restore,
          f'--gin.trainer.TrainConfig.num_expert_partitions={row.expert_partitions}',
          f'--gin.trainer.TrainConfig.num_model_partitions={row.model_partitions}']


def run_row(name: str, workdir: str) -> dict:
  topology = SLICES[ROWS[name].tpu]
  output = os.path.join(workdir, f'{name}.json')
  command = [sys.executable, '-m', 'upcycle.aot', f'--topology={topology}',
             f'--json={output}', *flags(name, workdir)]
  start = time.perf_counter()
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, 'XLA_FLAGS': ''})
  if done.returncode not in (aot.FITS, aot.DOES_NOT_FIT, aot.NOT_COMPILED):
    return {'name': name, 'error': done.stderr.strip().splitlines()[-1]}
  result = json.loads(open(output).read())
  return {'name': name, 'seconds': time.perf_counter() - start, 'command': command[2:],
          **result}


def table(rows) -> str:
  head = ('| model, slice | mesh d×e×m | params | opt state | temp | total / HBM | fits | '
          'model TFLOP / step | TFLOP, GB / chip | roofline | MFU max | compile |\n'
          '|---|---|---|---|---|---|---|---|---|---|---|---|')
  lines = [head]
  for row in rows:
    if 'error' in row:
      lines.append(f'| {row["name"]} | error: {row["error"]} |||||||')
      continue
    mesh = '×'.join(str(row['mesh'][k]) for k in ('data', 'expert', 'model'))
    for fn in ('train_step', 'restore_hook', 'eval_step'):
      if fn not in row['functions'] and fn not in row['not_compiled']:
        continue
      if fn not in row['functions']:
        lines.append(f'| {row["name"]} {fn} | {mesh} | {row["not_compiled"].get(fn, "")} '
                     f'|||||||')
        continue
      r = row['functions'][fn]
      b = r['per_device_bytes']
      flops = r['model_flops_per_step']
      seconds, mfu, bound = (r.get(k) for k in ('roofline_seconds', 'mfu_at_roofline',
                                                  'roofline_bound'))
      roofline = '' if seconds is None else f'{seconds * 1e3:.0f} ms ({bound})'
      work = r['flops_per_device'] + r.get('kernel_flops_per_device', 0.0)
      counts = (f'{work / 1e12:.1f}, '
                f'{r.get("bytes_accessed_per_device", 0) / 1e9:.0f}')
      lines.append(
          f'| {row["name"]} {fn} | {mesh} | {b["parameters"] / GIB:.2f} | '
          f'{b.get("optimizer_state", 0) / GIB:.3f} | {b["temp"] / GIB:.2f} | '
          f'{b["total"] / GIB:.2f} / {r["hbm_bytes_per_device"] / GIB:.0f} | '
          f'{"yes" if r["fits"] else "**no**"} | '
          f'{"" if flops is None else f"{flops / 1e12:.0f}"} | {counts} | '
          f'{roofline} | '
          f'{"" if mfu is None else f"{100 * mfu:.0f}%"} | {r["compile_seconds"]:.0f} s |')
  return '\n'.join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default=','.join(ROWS), help=f'comma-separated: {list(ROWS)}')
  parser.add_argument('--workdir', default='/tmp/tpu_fit')
  parser.add_argument('--output', default=os.path.join(REPO, 'benchmarks', 'results',
                                                       'tpu_fit.json'))
  parser.add_argument('--merge', default=None, help='an earlier tpu_fit.json to keep rows of')
  return parser


def main() -> None:
  args = build_parser().parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  names = args.rows.split(',')
  kept = json.loads(open(args.merge).read()) if args.merge else []
  rows = [row for row in kept if row['name'] not in names]
  for i, name in enumerate(names):
    start = time.perf_counter()
    rows.append(run_row(name, args.workdir))
    print(f'[{i + 1}/{len(names)}] {name}: {time.perf_counter() - start:.0f} s '
          f'{rows[-1].get("error", "")}', flush=True)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, 'w') as f:
      json.dump(rows, f, indent=2)
  print(table(sorted(rows, key=lambda row: list(ROWS).index(row['name']))))


if __name__ == '__main__':
  main()
