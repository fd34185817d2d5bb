"""`python -m tests.convert_on_gcs SOURCE GIN_FILE OUT EXPERTS`: what tests/test_convert.py
runs in a process of its own pointed at the GCS emulator."""

import contextlib
import io
import json
import os
import sys
import time

import numpy as np

from upcycle import checkpoints, convert, tree
from upcycle.checkpoints import gcs
from upcycle.locks.gcs_lock import GcsLock


def convert_on_gcs(source_dir: str, gin_file: str, out: str, experts: str) -> None:
  """Run in a subprocess pointed at the GCS emulator (this test process's etils.epath may use
  TensorFlow's GCS client, which cannot be redirected): conversions into gs://bucket/moe and
  gs://bucket/moe_t5x with `experts` and seed 3, each refusal, and what the project's readers
  read back, into `out`: gcs.json (the runs' exit codes and output, the listings) and gcs.npz
  (the arrays read back)."""
  runs = []

  def run(output_dir, *extra):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
      code = convert.main(['--source', source_dir, '--gin_file', gin_file, '--output_dir',
                           output_dir, '--experts', experts, '--seed', '3', *extra])
    runs.append([code, printed.getvalue()])

  with GcsLock('gs://bucket/.moe.converting.lock'):
    run('gs://bucket/moe')                                 # 0: another conversion is running
  killed = {'host': 'elsewhere', 'pid': 1, 'since': 'then', 'heartbeat': time.time() - 3600}
  gcs.write_bytes('gs://bucket/.moe.converting.lock', json.dumps(killed).encode())
  gcs.write_bytes('gs://bucket/.moe.converting-1700000000-4242/6/params/_METADATA', b'{}')
  gcs.write_bytes('gs://bucket/.moe.converting-x.converting-1-2/6/_METADATA', b'{}')  # not ours
  gcs.write_bytes('gs://bucket/moe/notes.txt', b'mine')
  run('gs://bucket/moe')                                 # 1: exists
  run('gs://bucket/moe', '--overwrite')                  # 2: takes the lock over, cleans, replaces
  run('gs://bucket/moe_t5x', '--output_format', 't5x')   # 3
  arrays = {}
  for name, url in (('orbax', 'gs://bucket/moe'), ('t5x', 'gs://bucket/moe_t5x')):
    ckpt = checkpoints.load(url)
    runs.append([ckpt.format, ckpt.step, ckpt.path])
    arrays.update({f'{name}/{k}': np.asarray(v) for k, v in tree.flatten(ckpt.params).items()})
  arrays['t5x_msgpack'] = np.frombuffer(
      gcs.read_bytes('gs://bucket/moe_t5x/checkpoint_6/checkpoint'), np.uint8)
  np.savez(os.path.join(out, 'gcs.npz'), **arrays)
  listing = {'moe': gcs.names('gs://bucket/moe'), 'hidden': gcs.names_starting_with(
      'gs://bucket/.moe')}
  with open(os.path.join(out, 'gcs.json'), 'w') as f:
    json.dump({'runs': runs, 'listing': listing, 'pid': os.getpid()}, f)


if __name__ == '__main__':
  convert_on_gcs(*sys.argv[1:])
