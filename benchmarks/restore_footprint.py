"""How much of the code base one upcycling restore runs: the distinct functions (and the modules
holding them) of the `upcycle` package that the restore hook calls, from its call to the
TrainState it returns.

  python benchmarks/restore_footprint.py [--workdir /tmp/restore_footprint]

The restore is the main job's (scripts/quickstart.sh): the tiny T5 pretrained densely for 2
steps, then upcycled with `moe/paper_t5.gin` (T5X conventions, E = 8), combine weights
normalized and the dense optimizer state reused, through `python -m upcycle.train`'s
entry point in this process with the restore hook profiled (`sys.setprofile`). Every code
object counts, so comprehensions and lambdas do; the named functions are counted apart. Prints
the counts and the modules, and writes benchmarks/results/restore_footprint.json.
"""

import argparse
import collections
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MODEL = ('--gin_file=models/t5_1_1/tiny.gin',)
DATA = ('--gin_file=data/offline_stdlib_span_corruption.gin',)
MOE = ('--gin_file=moe/paper_t5.gin', '--gin_file=runs/upcycle.gin',
       '--gin_file=upcycling/normalize_combine_weights.gin',
       '--gin_file=upcycling/reuse_optimizer_state.gin')


def pretrain(workdir: str) -> str:
  """A 2-step dense run (a subprocess); its last checkpoint."""
  model_dir = os.path.join(workdir, 'dense')
  subprocess.run([sys.executable, '-m', 'upcycle.train', *MODEL,
                  '--gin_file=runs/pretrain.gin', *DATA, f"--gin.MODEL_DIR='{model_dir}'",
                  '--gin.TRAIN_STEPS=2', '--gin.trainer.TrainConfig.eval_every=0'],
                 cwd=REPO, check=True, capture_output=True)
  return os.path.join(model_dir, 'checkpoints', '2')


def footprint(checkpoint: str, workdir: str) -> dict:
  """{'functions': [...], 'modules': {module: functions called}} of the restore hook."""
  from upcycle.train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  from upcycle import restore  # pylint: disable=g-import-not-at-top
  called = set()
  root = os.path.join(REPO, 'upcycle') + os.sep

  def profile(frame, event, _):
    if event == 'call' and frame.f_code.co_filename.startswith(root):
      name = os.path.relpath(frame.f_code.co_filename, REPO)[:-3].replace(os.sep, '.')
      called.add((name, frame.f_code.co_qualname))

  hook = restore.Restore.__call__

  def profiled(self, *args, **kwargs):
    sys.setprofile(profile)
    try:
      return hook(self, *args, **kwargs)
    finally:
      sys.setprofile(None)

  restore.Restore.__call__ = profiled
  sys.modules['__main__'] = train_main   # the run files bind `__main__.train` (their script)
  code = train_main.main([*MODEL, *MOE, *DATA,
                          f"--gin.MODEL_DIR='{os.path.join(workdir, 'moe')}'",
                          f"--gin.INITIAL_CHECKPOINT_PATH='{checkpoint}'",
                          '--gin.TRAIN_STEPS=2', '--gin.trainer.TrainConfig.eval_every=0'])
  if code:
    raise SystemExit(f'restore_footprint: the upcycling run failed ({code}).')
  modules = collections.Counter(module for module, _ in called)
  functions = sorted(f'{m}.{f}' for m, f in called)
  return {'functions': functions, 'modules': dict(sorted(modules.items())),
          'named_functions': [f for f in functions if not any(f'<{kind}>' in f for kind in (
              'listcomp', 'dictcomp', 'setcomp', 'genexpr', 'lambda'))]}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='/tmp/restore_footprint')
  parser.add_argument('--output', default=os.path.join(REPO, 'benchmarks', 'results',
                                                       'restore_footprint.json'))
  return parser


def main() -> None:
  args = build_parser().parse_args()
  os.makedirs(args.workdir, exist_ok=True)
  result = footprint(pretrain(args.workdir), args.workdir)
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, 'w') as f:
    json.dump(result, f, indent=1)
  for module, count in result['modules'].items():
    print(f'{count:4d}  {module}')
  print(f'{len(result["functions"])} functions ({len(result["named_functions"])} named: no '
        f'comprehension or lambda) in {len(result["modules"])} modules of upcycle run by one '
        f'upcycling restore (modes.Upcycle, the main job\'s).')


if __name__ == '__main__':
  main()
