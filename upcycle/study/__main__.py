"""python -m upcycle.study --out docs/: re-run the papers' claims and write docs/RESULTS.md.

Trains every arm of every claim (`upcycle.study.runs`) for each seed on the offline data (T5:
span corruption over the source of the pinned numpy, scipy, scikit-learn and matplotlib, the
'packages' corpus; the Llama: the same text as a causal LM; ViT: scikit-learn's digits), two
runs at a time, into --runs_dir (an interrupted study continues where it stopped), then writes
OUT/RESULTS.md (first the `precondition`: MoE vs dense from scratch at equal FLOPs; the
`regime` suite's headline experiment, one table per claim),
OUT/results/*.png and OUT/results/study.json.
--quick: a few arms, one seed, a few steps (a smoke test of the whole pipeline, ~2 minutes).
"""

import argparse
import datetime
import os
import platform
import sys
import time

from upcycle import arguments, console, startup
from upcycle.study import (drop_render, drop_runs, drop_units, epochs, execute, precondition,
                           recipe, render)
from upcycle.study import runs as runs_lib
from upcycle.study.curves import Results
from upcycle.study.scale import FULL, QUICK

QUICK_ARMS = {'t5': ('pretrain', 'moe', 'dense', 'scratch', *runs_lib.REGIME_ARMS,
                     *recipe.arms(QUICK)),
              'vit': ('pretrain', 'moe'), drop_render.FAMILY: drop_runs.QUICK_ARMS}
DESCRIPTIONS = {**runs_lib.DESCRIPTIONS,
                't5': {**runs_lib.DESCRIPTIONS['t5'], **recipe.descriptions(FULL)},
                drop_render.FAMILY: drop_runs.DESCRIPTIONS}
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SUITES = ('precondition', 'recipe', 'regime', 'claims', 'beyond', 'trails', 'drop')
# {suite: (family, arm) of other suites' runs its section reads}: planned with it.
READS = {'regime': {('t5', arm) for arm in precondition.ARMS['t5']}}


def suite_of(run) -> str:
  """The suite that trains `run`: 'precondition': MoE vs dense from scratch at equal FLOPs
  (`precondition`); 'recipe': the tiny T5's learning-rate sweep (`recipe`); 'regime': the
  paper's headline experiment in its regime (`runs.regime_runs`); 'claims':
  the papers' claims; 'beyond': the switches beyond the papers' anchors; 'trails': why the
  upcycled T5 trails the dense one (`runs.trail_runs`); 'drop': Drop-Upcycling in its own
  setting, a Llama upcycled into a Mixtral (`drop_runs`)."""
  if run.arm in precondition.ARMS.get(run.family, ()):
    return 'precondition'
  if run.family == drop_render.FAMILY:
    return 'drop'
  if run.arm in recipe.arms(FULL):
    return 'recipe'
  if run.arm in runs_lib.REGIME_ARMS:
    return 'regime'
  if run.arm in runs_lib.TRAIL_ARMS:
    return 'trails'
  return 'beyond' if run.arm in runs_lib.BEYOND_ARMS else 'claims'


def plan(scale, quick: bool, suites=('claims',)):
  """The runs of `suites`, the runs of other suites their sections read (`READS`) and the runs
  they start from, in the order they are started: suite by suite, arm by arm (every seed of an
  arm before the next arm), the papers' claims first, so that a study stopped early has whole
  arms; a run another suite's run needs before it starts comes before it. A run several suites
  need is planned once."""
  every = {}
  for seed in scale.seeds:
    for r in (runs_lib.t5_runs(scale, seed) + runs_lib.vit_runs(scale, seed) +
              runs_lib.trail_runs(scale, seed) + runs_lib.regime_runs(scale, seed) +
              recipe.recipe_runs(scale, seed) + drop_runs.llama_runs(scale, seed)):
      every.setdefault(r.name, r)
  reads = set().union(*[READS.get(s, set()) for s in suites])
  wanted = [r for r in every.values() if suite_of(r) in suites or (r.family, r.arm) in reads]
  if quick:
    wanted = [r for r in wanted if r.arm in QUICK_ARMS[r.family]]

  def after_dependencies(runs):
    """`runs` and the runs they start from, each after those it starts from."""
    out, names = [], set()

    def add(r):
      for name in r.dependencies():
        add(every[name])
      if r.name not in names:
        names.add(r.name)
        out.append(r)

    for r in runs:
      add(r)
    return out

  first = [(f, a) for f in ('t5', 'vit') for a in ('pretrain', 'moe', 'dense')]
  order = {}
  for r in every.values():    # an arm's first appearance fixes its place within its group
    order.setdefault((r.family, r.arm), len(order))

  out = after_dependencies(wanted)
  group = {r.name: 0 if (r.family, r.arm) in first else 1 if r.family == 'vit' else
           2 + SUITES.index(suite_of(r)) for r in out}
  for r in reversed(out):   # a run another suite's run starts from joins that suite's group
    for name in r.dependencies():
      group[name] = min(group[name], group[r.name])

  def rank(r):
    key = (r.family, r.arm)
    return group[r.name], first.index(key) if key in first else order[key], r.seed

  return after_dependencies(sorted(out, key=rank))


def _suite_line(args, scale, suite: str) -> str:
  """The suite's command and how its own runs went: how many finished and their run time (each
  run's own seconds, measured while `args.jobs` ran at once; a study may span sessions)."""
  planned = plan(scale, args.quick, (suite,))
  own = [r for r in planned if suite_of(r) == suite]
  done = [os.path.join(r.directory(args.runs_dir), execute.DONE) for r in own]
  done = [p for p in done if os.path.exists(p)]
  command = ('python -m upcycle.study' + (' --quick' if args.quick else '') +
             ('' if suite == 'claims' else f' --suite {suite}') + f' --out {args.out}' +
             (f' --runs_dir {args.runs_dir_given}' if args.runs_dir_given else ''))
  others = [s for s in SUITES if s != suite and any(suite_of(r) == s for r in planned)]
  starts = ('' if not others else
            f' (it needs runs of the {" and ".join(others)} suite{"s" * (len(others) > 1)}, '
            f'which it runs first when they are missing)')
  if not done:
    return f'- `{command}`: {len(own)} training runs{starts}, none finished yet.'
  run_time = sum(float(open(p).read() or 0) for p in done)
  return (f'- `{command}`: {len(own)} training runs{starts}, {len(done)} finished'
          f'{"" if len(done) == len(own) else " (arms without every seed: not finished)"}; '
          f'{run_time / 60:.0f} minutes of run time, about {run_time / 60 / args.jobs:.0f} '
          f'minutes of wall-clock time, {args.jobs} at a time.')


def header(args, scale, seconds: float, corpus: str) -> str:
  suites = '\n'.join(_suite_line(args, scale, s) for s in SUITES)
  last = ('rendered from the finished runs (`--render_only`)' if args.render_only else
          f'rendered by the last command (`--suite {args.suite}`), which took '
          f'{seconds / 60:.0f} minutes')
  return f"""# Results: the papers' claims at CPU scale

Regenerate from the repository root (a run that finished is not run again; each command
re-renders this file from every finished run):

{suites}

On {os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()});
{last}; written {datetime.date.today().isoformat()}.

**Setting.** Language: the tiny T5 v1.1 of the main job (`models/t5_1_1/tiny.gin`, 4+4 layers,
d_model 64, byte vocabulary) trained with span corruption on {corpus} with T5X's Adafactor and
rsqrt schedule; in the claims, dense pretraining P = {scale.t5_pretrain_steps} steps, then X = {scale.t5_extra_steps} extra steps; batch {scale.t5_batch}
throughout (the main job's pretraining batch; the main job continues with 4x that, the setting of the
`trails` suite's last row). A run that starts from another's checkpoint reads the data on from
where that one stopped (`RESTORE_DATASET=True`): no T5 run reads a training sequence twice (the
`epochs` columns). Vision: the tiny ViT
(`models/vit/tiny.gin`, 4 blocks, width 64) on scikit-learn's 8x8 handwritten digits (1,797 real
scans, upsampled to 16x16), big_vision's Adafactor, schedule over P + X = {scale.vit_pretrain_steps} +
{scale.vit_extra_steps} steps. Every MoE arm has E = {scale.num_experts} experts unless named otherwise;
the language arms use the paper's T5X/Flaxformer conventions (`moe/paper_t5.gin`), the vision
arms V-MoE's (`moe/paper_vit.gin`). Seeds {', '.join(map(str, scale.seeds))}: each seed
pretrains its own dense model and runs every arm from it, so arms are compared seed by seed.

**Measurements.** Validation loss / accuracy on text and images never seen in training (T5:
{scale.t5_eval_batches} batches of {scale.t5_batch} sequences of the validation split, every tenth module of the corpus kept out
of training, shuffled by the seed: every arm of a seed is evaluated on the same sequences; ViT: all
held-out digits), every
{scale.eval_every} steps and at each run's start. A run's final value is the mean of its last
{scale.final_window} evaluations (the last {(scale.final_window - 1) * scale.eval_every} steps): one evaluation of these small models moves
by several hundredths between neighbouring evaluations, more than many differences compared
here; "at equal total FLOPs" averages likewise. Training FLOPs are counted per step from the
model config and the routing capacity (`upcycle.models.flops`, logged as
`train_flops_per_step`); "at equal extra FLOPs" means the dense continuation runs as many steps
as cost what the upcycled model spent in X steps; "at equal total FLOPs" interpolates both arms'
curves at the FLOPs where the cheaper one ended, dense pretraining included. **Verdicts**
(`upcycle.study.claims`): d = the seed-paired difference (positive when the first-named arm is
better), s.e. = std(d)/sqrt(n); 'yes' when the paper's direction holds by more than 2 s.e.,
'no' when the opposite does, 'not resolved' otherwise. After a verdict that is not 'yes', the
most likely reason.
"""


def build_parser() -> argparse.ArgumentParser:
  parser = arguments.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='docs', help='where RESULTS.md and results/ go')
  parser.add_argument('--runs_dir', default='runs/study', help='the training runs')
  parser.add_argument('--suite', choices=(*SUITES, 'all'), default='claims',
                      help='which runs to train: MoE vs dense from scratch at equal FLOPs, '
                           "the precondition of every upcycling claim (~90 min), the tiny T5's "
                           'learning-rate sweep '
                           "(3 peaks x 3 seeds), the headline claim in the paper's regime "
                           "(~100 min), the papers' claims (~90 min), the switches beyond the "
                           "papers' anchors (~26 min), why the upcycled T5 trails the dense one "
                           '(~90 min), Drop-Upcycling on a Llama upcycled into a Mixtral '
                           '(~75 min), or all; RESULTS.md always shows every finished run')
  parser.add_argument('--quick', action='store_true',
                      help='a few claims arms, one seed, a few steps')
  parser.add_argument('--jobs', type=int, default=2, help='training runs at a time')
  parser.add_argument('--render_only', action='store_true',
                      help='write RESULTS.md from the runs finished so far; train nothing')
  return parser


def main(argv=None) -> None:
  console.show_progress()   # and off a TPU VM, JAX (the Drop statistics) never loads libtpu
  args = build_parser().parse_args(argv)
  startup.ready()
  args.runs_dir_given = None if args.runs_dir == 'runs/study' else args.runs_dir
  args.runs_dir = os.path.abspath(args.runs_dir)
  scale = QUICK if args.quick else FULL
  suites = SUITES if args.suite == 'all' else (args.suite,)
  runs = plan(scale, args.quick, suites)
  shown = plan(scale, args.quick, SUITES)
  start = time.time()
  failed = [] if args.render_only else execute.run_all(runs, args.runs_dir, scale,
                                                       jobs=args.jobs, repository=REPOSITORY)
  results = Results(args.runs_dir, scale.seeds, scale.final_window)
  dense_t5 = os.path.join(args.runs_dir, 't5', 'pretrain', f'seed{scale.seeds[0]}',
                          'checkpoints', str(scale.t5_pretrain_steps))
  units = (drop_units.statistics(dense_t5, 'encoder/layers_1/mlp', scale.num_experts,
                                 (0.5, 1.0), seed=scale.seeds[0])
           if os.path.isdir(dense_t5) else [])   # the claims suite's dense T5 ran
  arms = {family: {arm: DESCRIPTIONS[family][arm] for arm in
                   dict.fromkeys(r.arm for r in shown if r.family == family)}
          for family in runs_lib.FAMILY_FILES}
  corpus = epochs.describe('packages', os.path.join(args.runs_dir, 't5', 'pretrain',
                                                  f'seed{scale.seeds[0]}'), args.runs_dir)
  drop_suite = drop_render.parts(results, scale, args.out)
  path = render.write(args.out, results, header(args, scale, time.time() - start, corpus), arms,
                      units, scale, corpus, drop_suite,
                      recipe_summary=recipe.summary(args.runs_dir, scale))
  print(f'study: wrote {path}', flush=True)
  if failed:
    sys.exit(f'study: {len(failed)} runs failed or could not start: {", ".join(failed)} '
             f'(see their study.failed); run the same command again to retry them.')


if __name__ == '__main__':
  startup.begin()
  main()
