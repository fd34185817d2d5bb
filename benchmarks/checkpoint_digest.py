"""What the per-shard CRC-32 digests (upcycle/checkpoints/digests.py) cost a training save.

  python benchmarks/checkpoint_digest.py [--repeats 7]
                                         [--json benchmarks/results/checkpoint_digest.json]

Saves the state the trainer saves (parameters + T5X Adafactor state, float32, on one device)
of two T5 models with the trainer's CheckpointManager into a temporary directory, alternating
saves with digests (as the trainer saves) and without (the same save with an empty digest
record), and reports the medians of:

  blocking  what `save()` takes before it returns (asynchronous saves, as the trainer's): the
            training loop waits this long; the digests are computed here, from the arrays
            before the next step may donate them;
  total     `save()` + `wait()`: until the step is on disk;
  digests   `digests.record` alone, and its throughput.

Both models run in the same process, one after the other; prints a table and writes JSON.
"""

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from upcycle import partitioning, tree
from upcycle.checkpoints import digests, orbax
from upcycle.models import T5, T5Config
from upcycle.train import optimizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    # The training tests' tiny T5 (TRAINING_T5, tests/train/helpers.py).
    'tiny': T5Config(vocab_size=384, d_model=32, num_heads=2, d_kv=16, d_ff=64,
                     num_encoder_layers=2, num_decoder_layers=2),
    # T5 v1.1 Small.
    'small': T5Config(vocab_size=32128, d_model=512, num_heads=6, d_kv=64, d_ff=1024,
                      num_encoder_layers=8, num_decoder_layers=8),
}


def _state(config: T5Config):
  """(params, T5X Adafactor state) of `config`, random values, on the default device."""
  tokens = jax.ShapeDtypeStruct((1, 8), np.int32)
  boxed = jax.eval_shape(T5(config).init, jax.random.PRNGKey(0), tokens, tokens)['params']
  optimizer = optimizers.T5XAdafactor().build(partitioning.logical_axes(boxed))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jax.device_put(rng.normal(0, 0.05, x.shape).astype(x.dtype)),
                        tree.unbox(boxed))
  return params, jax.jit(optimizer.init)(params)


def _empty_record(items):
  del items
  return {'format': digests.FORMAT, 'algorithm': 'crc32', 'process_count': 1, 'items': {}}


def _save(manager: orbax.CheckpointManager, step: int, state) -> tuple:
  """(seconds until save() returned, seconds until the step was on disk)."""
  start = time.perf_counter()
  manager.save(step, *state)
  blocking = time.perf_counter() - start
  manager.wait()
  return blocking, time.perf_counter() - start


def measure(name: str, config: T5Config, repeats: int) -> dict:
  state = _state(config)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  timings = {'with': [], 'without': []}
  record = digests.record
  with tempfile.TemporaryDirectory() as directory:
    # keep=None: no retention, whose background deletions would be waited for by the next save.
    with orbax.CheckpointManager(directory, keep=None, async_save=True) as manager:
      _save(manager, 0, state)   # warm-up: orbax's first save sets up its threads
      for i in range(repeats):
        for variant in (('with', 'without') if i % 2 == 0 else ('without', 'with')):
          digests.record = record if variant == 'with' else _empty_record
          try:
            timings[variant].append(_save(manager, 1 + len(timings['with']) +
                                          len(timings['without']), state))
          finally:
            digests.record = record
  items = {'params': state[0], 'optimizer_state': state[1]}
  alone = []
  for _ in range(repeats):
    start = time.perf_counter()
    digests.record(items)
    alone.append(time.perf_counter() - start)
  median = lambda values: statistics.median(values)
  row = {'model': name, 'arrays': len(jax.tree.leaves(state)), 'bytes': num_bytes,
         'digests_seconds': median(alone), 'digests_gb_per_s': num_bytes / median(alone) / 1e9}
  for variant, runs in timings.items():
    row[f'blocking_{variant}'] = median([b for b, _ in runs])
    row[f'total_{variant}'] = median([t for _, t in runs])
  return row


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:.1f} ms'


ROWS = (('arrays (params + optimizer state)', 'arrays', str),
        ('bytes', 'bytes', lambda n: f'{n / 2**20:.1f} MiB'),
        ('save() blocking, without digests', 'blocking_without', _ms),
        ('save() blocking, with digests', 'blocking_with', _ms),
        ('save + wait, without digests', 'total_without', _ms),
        ('save + wait, with digests', 'total_with', _ms),
        ('digests.record alone', 'digests_seconds', _ms),
        ('digests.record throughput', 'digests_gb_per_s', lambda g: f'{g:.2f} GB/s'))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--repeats', type=int, default=7, help='saves per variant and model')
  parser.add_argument('--json', default=os.path.join(ROOT, 'benchmarks', 'results',
                                                     'checkpoint_digest.json'))
  return parser


def main() -> None:
  args = build_parser().parse_args()
  # orbax warns at each save about the previous save's wait, which is this script's own wait().
  logging.getLogger('absl').setLevel(logging.ERROR)
  rows = [measure(name, config, args.repeats) for name, config in MODELS.items()]
  print(f'Checkpoint save with and without per-shard CRC-32 digests (median of {args.repeats}, '
        f'{jax.devices()[0].platform}, one device)')
  print(f'  {"":<36}' + ''.join(f'{row["model"]:>14}' for row in rows))
  for label, key, fmt in ROWS:
    print(f'  {label:<36}' + ''.join(f'{fmt(row[key]):>14}' for row in rows))
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, 'w') as f:
    json.dump({'time': time.strftime('%Y-%m-%d %H:%M:%S'), 'repeats': args.repeats,
               'rows': rows}, f, indent=1)
  print(f'wrote {args.json}')


if __name__ == '__main__':
  main()
