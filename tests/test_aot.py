"""python -m upcycle.aot: a real config compiled for TPU v4 (libtpu's compiler, no TPU), with the
per-device bytes held against a count by hand; and the mesh that used to crash the compiler."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from upcycle import models, tree
from upcycle.checkpoints import t5x_writer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip('libtpu', reason="compiling for TPU needs libtpu (pip install -e '.[test]')")

# Every dimension a multiple of 128, so TPU tiling pads nothing and the compiler's argument
# bytes are the count below.
V, D, F, H, DKV, E, BUCKETS = 384, 128, 256, 2, 64, 4, 32
DIMS = dict(vocab_size=V, d_model=D, d_ff=F, num_heads=H, d_kv=DKV, num_encoder_layers=2,
            num_decoder_layers=2)


def dense_param_count() -> int:
  """T5 v1.1 with 2 + 2 layers, untied logits, counted from the architecture."""
  attention, mlp = 4 * D * H * DKV, 3 * D * F
  encoder = 2 * (attention + mlp + 2 * D) + BUCKETS * H + D
  decoder = 2 * (2 * attention + mlp + 3 * D) + BUCKETS * H + D
  return V * D + encoder + decoder + D * V




@pytest.fixture(scope='module')
def aot_result(tmp_path_factory):
  """The JSON of `upcycle.aot` for an upcycling run of a T5 MoE, E = 4 over 4 v4 chips."""
  tmp = tmp_path_factory.mktemp('aot')
  dense = models.T5(models.T5Config(**DIMS))
  shapes = jax.eval_shape(lambda: dense.init(jax.random.PRNGKey(0), np.ones((2, 8), np.int32),
                                             np.ones((2, 8), np.int32)))['params']
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree.unbox(shapes))
  checkpoint = t5x_writer.write(str(tmp / 'dense'), 1000, params)
  command = [
      sys.executable, '-m', 'upcycle.aot', '--topology=v4:2x2x1', f'--json={tmp}/aot.json',
      '--gin_file=models/t5_1_1/tiny.gin', '--gin_file=moe/paper_t5.gin',
      '--gin_file=runs/upcycle.gin', '--gin_file=data/offline_span_corruption.gin',
      *[f'--gin.models.T5Config.{k}={v}' for k, v in DIMS.items()],
      f'--gin.NUM_EXPERTS={E}', "--gin.ACTIVATION_DTYPE='bfloat16'",
      f'--gin.MODEL_DIR=\'{tmp}/moe\'', '--gin.TRAIN_STEPS=1100', '--gin.BATCH_SIZE=16',
      f'--gin.INITIAL_CHECKPOINT_PATH=\'{checkpoint}\'',
      f'--gin.trainer.TrainConfig.num_expert_partitions={E}']
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**os.environ, 'XLA_FLAGS': ''})
  assert done.returncode == 0, done.stderr[-3000:]
  assert not (tmp / 'moe').exists()   # nothing is written to the run's directory
  return json.loads((tmp / 'aot.json').read_text()), done.stdout


@pytest.mark.slow
def test_aot_compiles_every_function_for_the_topology(aot_result):
  result, stdout = aot_result
  assert (result['topology'], result['devices'], result['device_kind']) == ('v4:2x2x1', 4,
                                                                            'TPU v4')
  assert result['mesh'] == {'data': 1, 'expert': 4, 'model': 1}
  assert set(result['functions']) == {'train_step', 'restore_hook', 'eval_step'}
  assert result['not_compiled'] == {}
  for name, report in result['functions'].items():
    assert report['hbm_bytes_per_device'] == 32 * 2**30, name    # a v4 chip (megacore)
    assert report['fits'] and report['per_device_bytes']['total'] < 2**30, name
    assert report['flops_per_device'] > 0 and report['compile_seconds'] > 0, name
  assert 'train_step: fits' in stdout and 'mesh data 1 x expert 4 x model 1' in stdout


@pytest.mark.slow
def test_aot_per_device_bytes_match_a_count_by_hand(aot_result):
  result, _ = aot_result
  train = result['functions']['train_step']['per_device_bytes']
  # moe/paper_t5.gin: layer 1 of each stack is an MoE: E copies of its MLP split over
  # 'expert', and a replicated router [d, E].
  experts = 2 * E * 3 * D * F
  replicated = dense_param_count() - 2 * 3 * D * F + 2 * D * E
  assert train['parameters'] == 4 * (replicated + experts // E)      # float32
  # 4 examples a device, packed: tokens, segment ids, positions of the inputs (128); tokens,
  # targets, loss weights, segment ids, positions of the targets (32); int32.
  batch = 16 // 4 * (3 * 128 + 5 * 32) * 4
  assert train['batch'] == batch
  # The compiler's arguments are the state and the batch (and the step and the rng), a few
  # percent more: TPU memory tiles pad small leaves (T5X's [1] placeholder slots, scalars,
  # the [32, 2] relative position biases).
  state = train['parameters'] + train['optimizer_state'] + batch
  assert state <= train['arguments'] <= 1.03 * state
  # T5X Adafactor factors [E, d, f] kernels per expert: v_row [E, d] and v_col [E, f] are
  # split over 'expert' with their kernel, far smaller than the parameters.
  assert train['optimizer_state'] < train['parameters'] / 8
  eval_step = result['functions']['eval_step']['per_device_bytes']
  assert eval_step['parameters'] == train['parameters']
  restore = result['functions']['restore_hook']['per_device_bytes']
  # The hook's outputs are the sharded state; its arguments the dense leaves, each placed
  # like the MoE leaf it fills.
  assert restore['outputs'] >= train['parameters'] + train['optimizer_state']


@pytest.mark.slow
def test_expert_axis_32_mesh_compiles():
  """The compile that crashed XLA's TPU SPMD partitioner (SIGSEGV in its windowed-einsum
  pass) before the masked dispatch computed where the tokens are: an Expert Choice layer of
  32 experts with a residual, groups of 4096 tokens, mesh data 2 x expert 32 over v4:4x4x2
  shown per core (`benchmarks/tpu_expert_axis_32.py --direct` still crashes it)."""
  script = os.path.join(REPO, 'benchmarks', 'tpu_expert_axis_32.py')
  done = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env={**os.environ, 'XLA_FLAGS': ''})
  assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
  assert 'compiled: groups 32' in done.stdout


def test_a_config_that_does_not_fit_names_what_dominates_and_the_levers():
  from upcycle.train import aot  # pylint: disable=g-import-not-at-top
  gib = 2**30
  report = aot.FunctionReport(
      arguments=20 * gib, outputs=20 * gib, alias=19 * gib, temp=14 * gib, code=0,
      hbm=32 * gib, flops_per_device=1.0, devices=64, compile_seconds=1.0,
      parts={'parameters': 12 * gib, 'optimizer_state': 7 * gib, 'batch': gib})
  assert report.total == 35 * gib and not report.fits
  assert report.dominant() == 'activations'
  line = aot.advice(report)
  assert line.startswith('does NOT fit: 3.00 GiB over; activations dominate(s) (14.00 GiB)')
  assert 'num_microbatches' in line and "REMAT_POLICY = 'full'" in line
  params_bound = dataclasses.replace(report, arguments=40 * gib, temp=2 * gib,
                                     parts={**report.parts, 'parameters': 30 * gib})
  assert ("LOGICAL_AXIS_RULES = 'fsdp'" in aot.advice(params_bound)
          and 'num_model_partitions' in aot.advice(params_bound))


def test_the_exit_status_tells_fits_from_does_not_fit_from_not_compiled():
  from upcycle import aot  # pylint: disable=g-import-not-at-top
  fits, over = {'fits': True}, {'fits': False}
  status = lambda functions, not_compiled: aot.exit_status(
      {'functions': functions, 'not_compiled': not_compiled})
  assert status({'train_step': fits, 'eval_step': fits}, {}) == aot.FITS == 0
  assert status({'train_step': over, 'eval_step': fits}, {}) == aot.DOES_NOT_FIT == 2
  assert status({'eval_step': fits}, {'train_step': 'does NOT fit: the TPU compiler refused it'}
                ) == aot.DOES_NOT_FIT
  assert status({'train_step': fits}, {'restore_hook': 'not lowered: OSError: ...'}
                ) == aot.NOT_COMPILED == 3


def test_an_unreachable_checkpoint_stops_it_in_one_line_before_compiling(tmp_path):
  """The gs:// paths it reads answer first (MODEL_DIR, never written, need not)."""
  command = [sys.executable, '-m', 'upcycle.aot', '--topology=v4:2x2x1',
             f'--json={tmp_path}/aot.json', '--gin_file=models/t5_1_1/tiny.gin',
             '--gin_file=moe/paper_t5.gin', '--gin_file=runs/upcycle.gin',
             '--gin_file=data/offline_span_corruption.gin', '--gin.NUM_EXPERTS=4',
             "--gin.MODEL_DIR='gs://no-such-bucket-upcycle-test/moe'", '--gin.TRAIN_STEPS=10',
             "--gin.INITIAL_CHECKPOINT_PATH='gs://no-such-bucket-upcycle-test/dense'"]
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                        env={**os.environ, 'XLA_FLAGS': '', 'UPCYCLE_GCS_TIMEOUT_SECONDS': '3'})
  assert done.returncode == 1
  last = done.stderr.strip().splitlines()[-1]
  assert 'INITIAL_CHECKPOINT_PATH' in last and 'gs://no-such-bucket-upcycle-test' in last, last
  assert 'Traceback' not in done.stderr and not (tmp_path / 'aot.json').exists()
