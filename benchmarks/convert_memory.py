"""Peak host memory of `python -m upcycle.convert` against the sizes it must beat.

  python benchmarks/convert_memory.py [--d_model 256 --d_ff 2048 --layers 4 --experts 32]
                                      [--json benchmarks/results/convert_memory.json]

Writes a dense T5 (random weights, our orbax format) to a temporary directory, then
converts it in a fresh process and reads that process's peak RSS (VmHWM, Linux). A second
process runs the same conversion with --dry_run (imports, reading metadata, tracing the
surgery: everything but the data) for the baseline. The claim under test: peak - baseline
stays near one MoE block (E copies of one dense MLP) plus bounded write buffers
(tensorstore's OCDBT cache, 100 MB in orbax), far below the MoE checkpoint, and grows much
more slowly than the model. Measured on a 2-core CPU box (benchmarks/results/):

  layers per stack                              4          16
  MoE checkpoint (on disk)                747 MiB    3011 MiB
  one MoE block                           192 MiB     192 MiB
  conversion - baseline                   464 MiB     707 MiB
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent('''
    import json, os, sys, time
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    from upcycle import convert
    from upcycle.models import T5Config
    from upcycle.moe import MoeConfig, routers
    source, output, dry_run = sys.argv[1], sys.argv[2], sys.argv[3] == '1'
    spec = json.loads(sys.argv[4])
    encoder = MoeConfig(num_experts=spec['experts'])
    decoder = MoeConfig(num_experts=spec['experts'], router=routers.TopK())
    config = T5Config(vocab_size=spec['vocab'], d_model=spec['d_model'], num_heads=spec['heads'],
                      d_kv=spec['d_model'] // spec['heads'], d_ff=spec['d_ff'],
                      num_encoder_layers=spec['layers'], num_decoder_layers=spec['layers'],
                      encoder_moe=encoder, decoder_moe=decoder)
    start = time.time()
    convert.convert(source, config, output, dry_run=dry_run)
    seconds = time.time() - start
    # VmHWM: this process image's own high-water mark (ru_maxrss would include the RSS
    # of the parent it was forked from).
    with open('/proc/self/status') as f:
        peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))
    print(json.dumps({'peak_rss': peak, 'seconds': seconds}))
''')


def _dense_checkpoint(directory: str, spec: dict) -> int:
  """Writes the dense model (orbax, step 0); returns its size in bytes."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import orbax  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from upcycle.models.families import abstract_params
  from upcycle.models import T5Config
  # pylint: enable=g-import-not-at-top
  config = T5Config(vocab_size=spec['vocab'], d_model=spec['d_model'], num_heads=spec['heads'],
                    d_kv=spec['d_model'] // spec['heads'], d_ff=spec['d_ff'],
                    num_encoder_layers=spec['layers'], num_decoder_layers=spec['layers'])
  rng = np.random.default_rng(0)
  import jax  # pylint: disable=g-import-not-at-top
  params = jax.tree.map(lambda x: rng.normal(0, 0.05, x.shape).astype(np.float32),
                        abstract_params(config))
  with orbax.CheckpointManager(directory, async_save=False) as manager:
    manager.save(0, params)
  return sum(x.nbytes for x in jax.tree.leaves(params))


def _run_child(source: str, output: str, dry_run: bool, spec: dict) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  result = subprocess.run(
      [sys.executable, '-c', _CHILD, source, output, '1' if dry_run else '0', json.dumps(spec)],
      capture_output=True, text=True, env=env, cwd=ROOT, check=False)
  if result.returncode:
    raise RuntimeError(result.stderr[-3000:])
  return json.loads(result.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
  return f'{n / 2**20:.0f} MiB'


def measure(spec: dict) -> dict:
  """One conversion of the dense T5 described by `spec`, with its dry-run baseline."""
  with tempfile.TemporaryDirectory() as tmp:
    source = os.path.join(tmp, 'dense')
    dense_bytes = _dense_checkpoint(source, spec)
    baseline = _run_child(source, os.path.join(tmp, 'dry'), True, spec)
    run = _run_child(source, os.path.join(tmp, 'moe'), False, spec)
    moe_bytes = sum(os.path.getsize(os.path.join(r, f))
                    for r, _, files in os.walk(os.path.join(tmp, 'moe')) for f in files)
  expanded = spec['experts'] * spec['d_model'] * spec['d_ff'] * 4
  return {**spec, 'dense_checkpoint_bytes': dense_bytes, 'moe_checkpoint_bytes': moe_bytes,
          'expanded_tensor_bytes': expanded, 'moe_block_bytes': 3 * expanded,
          'baseline_peak_rss': baseline['peak_rss'], 'convert_peak_rss': run['peak_rss'],
          'convert_minus_baseline': run['peak_rss'] - baseline['peak_rss'],
          'convert_seconds': run['seconds']}


ROWS = (('layers per stack', 'layers', str),
        ('dense checkpoint', 'dense_checkpoint_bytes', _mib),
        ('MoE checkpoint (on disk)', 'moe_checkpoint_bytes', _mib),
        ('one expanded tensor [E, d_model, d_ff]', 'expanded_tensor_bytes', _mib),
        ('one MoE block (wi_0, wi_1, wo experts)', 'moe_block_bytes', _mib),
        ('peak RSS, --dry_run (baseline)', 'baseline_peak_rss', _mib),
        ('peak RSS, conversion', 'convert_peak_rss', _mib),
        ('conversion - baseline', 'convert_minus_baseline', _mib),
        ('conversion time', 'convert_seconds', lambda s: f'{s:.1f} s'))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--d_ff', type=int, default=2048)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--layers', type=int, nargs='+', default=[4, 16],
                      help='layers per stack, one run each; MoE every other layer')
  parser.add_argument('--experts', type=int, default=32)
  parser.add_argument('--vocab', type=int, default=512)
  parser.add_argument('--json', default=os.path.join(ROOT, 'benchmarks', 'results',
                                                     'convert_memory.json'))
  return parser


def main() -> None:
  args = build_parser().parse_args()
  runs = []
  for layers in args.layers:
    spec = {'d_model': args.d_model, 'd_ff': args.d_ff, 'heads': args.heads, 'layers': layers,
            'experts': args.experts, 'vocab': args.vocab}
    runs.append(measure(spec))
  print(f'python -m upcycle.convert, peak host memory: T5, {args.experts} experts every other '
        f'layer, d_model {args.d_model}, d_ff {args.d_ff}, float32')
  for label, key, fmt in ROWS:
    print(f'  {label:<40}' + ''.join(f'{fmt(run[key]):>12}' for run in runs))
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, 'w') as f:
    json.dump({'time': time.strftime('%Y-%m-%d %H:%M:%S'), 'runs': runs}, f, indent=1)
  print(f'wrote {args.json}')


if __name__ == '__main__':
  main()
