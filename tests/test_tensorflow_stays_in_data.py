"""TensorFlow (seconds to import, and it claims accelerators) is loaded only where data is read."""

import subprocess
import sys

import pytest

LIBRARY = ('upcycle.models', 'upcycle.moe', 'upcycle.checkpoints', 'upcycle.upcycling',
           'upcycle.train.trainer', 'upcycle.train.evaluation', 'upcycle.data')


def test_library_imports_leave_tensorflow_unloaded():
  code = ('import sys\n' + ''.join(f'import {m}\n' for m in LIBRARY) +
          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
          "('tensorflow', 'seqio', 'tensorflow_datasets')))")
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert done.stdout.strip() == '[]', done.stdout


@pytest.mark.slow
def test_building_a_pipeline_first_hides_accelerators_from_tensorflow():
  code = ('from upcycle.data import host_only, images\n'
          'before = host_only.hide_accelerators.cache_info().currsize\n'
          "images.ImagePipeline(image_size=8).batches(seed=0, batch_size=2, shard_index=0, "
          'num_shards=1, drop_remainder=True, skip_batches=0)\n'
          'print(before, host_only.hide_accelerators.cache_info().currsize)')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert done.stdout.split()[-2:] == ['0', '1'], done.stdout
