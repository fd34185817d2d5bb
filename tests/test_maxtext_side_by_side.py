"""benchmarks/maxtext_side_by_side.py's own logic, without MaxText's venv or a compile: the
parameter count and the splash kernel's FLOPs against published and closed-form numbers, the
roofline / MFU / ratio math against a table measured by hand before the benchmark existed,
MaxText's settings against its batch arithmetic, the driver's output parsed, and its one-line
refusals."""

import importlib.util
import json
import os
import re
import shlex
import sys

import pytest

from tests.helpers import REPO, refusal

GIB = 2 ** 30


@pytest.fixture(scope='module')
def bench():
  path = os.path.join(REPO, 'benchmarks', 'maxtext_side_by_side.py')
  spec = importlib.util.spec_from_file_location('maxtext_side_by_side', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# meta-llama's published parameter counts (Llama-3.2-1B's embedding tied, Llama-3.1-8B's
# not), and float32 over the slice's chips, the bytes per chip upcycle.aot counts from the
# shardings (benchmarks/results/tpu_fit.json's llama3.2-1b-v4-32 and llama3.1-8b-v4-64 rows).
PUBLISHED = {'llama3.2-1b': (1_235_814_400, 308_953_600),
             'llama3.1-8b': (8_030_261_248, 1_003_782_656)}


@pytest.mark.parametrize('name', sorted(PUBLISHED))
def test_llama_parameters_is_the_published_count(bench, name):
  model = bench.MODELS[name]
  count = bench.llama_parameters(**model.dims, tied=model.tied)
  assert (count, count * 4 // model.chips) == PUBLISHED[name]


@pytest.mark.parametrize('name', sorted(PUBLISHED))
def test_models_rows_are_tpu_fit_rows_of_the_model_and_slice(bench, name):
  model = bench.MODELS[name]
  gin = {'llama3.2-1b': 'models/llama/llama3_2_1b.gin',
         'llama3.1-8b': 'models/llama/llama3_1_8b.gin'}[name]
  for row, microbatches in model.rows.items():
    fit = bench.tpu_fit.ROWS[row]
    assert (fit.model_gin, fit.tpu) == (gin, model.tpu)
    # A v4-N slice has N / 2 chips (megacore).
    assert int(model.tpu.split('-')[1]) // 2 == model.chips
    assert bench.tpu_fit.SLICES[model.tpu] == {16: 'v4:2x2x4', 32: 'v4:2x4x4'}[model.chips]
    bound = [f for f in fit.family if 'num_microbatches' in f]
    assert bound == ([] if microbatches == 1 else
                     [f'--gin.trainer.TrainConfig.num_microbatches={microbatches}'])


def test_maxtexts_kernel_flops_are_the_hand_computed(bench):
  # MaxText's 1B step, per chip: 128 rows over 16 chips = 8, 32 query heads of 64, 16 layers;
  # 8 x 8 tiles of 512, 36 on or below the diagonal; 11 matmuls per layer (the forward twice
  # with remat, the backward's 3 + 4) of 2 x 4096² x 64 FLOPs per head and row.
  by_hand = 11 * 2 * 8 * 32 * 16_777_216 * 64 * 36 // 64 * 16
  assert by_hand == 54_425_825_574_912   # 54.4 TFLOP
  assert bench.kernel_flops_per_chip(bench.MODELS['llama3.2-1b']) == by_hand


def test_splash_flops_of_llama_3_1_8b_is_the_hand_computed(bench):
  # Per chip: 128 rows over 32 chips = 4, 32 query heads of 128, 32 layers; 8 x 8 tiles of
  # 512, 36 on or below the diagonal; 11 matmuls per layer of 2 x 4096² x 128 FLOPs per head
  # and row: 11 x 2 x 4 x 32 x 16,777,216 x 128 x 36 / 64 x 32 FLOPs, twice the 1B's
  # (half the rows, twice the head size and the layers).
  by_hand = 11 * 2 * 4 * 32 * 16_777_216 * 128 * 36 // 64 * 32
  assert by_hand == 108_851_651_149_824   # 108.9 TFLOP
  assert bench.kernel_flops_per_chip(bench.MODELS['llama3.1-8b']) == by_hand
  assert by_hand == 2 * bench.kernel_flops_per_chip(bench.MODELS['llama3.2-1b'])


# Measured by hand before the benchmark (this project's einsum-attention 1B row and MaxText
# 0.2.5's train_compile), per chip: (TFLOP, GB accessed, roofline s, bound, MFU ceiling),
# with the model's 4731.7 TFLOP per step (upcycle.aot's model_flops_per_step for the row).
MODEL_FLOPS = 4731748290134016.0
BY_HAND = {'upcycle': (362.2, 4532, 3.69, 'memory', 0.29),
         'maxtext': (344.1, 706, 1.25, 'compute', 0.86)}


@pytest.mark.parametrize('side', sorted(BY_HAND))
def test_column_roofline_and_mfu_are_the_hand_measured(bench, side):
  tflop, gb, seconds, bound, mfu = BY_HAND[side]
  c = bench.column(parameters=0.288 * GIB, optimizer_state=0.575 * GIB, temp=GIB,
                   compiler_flops=(tflop - 50) * 1e12, kernel_flops=50e12,
                   bytes_accessed=gb * 1e9, model_flops_per_step=MODEL_FLOPS, chips=16)
  assert c['flops'] == pytest.approx(tflop * 1e12)
  assert c['roofline_seconds'] == pytest.approx(seconds, abs=0.005)
  assert c['roofline_bound'] == bound
  assert c['mfu_ceiling'] == pytest.approx(mfu, abs=0.005)


def test_table_ratios_are_the_hand_measured(bench):
  def side(params, opt, temp, tflop, gb):
    return bench.column(parameters=params * GIB, optimizer_state=opt * GIB, temp=temp * GIB,
                        compiler_flops=tflop * 1e12, kernel_flops=0.0,
                        bytes_accessed=gb * 1e9, model_flops_per_step=MODEL_FLOPS,
                        chips=16)
  text = bench.table({'row': side(0.288, 0.575, 26.83, 362.2, 4532),
                      'MaxText': side(0.288, 0.576, 11.20, 344.1, 706)},
                     pairs=[('row', 'MaxText')])
  lines = text.splitlines()
  assert lines[0] == '| per chip, train step | row | MaxText | row / MaxText |'
  cells = {line.split(' | ')[0][2:]: line.strip('| ').split(' | ')[1:] for line in lines[2:]}
  assert cells['temporaries (GiB)'] == ['26.83', '11.20', '2.40']
  assert cells['GB accessed per step'] == ['4532', '706', '6.42']
  assert cells['roofline (s), bound'] == ['3.69, memory', '1.25, compute', '2.95']
  assert cells['MFU ceiling'] == ['29%', '86%', '0.34']
  assert cells['TFLOP per step (compiler + splash kernel)'][2] == '1.05'


def test_maxtext_settings_are_the_rows_batch_and_counting_copies(bench, tmp_path):
  def settings(**kwargs):
    args = bench.maxtext_args('/venv', str(tmp_path), model=bench.MODELS['llama3.2-1b'],
                              **kwargs)
    assert args[0].endswith(os.path.join('site-packages', 'maxtext', 'configs', 'base.yml'))
    return dict(arg.split('=', 1) for arg in args[1:])
  step = settings(layers=16, microbatches=2, scan=True)
  # MaxText's global batch: devices x per_device_batch_size x gradient_accumulation_steps.
  assert 16 * int(step['per_device_batch_size']) * int(step['gradient_accumulation_steps']) == 128
  assert (step['scan_layers'], step['max_target_length'], step['base_num_decoder_layers'],
          step['remat_policy'], step['weight_dtype'], step['dtype']) == (
              'true', '4096', '16', 'full', 'float32', 'bfloat16')
  assert 'compile_xla_flags' not in step and step['jax_cache_dir'] == ''   # compiled afresh
  whole = settings(layers=16, microbatches=1, scan=True)
  assert (whole['per_device_batch_size'], whole['gradient_accumulation_steps']) == ('8', '1')
  copy = settings(layers=2, microbatches=2, scan=False)   # one of the step's 2 microbatches
  assert (copy['scan_layers'], copy['gradient_accumulation_steps'],
          copy['base_num_decoder_layers'], copy['per_device_batch_size']) == (
              'false', '1', '2', '4')
  assert copy['compile_xla_flags'].split() == [
      '--xla_tpu_enable_windowed_einsum_for_all_gather=false',
      '--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false']
  assert (step['compile_topology'], step['ici_fsdp_parallelism'],
          step['logits_via_embedding']) == ('v4-32', '16', 'true')


def test_maxtext_settings_of_llama_3_1_8b_are_maxtexts_own_config(bench, tmp_path):
  # MaxText 0.2.5's configs/models/llama3.1-8b.yml, copied here.
  own = {'base_emb_dim': '4096', 'base_num_query_heads': '32', 'base_num_kv_heads': '8',
         'base_num_decoder_layers': '32', 'base_mlp_dim': '14336', 'head_dim': '128',
         'mlp_activations': '["silu","linear"]', 'vocab_size': '128256',
         'enable_dropout': 'false', 'logits_via_embedding': 'false',
         'normalization_layer_epsilon': '1e-5', 'rope_max_timescale': '500000',
         'decoder_block': 'llama2'}
  args = bench.maxtext_args('/venv', str(tmp_path), model=bench.MODELS['llama3.1-8b'],
                            layers=32, microbatches=2, scan=True)
  step = dict(arg.split('=', 1) for arg in args[1:])
  assert {k: step[k] for k in own} == own
  # FSDP over the v4-64's 32 chips; 32 x 2 per chip x 2 accumulation steps = batch 128.
  assert (step['compile_topology'], step['ici_fsdp_parallelism'],
          step['per_device_batch_size'], step['gradient_accumulation_steps']) == (
              'v4-64', '32', '2', '2')


def test_maxtext_env_leaves_this_projects_libtpu_and_modules_out(bench):
  env = bench.maxtext_env({'TPU_LIBRARY_PATH': '/ours/libtpu.so', 'PYTHONPATH': '/repo',
                           'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '--xla_dump_to=/d',
                           'HOME': '/root', 'TPU_ACCELERATOR_TYPE': 'v5p-8'})
  assert env == {'HOME': '/root', 'XLA_FLAGS': '', 'TPU_SKIP_MDS_QUERY': '1',
                 'TPU_ACCELERATOR_TYPE': 'v4-8', 'TPU_WORKER_HOSTNAMES': 'localhost',
                 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}


def test_write_entry_keeps_the_other_models(bench, tmp_path):
  path = str(tmp_path / 'results' / 'side.json')
  bench.write_entry(path, 'llama3.2-1b', {'columns': {'a': 1}})
  bench.write_entry(path, 'llama3.1-8b', {'columns': {'b': 2}})
  bench.write_entry(path, 'llama3.1-8b', {'columns': {'b': 3}})
  with open(path) as f:
    assert json.load(f) == {'llama3.2-1b': {'columns': {'a': 1}},
                            'llama3.1-8b': {'columns': {'b': 3}}}


def test_parse_driver_output(bench):
  out = 'Starting train_compile.py...\nMAXTEXT_COMPILED {"flops": 2.5, "memory": {}}\nbye\n'
  assert bench.parse_driver_output(out, 'x.log') == {'flops': 2.5, 'memory': {}}
  with pytest.raises(bench.SideBySideError,
                     match=r"^MaxText's compile printed no MAXTEXT_COMPILED line: see x.log$"):
    bench.parse_driver_output('Finished train_compile.py successfully!\n', 'x.log')


def test_refuses_a_missing_venv_in_one_line(bench, tmp_path, capsys):
  venv = str(tmp_path / 'none')
  message = refusal(bench.main, ['--venv', venv, '--workdir', str(tmp_path / 'w')], capsys)
  assert message == (f'error: no MaxText venv at {venv}: run this script with --setup '
                     f'(--venv {venv}) first')


@pytest.mark.parametrize('python', ['older', 'missing'])
def test_setup_refuses_a_python_it_cannot_use_without_making_a_venv(bench, tmp_path, capsys,
                                                                    python):
  if python == 'older' and sys.version_info[:2] >= (3, 12):
    pytest.skip('this Python is new enough for MaxText')
  python = sys.executable if python == 'older' else str(tmp_path / 'no-python')
  venv = tmp_path / 'venv'
  message = refusal(bench.main, ['--setup', '--venv', str(venv), '--python', python], capsys)
  assert message == (f'error: --python {python} is not Python >= 3.12 (MaxText needs '
                     'it): name one, e.g. --python ~/.pyenv/versions/3.12.1/bin/python')
  assert not venv.exists()


def test_documented_commands_parse(bench):
  shown = []
  for name in ('pods.md', 'development.md'):
    with open(os.path.join(REPO, 'docs', name)) as f:
      shown += re.findall(r'benchmarks/maxtext_side_by_side\.py([^\n`#]*)', f.read())
  assert shown
  for flags in shown:
    bench.build_parser().parse_args(shlex.split(flags))


def test_reuse_maxtext_takes_the_recorded_side_compiled_with_the_same_pins(bench, tmp_path):
  """--reuse_maxtext: a change on this project's side is held to MaxText's columns as the
  committed JSON records them; a record made with other pins, or none, is refused."""
  recorded = os.path.join(REPO, 'benchmarks', 'results', 'maxtext_side_by_side.json')
  with open(recorded) as f:
    document = json.load(f)
  for name, model in bench.MODELS.items():
    sides = bench.recorded_maxtext(recorded, name)
    assert sorted(sides) == sorted(bench.maxtext_name(m) for m in set(model.rows.values()))
    assert sides == document[name]['maxtext']
  other = tmp_path / 'other.json'
  other.write_text(json.dumps({'llama3.2-1b': {**document['llama3.2-1b'],
                                               'maxtext_pins': ['maxtext==0.0.1']}}))
  with pytest.raises(bench.SideBySideError, match=r"recorded MaxText with \['maxtext==0.0.1'\]"):
    bench.recorded_maxtext(str(other), 'llama3.2-1b')
  with pytest.raises(bench.SideBySideError, match='records no MaxText side of llama3.1-8b'):
    bench.recorded_maxtext(str(other), 'llama3.1-8b')
