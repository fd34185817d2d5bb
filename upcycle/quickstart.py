"""python -m upcycle.quickstart: the whole sparse-upcycling story on the offline default.

1. pretrain a tiny dense T5 v1.1 on span corruption over the source of the pinned numpy,
   scipy, scikit-learn and matplotlib (`data/offline_packages_span_corruption.gin`: ~25 MB of
   training text, read once; the same text on every machine that installs setup.py's pins);
2. keep training the dense model for EXTRA steps (the baseline), reading the data on from where
   the pretraining stopped (`RESTORE_DATASET=True`), so no training sequence is read twice;
3. upcycle the dense checkpoint (every other layer; Expert Choice encoder, Top-2 decoder;
   copied experts, normalized combine weights and the dense optimizer state tiled, so the
   MoE starts at the dense model's loss, up to the tokens T5X's capacity drops; the routers
   drawn from Sparse Upcycling's N(0, 0.02^2) scaled to this width: the recipe is
   `runs/upcycle_main_job.gin`) and train it
   for the same EXTRA steps, continuing the dense schedule and reading on like the dense run.
   Both continuations use a 4x larger batch than the pretraining (64 sequences): at the
   pretraining's 16 each expert sees few tokens per step (`python -m upcycle.study --suite
   trails` compares the batch sizes over seeds);
4. print a table (validation loss/accuracy of both; the upcycled model's loss at its
   first step vs the dense model's), under it the corpus's sha256 and whether it is the pinned
   corpus the README's table was measured on, and save both curves to OUTPUT_DIR/curves.png.
Every evaluation reads the same EVAL_SEQUENCES sequences of the validation split (modules kept
out of training), shuffled by the seed.

Every stage is a real `python -m upcycle.train` run with the gin files under configs/, its
CPU code generated for SSE4.2 on every x86-64 host (`platforms.portable_cpu_codegen`: with
the host's FMA and estimate instructions XLA's code rounds by the host), so the table repeats
digit for digit on every image of this kind of machine.
"""

import json
import os
import subprocess
import sys
import time
from typing import Dict, List

from upcycle import arguments, platforms, startup

COMMON = ['--gin_file=data/offline_packages_span_corruption.gin',
          '--gin.trainer.TrainConfig.log_every=10',
          '--gin.trainer.TrainConfig.checkpoint_every=100',
          '--gin.trainer.TrainConfig.eval_every=50',
          '--gin.trainer.TrainConfig.eval_at_start=True',
          '--gin.validation/text.TextPipeline.shuffle=True']


def stage(name: str, model_dir: str, *, steps: int, batch_size: int, eval_sequences: int,
          gin_files: List[str], extra: List[str], seed: int) -> None:
  """One `python -m upcycle.train` run; its evaluations read the first `eval_sequences` of the
  shuffled validation split (rounded up to whole batches)."""
  eval_batches = -(-eval_sequences // batch_size)
  command = [sys.executable, '-m', 'upcycle.train', '--gin_file=models/t5_1_1/tiny.gin',
             *[f'--gin_file={f}' for f in gin_files], *COMMON,
             f"--gin.MODEL_DIR='{model_dir}'", f'--gin.TRAIN_STEPS={steps}', f'--gin.SEED={seed}',
             f'--gin.BATCH_SIZE={batch_size}',
             f'--gin.trainer.TrainConfig.eval_batches={eval_batches}', *extra]
  print(f'\n=== {name}: {" ".join(command[1:])}', flush=True)
  start = time.time()
  subprocess.run(command, check=True, env=platforms.portable_cpu_codegen(os.environ))
  print(f'=== {name} done in {time.time() - start:.0f} s', flush=True)


def read_metrics(model_dir: str) -> Dict[str, List[dict]]:
  rows = [json.loads(line) for line in open(os.path.join(model_dir, 'metrics.jsonl'))]
  by_split = {'train': {}, 'eval': {}}
  for row in rows:   # warnings are rows too (split 'warning')
    if row['split'] in by_split:
      by_split[row['split']][row['step']] = row
  return {split: [rows[s] for s in sorted(rows)] for split, rows in by_split.items()}


def plot(curves: Dict[str, Dict[str, List[dict]]], pretrain_steps: int, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for (label, metrics), color in zip(curves.items(), ('tab:blue', 'tab:orange', 'tab:green')):
    train, evals = metrics['train'], metrics['eval']
    axes[0].plot([r['step'] for r in train], [r['loss'] for r in train], color=color, label=label)
    axes[1].plot([r['step'] for r in evals], [r['loss'] for r in evals], 'o-', color=color,
                 label=label)
  for ax, title in zip(axes, ('training loss', 'validation loss')):
    ax.axvline(pretrain_steps, color='gray', linestyle=':', label='upcycling point')
    ax.set_xlabel('step')
    ax.set_title(title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def corpus_line(model_dir: str) -> str:
  """The line under the table: the corpus the run in `model_dir` read (its corpus.json, an
  `offline_text.corpus_record`) and whether it is the pinned one, the README's."""
  from upcycle.train import run_summary  # pylint: disable=g-import-not-at-top
  corpus = run_summary.read_corpus(model_dir)
  if corpus is None:
    return 'corpus: not an offline corpus read from files (no digest recorded)'
  verdict = ("the README's" if corpus['matches'] else
             "NOT the README's: these numbers are not comparable with its table")
  return f'corpus: {run_summary.corpus_words(corpus)}: {verdict}'


def main(argv=None) -> None:
  parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--output_dir', default='runs/quickstart')
  parser.add_argument('--pretrain_steps', type=int, default=200)
  parser.add_argument('--extra_steps', type=int, default=300)
  parser.add_argument('--pretrain_batch_size', type=int, default=16,
                      help='BATCH_SIZE of the pretraining')
  parser.add_argument('--extra_steps_batch_size', type=int, default=64,
                      help='BATCH_SIZE of both continuations; it divides the PRETRAIN_BATCH_SIZE '
                           'x PRETRAIN_STEPS sequences the continuations read on after')
  parser.add_argument('--num_experts', type=int, default=8)
  parser.add_argument('--eval_sequences', type=int, default=1536,
                      help='validation sequences per evaluation (the split shuffled by the seed)')
  parser.add_argument('--seed', type=int, default=0,
                      help='SEED of every stage: initialization, data order, upcycling draws')
  args = parser.parse_args(argv)
  startup.ready()
  out = os.path.abspath(args.output_dir)
  dense, continued, moe = (os.path.join(out, d) for d in ('dense', 'dense_continued', 'moe'))
  total = args.pretrain_steps + args.extra_steps
  common = dict(eval_sequences=args.eval_sequences, seed=args.seed)
  stage('1/3 pretrain dense', dense, steps=args.pretrain_steps,
        batch_size=args.pretrain_batch_size, gin_files=['runs/pretrain.gin'], extra=[], **common)
  continuation = dict(steps=total, batch_size=args.extra_steps_batch_size, **common)
  checkpoint = [f"--gin.INITIAL_CHECKPOINT_PATH='{os.path.join(dense, 'checkpoints')}'",
                '--gin.RESTORE_DATASET=True']
  stage('2/3 continue dense', continued, gin_files=['runs/continue_dense.gin'],
        extra=checkpoint, **continuation)
  stage('3/3 upcycle and train MoE', moe,
        gin_files=['runs/upcycle_main_job.gin'],
        extra=checkpoint + [f'--gin.NUM_EXPERTS={args.num_experts}'], **continuation)

  curves = {'dense (pretrain)': read_metrics(dense), 'dense (continued)': read_metrics(continued),
            f'upcycled MoE (E={args.num_experts})': read_metrics(moe)}
  first = lambda m: m['eval'][0]
  last = lambda m: m['eval'][-1]
  loss = lambda row: f'{row["loss"]:.4f} ± {row["loss_stderr"]:.4f}' if 'loss_stderr' in row else (
      f'{row["loss"]:.4f}')
  dense_c, moe_m = curves['dense (continued)'], curves[f'upcycled MoE (E={args.num_experts})']
  table = [
      ('', 'dense', 'upcycled MoE'),
      (f'validation loss ± s.e. at step {args.pretrain_steps} (start)',
       loss(first(dense_c)), loss(first(moe_m))),
      (f'validation loss ± s.e. at step {total}', loss(last(dense_c)), loss(last(moe_m))),
      (f'validation accuracy at step {total}', f'{last(dense_c)["accuracy"]:.4f}',
       f'{last(moe_m)["accuracy"]:.4f}'),
      ('train loss, last logged step', f'{dense_c["train"][-1]["loss"]:.4f}',
       f'{moe_m["train"][-1]["loss"]:.4f}'),
  ]
  widths = [max(len(row[i]) for row in table) for i in range(3)]
  lines = ['  '.join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
  print('\n' + '\n'.join(lines))
  print(corpus_line(dense))
  png = os.path.join(out, 'curves.png')
  plot(curves, args.pretrain_steps, png)
  summary = {row[0]: {'dense': row[1], 'moe': row[2]} for row in table[1:]}
  with open(os.path.join(out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  print(f'\nCurves: {png}\nSummary: {os.path.join(out, "summary.json")}')


if __name__ == '__main__':
  startup.begin()
  main()
