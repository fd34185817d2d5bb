"""python -m upcycle.study --out docs/: re-run the papers' claims and write docs/RESULTS.md.

Trains every arm of every claim (`upcycle.study.runs`) for each seed on the offline data (T5:
span corruption over Python's documentation; ViT: scikit-learn's digits), two runs at a time,
into --runs_dir (an interrupted study continues where it stopped), then writes
OUT/RESULTS.md with one table per claim, OUT/results/*.png and OUT/results/study.json.
--quick: a few arms, one seed, a few steps (a smoke test of the whole pipeline, ~2 minutes).
"""

import argparse
import datetime
import os
import platform
import sys
import time

from upcycle.study import drop_units, execute, render, runs as runs_lib
from upcycle.study.curves import Results
from upcycle.study.scale import FULL, QUICK

QUICK_ARMS = {'t5': ('pretrain', 'moe', 'dense', 'scratch'), 'vit': ('pretrain', 'moe')}
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(scale, quick: bool):
  """All runs of the study, in the order they are started: arm by arm (every seed of an arm
  before the next arm), the papers' claims first, so that a study stopped early has whole
  arms."""
  out = []
  for seed in scale.seeds:
    out += runs_lib.t5_runs(scale, seed) + runs_lib.vit_runs(scale, seed)
  if quick:
    out = [r for r in out if r.arm in QUICK_ARMS[r.family]]
  first = [(f, a) for f in ('t5', 'vit') for a in ('pretrain', 'moe', 'dense')]
  beyond = set(runs_lib.BEYOND_T5) | {'depth'}
  order = {}
  for r in out:    # the first appearance of an arm fixes its place within its group
    order.setdefault((r.family, r.arm), len(order))

  def rank(r):
    key = (r.family, r.arm)
    group = (0 if key in first else 1 if r.family == 'vit' else 3 if r.arm in beyond else 2)
    return group, first.index(key) if key in first else order[key], r.seed

  return sorted(out, key=rank)


def header(args, scale, runs, seconds: float) -> str:
  done = [os.path.join(r.directory(args.runs_dir), execute.DONE) for r in runs]
  done = [p for p in done if os.path.exists(p)]
  run_time = sum(float(open(p).read() or 0) for p in done)
  first = min(os.path.getmtime(os.path.join(os.path.dirname(p), 'study.json')) for p in done)
  span = max(os.path.getmtime(p) for p in done) - first
  command = 'python -m upcycle.study ' + ' '.join(a for a in sys.argv[1:] if a != '--render_only')
  partial = (f' **This file was written with `--render_only` from the {len(done)} runs finished '
             f'so far; arms without every seed finished are marked "not finished".**'
             if len(done) < len(runs) else '')
  return f"""# Results: the papers' claims at CPU scale

Regenerate with `{command}` (from the repository root): {len(runs)} training runs, {len(done)}
finished, {run_time / 60:.0f} minutes of run time in all, {span / 60:.0f} minutes from the first
run's start to the last run's end, {args.jobs} at a time, on {os.cpu_count()} CPU cores
({platform.machine()}, Python {platform.python_version()}); the last invocation took
{seconds / 60:.0f} minutes; written {datetime.date.today().isoformat()}.{partial}

**Setting.** Language: the tiny T5 v1.1 of the main job (`models/t5_1_1/tiny.gin`, 4+4 layers,
d_model 64, byte vocabulary) trained with span corruption on the offline corpus (Python's own
documentation) with T5X's Adafactor and rsqrt schedule; dense pretraining P = {scale.t5_pretrain_steps}
steps, then X = {scale.t5_extra_steps} extra steps; batch {scale.t5_batch_size or 16}. Vision: the tiny ViT
(`models/vit/tiny.gin`, 4 blocks, width 64) on scikit-learn's 8x8 handwritten digits (1,797 real
scans, upsampled to 16x16), big_vision's Adafactor, schedule over P + X = {scale.vit_pretrain_steps} +
{scale.vit_extra_steps} steps. Every MoE arm has E = {scale.num_experts} experts unless named otherwise;
the language arms use the paper's T5X/Flaxformer conventions (`moe/paper_t5.gin`), the vision
arms V-MoE's (`moe/paper_vit.gin`). Seeds {', '.join(map(str, scale.seeds))}: each seed
pretrains its own dense model and runs every arm from it, so arms are compared seed by seed.

**Measurements.** Validation loss / accuracy on the whole validation split (T5: 12 batches of 16
sequences of text never seen in training; ViT: the held-out digits), every
{scale.eval_every} steps and at each run's start. Training FLOPs are counted per step from the
model config and the routing capacity (`upcycle.models.flops`, logged as
`train_flops_per_step`); "at equal extra FLOPs" means the dense continuation runs as many steps
as cost what the upcycled model spent in X steps; "at equal total FLOPs" interpolates both arms'
curves at the FLOPs where the cheaper one ended, dense pretraining included. **Verdicts**
(`upcycle.study.claims`): d = the seed-paired difference (positive when the first-named arm is
better), s.e. = std(d)/sqrt(n); 'yes' when the paper's direction holds by more than 2 s.e.,
'no' when the opposite does, 'not resolved' otherwise. After a verdict that is not 'yes', the
most likely reason.

## Claims
"""


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='docs', help='where RESULTS.md and results/ go')
  parser.add_argument('--runs_dir', default='runs/study', help='the training runs')
  parser.add_argument('--quick', action='store_true', help='a few arms, one seed, a few steps')
  parser.add_argument('--jobs', type=int, default=2, help='training runs at a time')
  parser.add_argument('--render_only', action='store_true',
                      help='write RESULTS.md from the runs finished so far; train nothing')
  args = parser.parse_args(argv)
  args.runs_dir = os.path.abspath(args.runs_dir)
  scale = QUICK if args.quick else FULL
  runs = plan(scale, args.quick)
  start = time.time()
  failed = [] if args.render_only else execute.run_all(runs, args.runs_dir, scale,
                                                       jobs=args.jobs, repository=REPOSITORY)
  results = Results(args.runs_dir, scale.seeds)
  units = drop_units.statistics(
      os.path.join(args.runs_dir, 't5', 'pretrain', f'seed{scale.seeds[0]}', 'checkpoints',
                   str(scale.t5_pretrain_steps)),
      'encoder/layers_1/mlp', scale.num_experts, (0.5, 1.0), seed=scale.seeds[0])
  arms = {family: {arm: runs_lib.DESCRIPTIONS[family][arm] for arm in
                   dict.fromkeys(r.arm for r in runs if r.family == family)}
          for family in ('t5', 'vit')}
  path = render.write(args.out, results, header(args, scale, runs, time.time() - start), arms,
                      units)
  print(f'study: wrote {path}', flush=True)
  if failed:
    sys.exit(f'study: {len(failed)} runs failed or could not start: {", ".join(failed)} '
             f'(see their study.failed); run the same command again to retry them.')


if __name__ == '__main__':
  main()
