"""python -m upcycle.aot: a real config compiled for TPU v4 (libtpu's compiler, no TPU), with the
per-device bytes held against a count by hand, the levers it sets and the largest batch that
fits; the HBM the compiler can use, asked of the compiler; the fit decision, the levers and
the batch prediction on numbers; and the mesh that used to crash the compiler."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.helpers import REPO
from upcycle import models, tree
from upcycle.checkpoints import t5x_writer

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




@pytest.fixture(autouse=True)
def _no_tpu_executable_in_the_persistent_cache():
  """The tests below that compile for a topology in this process write nothing to the
  tests' persistent compilation cache (`platforms.compilation_cache_off`: no TPU client could
  load it back)."""
  from upcycle import platforms  # pylint: disable=g-import-not-at-top
  with platforms.compilation_cache_off():
    yield


@pytest.fixture(scope='module')
def aot_result(tmp_path_factory):
  """The JSON of `upcycle.aot --find_batch` for an upcycling run of a T5 MoE, E = 4 over 4 v4
  chips, with full remat and 2 microbatches (2 + 2 layers, one of them MoE, have no period
  to scan over)."""
  tmp = tmp_path_factory.mktemp('aot')
  dense = models.T5(models.T5Config(**DIMS))
  shapes = jax.eval_shape(lambda: dense.init(jax.random.PRNGKey(0), np.ones((2, 8), np.int32),
                                             np.ones((2, 8), np.int32)))['params']
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree.unbox(shapes))
  checkpoint = t5x_writer.write(str(tmp / 'dense'), 1000, params)
  command = [
      sys.executable, '-m', 'upcycle.aot', '--topology=v4:2x2x1', f'--json={tmp}/aot.json',
      '--find_batch',
      '--gin_file=models/t5_1_1/tiny.gin', '--gin_file=moe/paper_t5.gin',
      '--gin_file=runs/upcycle.gin', '--gin_file=data/offline_span_corruption.gin',
      *[f'--gin.models.T5Config.{k}={v}' for k, v in DIMS.items()],
      f'--gin.NUM_EXPERTS={E}', "--gin.ACTIVATION_DTYPE='bfloat16'", "--gin.REMAT_POLICY='full'",
      f'--gin.MODEL_DIR=\'{tmp}/moe\'', '--gin.TRAIN_STEPS=1100', '--gin.BATCH_SIZE=16',
      f'--gin.INITIAL_CHECKPOINT_PATH=\'{checkpoint}\'',
      f'--gin.trainer.TrainConfig.num_expert_partitions={E}',
      '--gin.trainer.TrainConfig.num_microbatches=2']
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**os.environ, 'XLA_FLAGS': ''})
  assert done.returncode == 0, done.stderr[-3000:]
  assert not (tmp / 'moe').exists()   # nothing is written to the run's directory
  return json.loads((tmp / 'aot.json').read_text()), done.stdout, done.stderr, tmp


@pytest.mark.slow
def test_aot_compiles_every_function_for_the_topology(aot_result):
  result, stdout, _, _ = aot_result
  assert (result['topology'], result['devices'], result['device_kind']) == ('v4:2x2x1', 4,
                                                                            'TPU v4')
  assert result['mesh'] == {'data': 1, 'expert': 4, 'model': 1}
  assert set(result['functions']) == {'train_step', 'restore_hook', 'eval_step'}
  assert result['not_compiled'] == {}
  for name, report in result['functions'].items():
    assert report['hbm_bytes_per_device'] == 32 * 2**30, name    # a v4 chip (megacore)
    assert report['usable_hbm_bytes_per_device'] == 30.75 * 2**30, name
    assert report['fits'] and report['per_device_bytes']['total'] < 2**30, name
    assert report['flops_per_device'] > 0 and report['compile_seconds'] > 0, name
  # The counting copies' compile time apart from the step's own: the train step (2
  # microbatches) and the eval step have loops, the restore hook none.
  assert result['functions']['train_step']['count_compile_seconds'] > 0
  assert result['functions']['restore_hook']['count_compile_seconds'] == 0
  assert 'train_step: fits' in stdout and 'mesh data 1 x expert 4 x model 1' in stdout
  assert 'compile s  count s' in stdout


@pytest.mark.slow
def test_the_upcycling_hook_logs_its_summary_and_no_donation_warning(aot_result):
  """The restore hook's report: its summary, naming the file the run will write (aot writes
  nothing), not the per-leaf table; and no warning of donated inputs no output aliases."""
  _, stdout, stderr, tmp = aot_result
  assert (f'Full upcycling report (every leaf): {tmp}/moe/upcycling_report.txt (written when '
          'the run restores it)') in stdout
  assert not re.search(r'^\s*action\s+path\s+shape', stdout, re.M)   # the per-leaf header
  assert 'Some donated buffers were not usable' not in stderr


@pytest.mark.slow
def test_the_step_counts_every_microbatch_and_its_roofline_follows(aot_result):
  """The compiler counts a loop body once: the train step's FLOPs come from a copy with the
  microbatch scan unrolled (`step_count.py`; 2 + 2 layers have one period, so the copy is the
  whole model), so they cover at least the model's matmul FLOPs of the whole batch
  (`models/flops.py`, counted by hand from the architecture; with full remat the compiler's count is
  larger: the forward pass runs twice, and it counts the dispatch's einsums and every elementwise
  op). Counted once, they would be about half of it. The roofline is max(FLOPs / 275 TFLOP/s,
  bytes / 1228 GB/s), and the MFU at it the model's FLOPs over the chips' peak in that time."""
  result, stdout, _, _ = aot_result
  train = result['functions']['train_step']
  assert train['extrapolated'] and not result['functions']['restore_hook']['extrapolated']
  model_flops = train['model_flops_per_step']
  assert model_flops <= train['flops_per_step'] <= 3 * model_flops
  compute, memory = train['flops_per_device'] / 275e12, train['bytes_accessed_per_device'] / 1228e9
  assert train['roofline_seconds'] == pytest.approx(max(compute, memory), rel=1e-9)
  assert train['roofline_bound'] == ('compute' if compute >= memory else 'memory')
  assert train['mfu_at_roofline'] == pytest.approx(
      train['model_flops_per_step'] / (4 * 275e12 * train['roofline_seconds']), rel=1e-9)
  assert 'roofline ms' in stdout and 'MFU max' in stdout


@pytest.mark.slow
def test_aot_per_device_bytes_match_a_count_by_hand(aot_result):
  result, _, _, _ = aot_result
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


@pytest.mark.slow
def test_aot_names_the_levers_set_and_the_largest_batch_that_fits(aot_result):
  result, stdout, _, _ = aot_result
  assert result['levers_set'] == [
      "REMAT_POLICY = 'full'",
      'num_expert_partitions = 4 (the most: E = 4 over 4 devices)', 'T5XAdafactor.factored = True',
      'num_microbatches = 2']
  assert result['advice']['train_step'].startswith('fits, ')
  # --find_batch: the run's batch and half of it compiled; the line through them predicts a
  # batch, a multiple of the 4-way data x expert split, far past 4 x 16 for so small a model:
  # reported, not compiled.
  search = result['batch_search']
  totals = {int(b): t for b, t in search['total_bytes_by_batch'].items()}
  assert set(totals) == {16, 8} and totals[8] < totals[16]
  # Both steps run at BATCH_SIZE: the total searched is the larger of theirs.
  assert totals[16] == max(result['functions'][f]['per_device_bytes']['total']
                           for f in ('train_step', 'eval_step'))
  assert search['predicted'] % 4 == 0 and search['predicted'] > 4 * 16
  assert search['largest_fitting'] == 16
  assert "levers set: REMAT_POLICY = 'full'" in stdout and '--find_batch: ' in stdout


@pytest.mark.slow
def test_the_usable_hbm_is_what_the_compiler_says():
  """A program far too large for each device kind, compiled: the compiler's refusal names the
  HBM it can use, which `hbm.CAPACITIES` holds."""
  from upcycle.fit import hbm  # pylint: disable=g-import-not-at-top
  script = '''
import json, jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from upcycle.fit import aot, hbm
aot.topology_devices('v4:2x2x1')   # libtpu's environment
cases = {'v4:2x2x1': {'chip_config_name': 'megacore', 'chips_per_host_bounds': (2, 2, 1),
                      'num_slices': 1},
         'v4:2x2x1 per core': {'chip_config_name': 'default', 'chips_per_host_bounds': (2, 2, 1),
                               'num_slices': 1},
         'v5e:2x2': {}, 'v5p:2x2x1': {}, 'v6e:2x2': {}}
out = {}
for name, options in cases.items():
  device = topologies.get_topology_desc(topology_name=name.split()[0], platform='tpu',
                                        **options).devices[0]
  one = NamedSharding(Mesh(np.array([device]), ('x',)), PartitionSpec())
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=one)
  big = lambda n: jnp.cumsum(jnp.arange(64 * 2**30, dtype=jnp.float32) * n)[::4096]
  try:
    jax.jit(big).lower(scalar).compile()
  except jax.errors.JaxRuntimeError as e:
    out[name] = (device.device_kind, hbm.refusal(str(e)))
print(json.dumps(out))
'''
  done = subprocess.run([sys.executable, '-c', script], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env={**os.environ, 'XLA_FLAGS': ''})
  assert done.returncode == 0, done.stderr[-2000:]
  found = json.loads(done.stdout.strip().splitlines()[-1])
  for name, (kind, (temp, usable)) in found.items():
    assert temp > 256 * 2**30, name
    assert usable == hbm.capacity(kind, megacore='per core' not in name).usable, name
  assert len(found) == 5


def test_a_total_over_the_usable_hbm_does_not_fit_though_under_the_nominal():
  from upcycle import aot as cli  # pylint: disable=g-import-not-at-top
  from upcycle.fit import aot, hbm, levers  # pylint: disable=g-import-not-at-top
  gib = 2**30
  v4 = hbm.capacity('TPU v4')
  assert (v4.nominal, v4.usable) == (32 * gib, 30.75 * gib)
  assert hbm.capacity('TPU v4', megacore=False).usable == 15.25 * gib
  assert hbm.refusal('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required '
                     'for HLO temporaries (32.98G) exceeds available HBM (30.75G).') == (
                         int(32.98 * gib), v4.usable)
  report = aot.FunctionReport(
      arguments=10 * gib, outputs=2 * gib, alias=2 * gib, temp=21 * gib, code=0, hbm=v4,
      flops_per_device=1.0, devices=16, compile_seconds=1.0,
      parts={'parameters': 9 * gib, 'optimizer_state': gib // 64, 'batch': gib // 64})
  assert report.total == 31 * gib and not report.fits
  settings = levers.Settings(scan_layers=True, remat_policy='full', fsdp=False,
                             mesh={'data': 1, 'expert': 16, 'model': 1}, num_experts=32,
                             optimizer='T5XAdafactor', factored=True, num_microbatches=1,
                             batch_size=256)
  line = aot.advice(report, settings)
  assert line.startswith('does NOT fit: 0.25 GiB over the 30.75 GiB the compiler can use (of '
                         '32 GiB); activations (temp 21.00 GiB) dominate'), line
  assert cli.exit_status({'functions': {'train_step': report.as_json()},
                          'not_compiled': {}}) == cli.DOES_NOT_FIT
  under = dataclasses.replace(report, temp=20 * gib + 3 * gib // 4)
  assert under.fits and aot.advice(under, settings).startswith('fits, 0.00 GiB to spare')


def _t5_xl_on_a_v4_32(**changes):
  """T5 XL MoE on a v4-32 as the fit table compiles it: every lever for activations but the
  batch set."""
  from upcycle.fit import levers  # pylint: disable=g-import-not-at-top
  settings = levers.Settings(scan_layers=True, remat_policy='full', fsdp=False,
                             mesh={'data': 1, 'expert': 16, 'model': 1}, num_experts=32,
                             optimizer='T5XAdafactor', factored=True, num_microbatches=1,
                             batch_size=256)
  return dataclasses.replace(settings, **changes)


def test_loss_chunks_are_advised_where_the_float32_logits_are_a_quarter_of_the_temporaries():
  """Llama-3.2-1B on a v4-32 as the fit table compiles it (batch 128 x 4096 over 16 chips, 2
  microbatches): 4 rows per chip in the train step, 8 in the eval step, whose float32 logits
  over 128,256 pieces are 4 x 4096 x 128256 x 4 bytes = 7.83 GiB and 15.66 GiB."""
  from upcycle.fit import levers  # pylint: disable=g-import-not-at-top
  from upcycle.train import objectives, optimizers, trainer  # pylint: disable=g-import-not-at-top
  gib = 2**30
  objective = objectives.CausalLm(models.Llama(models.LlamaConfig(
      vocab_size=128256, scan_layers=True, remat_policy='full')))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1),
                           ('data', 'expert', 'model'))
  config = trainer.TrainConfig('unused', train_steps=1, batch_size=64, num_microbatches=2)
  s = levers.read(config=config, objective=objective,
                  optimizer=optimizers.AdamW(schedule=1e-4), mesh=mesh, sequence_length=4096)
  assert (s.loss_chunks, s.logit_bytes(rows=1)) == (1, 4096 * 128256 * 4)
  assert (s.rows_per_device('train_step'), s.rows_per_device('eval_step')) == (4, 8)
  activations = dict(parameters=gib // 4, optimizer_state=gib // 2)
  train = levers.advise(s, **activations, temp=int(26.83 * gib), step='train_step')
  assert train[0] == ('LOSS_CHUNKS = 8 (is 1: the float32 logits over the whole vocabulary are '
                      '7.83 GiB per device; the loss 8 slices of the sequence at a time)')
  # The eval step holds the whole batch unless it too evaluates in microbatches.
  evaluating = levers.advise(s, **activations, temp=40 * gib, step='eval_step')
  assert evaluating[0] == ('trainer.TrainConfig.eval_microbatches = 2 (is 1: the eval step '
                           'holds 8 rows per device at once, the train step 4)')
  assert evaluating[1].startswith(
      'LOSS_CHUNKS = 8 (is 1: the float32 logits over the whole vocabulary are 15.66 GiB')
  in_microbatches = dataclasses.replace(s, eval_microbatches=2)
  assert in_microbatches.rows_per_device('eval_step') == 4
  assert 'eval_microbatches = 2' in levers.already_set(in_microbatches)
  assert levers.advise(in_microbatches, **activations, temp=int(26.83 * gib),
                       step='eval_step')[0].startswith('LOSS_CHUNKS = 8 (is 1: the float32 '
                                                       'logits over the whole vocabulary are '
                                                       '7.83 GiB')
  # BATCH_SIZE a multiple of every microbatch of both steps over the 8 data-parallel devices.
  assert dataclasses.replace(s, eval_microbatches=3).batch_multiple() == 8 * 6
  # Under a quarter of the temporaries (7.83 x 4 < 32): not the lever to reach for.
  assert not any(x.startswith('LOSS_CHUNKS') for x in levers.advise(
      s, **activations, temp=32 * gib, step='train_step'))
  chunked = dataclasses.replace(s, loss_chunks=8)
  assert 'LOSS_CHUNKS = 8' in levers.already_set(chunked)
  assert not any(x.startswith('LOSS_CHUNKS') for x in levers.advise(
      chunked, **activations, temp=int(26.83 * gib), step='train_step'))
  # The largest of 8, 4, 2 that divides the length; none for an odd length.
  assert [levers.loss_chunks_for(n) for n in (4096, 4100, 4098, 4095)] == [8, 4, 2, 1]
  odd = dataclasses.replace(s, sequence_length=4095)
  assert not any(x.startswith('LOSS_CHUNKS') for x in levers.advise(
      odd, **activations, temp=int(26.83 * gib), step='train_step'))
  # An encoder-decoder's loss has no chunks: never advised, whatever its logits.
  assert levers.advise(_t5_xl_on_a_v4_32(), parameters=gib, optimizer_state=0,
                       temp=33 * gib, step='eval_step') == [
      'a smaller BATCH_SIZE (is 256; --find_batch predicts the largest that fits)']


def test_levers_already_set_are_named_and_never_advised():
  from upcycle.fit import batch_fit, levers  # pylint: disable=g-import-not-at-top
  gib = 2**30
  xl = _t5_xl_on_a_v4_32()
  assert levers.already_set(xl) == [
      'SCAN_LAYERS = True', "REMAT_POLICY = 'full'",
      'num_expert_partitions = 16 (the most: E = 32 over 16 devices)',
      'T5XAdafactor.factored = True']
  activations = dict(parameters=int(9.53 * gib), optimizer_state=gib // 64, temp=33 * gib)
  advised = levers.advise(xl, **activations)
  assert advised == ['a smaller BATCH_SIZE (is 256; --find_batch predicts the largest that fits)']
  searched = batch_fit.BatchSearch({256: 33 * gib, 192: 30 * gib}, 192, int(30.75 * gib), 256,
                                   16)
  assert levers.advise(xl, **activations, search=searched) == [
      'BATCH_SIZE = 192 (the largest that fits, from --find_batch)']
  unset = levers.advise(_t5_xl_on_a_v4_32(scan_layers=False, remat_policy='dots'), **activations)
  assert [lever.split(' (')[0] for lever in unset] == [
      "REMAT_POLICY = 'full'", 'SCAN_LAYERS = True', 'a smaller BATCH_SIZE']
  assert not any('microbatches' in lever for lever in advised + unset)
  # The state dominates: the experts split as far as they go, FSDP over the data-parallel
  # devices (data x expert: 16 here), a factored optimizer in place of AdamW's full-size
  # moments.
  state = dict(parameters=20 * gib, optimizer_state=gib // 8, temp=8 * gib)
  assert levers.advise(xl, **state) == [
      "LOGICAL_AXIS_RULES = 'fsdp' (parameters and optimizer state split 16 ways over the "
      'data-parallel devices)']
  sharded = dataclasses.replace(xl, fsdp=True)
  assert levers.advise(sharded, **state) == []
  assert 'every lever for them is set' in levers.summary(sharded, **state)
  model_parallel = dataclasses.replace(xl, mesh={'data': 1, 'expert': 1, 'model': 16})
  assert not any(lever.startswith('LOGICAL_AXIS_RULES')
                 for lever in levers.advise(model_parallel, **state))
  fewer = _t5_xl_on_a_v4_32(mesh={'data': 2, 'expert': 8, 'model': 1})
  assert [lever.split(' (')[0] for lever in levers.advise(fewer, **state)] == [
      'trainer.TrainConfig.num_expert_partitions = 16', "LOGICAL_AXIS_RULES = 'fsdp'"]
  adam = _t5_xl_on_a_v4_32(mesh={'data': 16, 'expert': 1, 'model': 1}, num_experts=0,
                           optimizer='AdamW', factored=None, fsdp=True)
  assert levers.advise(adam, parameters=4 * gib, optimizer_state=8 * gib, temp=gib) == [
      'a factored optimizer (optimizers.T5XAdafactor, optimizers.Adafactor) in place of AdamW']
  assert "LOGICAL_AXIS_RULES = 'fsdp'" in levers.already_set(adam)


def test_the_largest_batch_is_where_the_line_through_two_compiles_meets_the_usable_hbm():
  from upcycle.fit import batch_fit  # pylint: disable=g-import-not-at-top
  gib = 2**30
  # total = 4 GiB + batch / 8 GiB: 30.75 GiB at batch 214, so 208 in multiples of 16.
  low, high = (128, 20 * gib), (256, 36 * gib)
  assert batch_fit.largest_batch(low, high, usable=int(30.75 * gib), multiple=16) == 208
  assert batch_fit.largest_batch(high, low, usable=int(30.75 * gib), multiple=1) == 214
  assert batch_fit.largest_batch(low, high, usable=4 * gib, multiple=16) == 0
  assert batch_fit.largest_batch(low, (256, 20 * gib), usable=gib, multiple=16) is None
  assert batch_fit.second_batch(256, 16) == 128 and batch_fit.second_batch(16, 16) == 32
  compiled = []

  def total_at(batch):
    compiled.append(batch)
    return 4 * gib + batch * gib // 8

  search = batch_fit.search(total_at, batch=256, total=36 * gib, usable=int(30.75 * gib),
                            multiple=16)
  assert compiled == [128, 208] and search.predicted == 208
  assert search.largest_fitting() == 208
  far = batch_fit.search(total_at, batch=16, total=4 * gib + 2 * gib, usable=int(30.75 * gib),
                         multiple=16)
  assert compiled[2:] == [32] and far.predicted == 208 and far.largest_fitting() == 32
  assert 'BATCH_SIZE = 208 (over 4 x 16: not compiled)' in far.lines()[0]


def test_a_batch_that_cannot_fit_is_compiled_at_the_smallest_and_a_larger_slice_named():
  """T5 XL's case on numbers: the parameters and optimizer state alone (30 GiB) leave too
  little of a v4 chip's 30.75 for even one example per device (2 GiB), so the line predicts
  0. The smallest batch is compiled (not claimed unfit uncompiled), and the slice named is
  the fewest devices, by doublings, with 30 / k + 2 <= 30.75 GiB: k = 2, 8 chips."""
  from upcycle.fit import aot, batch_fit, hbm  # pylint: disable=g-import-not-at-top
  gib = 2**30
  v4 = hbm.capacity('TPU v4')
  compiled = []

  def total_at(batch):   # 4 devices: 30 GiB of state, 2 GiB per example on a device
    compiled.append(batch)
    return 30 * gib + batch // 4 * 2 * gib

  search = batch_fit.search(total_at, batch=32, total=total_at(32), usable=v4.usable,
                            multiple=4)
  assert compiled == [32, 16, 4] and search.predicted == 0 and search.none_fits()
  assert search.smallest() == (32 * gib, True) and search.lever() is None
  assert ('the line predicts that no BATCH_SIZE fits; the smallest, 4, needs 32.00 GiB of the '
          '30.75 usable (compiled); none compiled fits') in search.lines()[0]
  assert search.as_json()['smallest_batch_bytes'] == 32 * gib
  report = aot.FunctionReport(
      arguments=30 * gib, outputs=0, alias=0, temp=34 * gib, code=0, hbm=v4,
      flops_per_device=1.0, devices=4, compile_seconds=1.0,
      parts={'parameters': 28 * gib, 'optimizer_state': 2 * gib, 'batch': 0})
  assert batch_fit.larger_slice(total=32 * gib, state=30 * gib, usable=v4.usable,
                                devices=4) == 8
  slice_lever = aot.larger_slice(report, search, devices=4, device_kind='TPU v4',
                                 megacore=True)
  assert slice_lever == (
      'no BATCH_SIZE fits, not even the smallest, 4: 32.00 GiB per device (compiled): a larger '
      'slice of 8 devices (--topology=v4:2x2x2) would hold it with the parameters and '
      'optimizer state split over them (FSDP, expert partitions)')
  settings = dataclasses.replace(_t5_xl_on_a_v4_32(), batch_size=32,
                                 mesh={'data': 1, 'expert': 4, 'model': 1})
  line = aot.advice(report, settings, search, slice_lever)
  assert line.endswith('levers not set: ' + slice_lever) and 'BATCH_SIZE =' not in line
  # Its compile failing, the smallest's total is the line's, and said to be predicted.
  failing = batch_fit.search(lambda b: None if b == 4 else total_at(b), batch=32,
                             total=total_at(32), usable=v4.usable, multiple=4)
  assert failing.smallest() == (32 * gib, False)
  assert '(predicted, not compiled)' in failing.lines()[0]
  # One example's activations alone over the usable HBM: no slice holds it.
  assert batch_fit.larger_slice(total=40 * gib, state=8 * gib, usable=v4.usable,
                                devices=4) is None
  # Per TensorCore (no megacore), devices are half chips: 16 cores are 8 chips.
  assert 'v4:2x2x2' in aot.larger_slice(report, search, devices=8, device_kind='TPU v4',
                                        megacore=False)
  # The batch's total is the larger step's; an eval step without one (refused without its
  # temporaries) leaves none, so no batch is said to fit on the train step's bytes alone.
  evaluating = dataclasses.replace(report, temp=36 * gib)
  assert aot.steps_total({'train_step': report, 'eval_step': evaluating},
                         aot.BATCH_STEPS) == 66 * gib
  assert aot.steps_total({'train_step': report}, aot.BATCH_STEPS) is None
  assert aot.steps_total({'train_step': report}, aot.BATCH_STEPS[:1]) == 64 * gib
  assert [aot.v4_topology(c) for c in (4, 8, 16, 32, 64, 128, 256, 512, 12)] == [
      'v4:2x2x1', 'v4:2x2x2', 'v4:2x2x4', 'v4:2x4x4', 'v4:4x4x4', 'v4:4x4x8', 'v4:4x8x8',
      'v4:8x8x8', None]


def test_the_counting_copies_compile_time_is_reported_apart():
  from upcycle.fit import aot, hbm  # pylint: disable=g-import-not-at-top
  report = aot.FunctionReport(
      arguments=1, outputs=0, alias=0, temp=1, code=0, hbm=hbm.capacity('TPU v4'),
      flops_per_device=1.0, devices=4, compile_seconds=7.0, parts={})

  def count():
    time.sleep(0.05)
    return 2e12, 1e9

  counted = aot.with_roofline(report, device_kind='TPU v4', megacore=True, count=count)
  assert counted.compile_seconds == 7.0 and counted.count_seconds >= 0.05
  assert (counted.flops_per_device, counted.extrapolated) == (2e12, True)
  assert counted.as_json()['count_compile_seconds'] == round(counted.count_seconds, 1)
  assert counted.as_json()['compile_seconds'] == 7.0


def test_the_restore_jit_lowers_without_the_donation_warning():
  """A restore jit for 4 v4 chips whose donated input no output can alias (no output of
  its size): lowered for TPU, JAX warns of it unless silenced."""
  import warnings  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  from upcycle.restore import state_jit  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(aot.topology_devices('v4:2x2x1')), ('expert',))
  replicated = NamedSharding(mesh, PartitionSpec())
  dense = jax.ShapeDtypeStruct((128, 256), np.float32, sharding=replicated)
  jitted = jax.jit(lambda inputs, saved, rng: jax.numpy.sum(inputs['w']),
                   out_shardings=replicated, donate_argnums=(0,))
  with warnings.catch_warnings(record=True) as plain:
    warnings.simplefilter('always')
    jitted.lower({'w': dense}, None, jax.ShapeDtypeStruct((2,), np.uint32))
  assert any('Some donated buffers were not usable' in str(w.message) for w in plain)
  restore = state_jit.StateJit(jitted, read=None, abstract=({'w': dense}, None), seed=0)
  with warnings.catch_warnings(record=True) as quiet:
    warnings.simplefilter('always')
    restore.lower()
  assert not any('donated' in str(w.message) for w in quiet)


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


@pytest.mark.slow   # 20 s: two gradients of megablox's kernels compiled for TPU
def test_megablox_compiles_for_tpu_where_a_dimension_is_under_128():
  """models/llama/tiny.gin's experts (d_model 64, d_ff 256), up and down: Mosaic takes a tile
  that is a multiple of 128 or the whole dimension, so each product of the backward tiles its
  own k and n (the forward's tiles, reused with k and n swapped, were refused)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from upcycle.grouped_kernels import GROUPED_KERNELS  # pylint: disable=g-import-not-at-top
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  one = NamedSharding(Mesh(np.array(aot.topology_devices('v4:2x2x1')[:1]), ('x',)),
                      PartitionSpec())
  spec = lambda *shape, dtype=np.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
  loss = lambda rows, kernel, sizes: jnp.sum(GROUPED_KERNELS['megablox'](rows, kernel, sizes) ** 2)
  for d_in, d_out in ((64, 256), (256, 64)):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        spec(1024, d_in), spec(8, d_in, d_out), spec(8, dtype=np.int32)).compile()
    assert 'tpu_custom_call' in compiled.as_text()   # megablox's kernels, not the blocked scan


@pytest.mark.slow   # ~30 s: a tiny Llama's train and eval steps compiled for 4 TPU v4 chips
def test_the_splash_kernels_flops_are_added_to_what_the_compiler_counts(tmp_path):
  """The compiler counts a Pallas call (the splash attention kernel, the Llama's default on
  TPU) as nothing; upcycle.aot adds the kernel's closed form. models/llama/tiny.gin (4 layers,
  4 query heads of 16), batch 8 x 128 in 2 microbatches over 4 chips: per chip and microbatch
  one row of one 128 x 128 tile, per layer 11 matmuls (the forward twice with full remat, the
  backward's 3 + 4) of 2 x 4 x 128² x 16 FLOPs; the eval step's 2 rows per chip once forward,
  in 2 microbatches too (`eval_microbatches`), each counted: the compiler's count of its loop
  is the forward pass of the whole batch, a third of the train step's model FLOPs."""
  command = [sys.executable, '-m', 'upcycle.aot', '--topology=v4:2x2x1',
             f'--json={tmp_path}/aot.json', '--gin_file=models/llama/tiny.gin',
             '--gin_file=runs/llm_pretrain.gin', '--gin_file=data/offline_stdlib_lm.gin',
             f"--gin.MODEL_DIR='{tmp_path}/run'", '--gin.TRAIN_STEPS=10', '--gin.BATCH_SIZE=8',
             "--gin.ACTIVATION_DTYPE='bfloat16'", "--gin.REMAT_POLICY='full'",
             '--gin.trainer.TrainConfig.num_microbatches=2',
             '--gin.trainer.TrainConfig.eval_microbatches=2']
  cache = tmp_path / 'cache'
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**os.environ, 'XLA_FLAGS': '',
                             'JAX_COMPILATION_CACHE_DIR': str(cache)})
  assert done.returncode == 0, done.stderr[-3000:]
  # No TPU executable goes to JAX's persistent cache: without a TPU client none can be read
  # back (a rerun's read of one warns and compiles again).
  assert not list(cache.glob('*-cache')), sorted(p.name for p in cache.iterdir())
  result = json.loads((tmp_path / 'aot.json').read_text())
  assert result['levers_set'][-2:] == ['num_microbatches = 2', 'eval_microbatches = 2']
  train, evaluation = result['functions']['train_step'], result['functions']['eval_step']
  matmul = 2 * 4 * 128 * 128 * 16
  assert train['kernel_flops_per_device'] == 2 * 4 * 11 * matmul
  assert evaluation['kernel_flops_per_device'] == 2 * 4 * 2 * matmul
  assert evaluation['extrapolated']
  forward = train['model_flops_per_step'] / 3
  evaluated = evaluation['flops_per_device'] + evaluation['kernel_flops_per_device']
  assert forward <= 4 * evaluated <= 1.5 * forward
  work = train['flops_per_device'] + train['kernel_flops_per_device']
  assert train['flops_per_step'] == 4 * work
  assert train['roofline_seconds'] == pytest.approx(
      max(work / 275e12, train['bytes_accessed_per_device'] / 1228e9), rel=1e-9)


def test_the_splash_kernel_is_compiled_exactly_where_its_flops_are_added():
  """`fused_attention.compiles_splash`, which decides whether upcycle.aot adds the kernel's
  FLOPs, against the program the TPU compiler builds: 4 rows over 4 chips hold the kernel (a
  Mosaic custom call); 1 row, which the chips cannot split, attends by the einsum."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from upcycle import fused_attention, partitioning  # pylint: disable=g-import-not-at-top
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  mesh = partitioning.make_mesh(devices=aot.topology_devices('v4:2x2x1'))
  attend = lambda q, k, v: fused_attention.attend(q, k, v, None, 'auto', 'bfloat16')
  with partitioning.activate(mesh):
    for rows in (4, 1):
      spec = lambda heads: jax.ShapeDtypeStruct(
          (rows, 128, heads, 16), jnp.bfloat16,
          sharding=NamedSharding(mesh, PartitionSpec('data' if rows == 4 else None)))
      compiled = jax.jit(attend).lower(spec(4), spec(2), spec(2)).compile()
      assert ('tpu_custom_call' in compiled.as_text()) == fused_attention.compiles_splash(
          'auto', rows, dropout=False) == (rows == 4), rows
