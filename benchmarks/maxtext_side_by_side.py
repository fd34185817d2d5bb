"""A Llama's train step on a v4 slice, compiled by this project and by MaxText, side by side.

  python benchmarks/maxtext_side_by_side.py --setup     # once: MaxText's own virtualenv
  python benchmarks/maxtext_side_by_side.py [--model llama3.2-1b|llama3.1-8b] [--venv DIR]
      [--workdir /tmp/maxtext_side_by_side] [--reuse_maxtext]

Both sides compile the same model for the same slice with the TPU compiler (libtpu), ahead of
time (no TPU): `MODELS[--model]`, Llama-3.2-1B on a v4-32 (`v4:2x2x4`, 16 chips, megacore) or
Llama-3.1-8B on a v4-64 (`v4:2x4x4`, 32 chips), batch 128 x 4096 tokens (in 2 microbatches,
gradient accumulation 2, where a column says so), bfloat16 activations, float32 parameters,
AdamW, full remat, scanned layers, parameters and moments fully sharded over the chips (FSDP).

- This project: the model's rows of benchmarks/tpu_fit.py (`Model.rows`): the fit table's row
  and the same with the loss's logits 8 slices of the sequence at a time
  (`--gin.LOSS_CHUNKS=8`), in 2 microbatches (and for the 1B in one): each one
  `python -m upcycle.aot` run (`tpu_fit.run_row`), attention by the model's default ('auto':
  jax's Pallas splash-attention kernel on TPU).
- MaxText (`maxtext` on the package registry, compiled in a virtualenv of its own made by
  `--setup` with `PINS`: MaxText needs Python >= 3.12 and never enters this project's
  environment): `train_compile`'s step (its AOT compile entry point) for the slice with the
  same dimensions (`maxtext_model`, the values of MaxText's own `llama3.1-8b` config for the
  8B; MaxText ships no Llama-3.2 config) and run settings (`MAXTEXT_RUN`: attention 'flash' =
  splash, blocks of 512), with as many accumulation steps as each upcycle row has
  microbatches: each upcycle row is held to MaxText's of the same microbatches. `DRIVER` runs
  `train_compile.main` in that venv and prints the compiled step's `memory_analysis()` and
  `cost_analysis()` as JSON.

Both sides count FLOPs and HBM bytes the same way (`upcycle/fit/step_count.py`): the
compiler counts a loop body once, so the counts are extrapolated from copies compiled with
their loops unrolled and the TPU compiler's windowed einsums off (`aot.COUNTING_OPTIONS`).
upcycle.aot does this for its rows; MaxText's copies have 1 and 2 layers, unscanned, on one
microbatch of the step's (no accumulation loop), and the step's count is the microbatches
times it (with 2, its AdamW update is counted twice: for the 1B about 2 GB, 0.3% of the
bytes). The compiler counts a Pallas kernel as nothing (the splash kernel on both sides), so
its work is added in closed form (`fused_attention.splash_flops`: the same kernel, blocks
and remat on both sides; upcycle.aot adds it to its rows itself, `kernel_flops_per_device`);
the bytes the kernel reads inside are in neither side's count. The roofline and MFU ceiling are
`upcycle/fit/roofline.py`'s from those counts, with this project's model FLOPs per step
(`models/flops.py`; the same model and tokens) for both. Prints a markdown table and writes
the model's entry of benchmarks/results/maxtext_side_by_side.json (every number, the commands,
the versions), keeping the other models' entries.
"""

import argparse
import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
# pylint: disable=g-import-not-at-top,wrong-import-position
import tpu_fit
from upcycle import fused_attention
from upcycle.fit import aot, roofline, step_count
# pylint: enable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
PINS = ('maxtext[tpu]==0.2.5', 'jax==0.12.0.1', 'jaxlib==0.12.0.1', 'libtpu==0.0.50.1')
MIN_PYTHON = (3, 12)
DEFAULT_VENV = os.path.expanduser('~/.cache/upcycle/maxtext-venv')
DEVICE_KIND = 'TPU v4'
SEQUENCE, BATCH = 4096, 128


class Model(NamedTuple):
  """A compared Llama: its dimensions in MaxText's names (`dims`), whether its output layer is
  the embedding (`tied`), the slice (`tpu`: tpu_fit's and MaxText's name, e.g. 'v4-64') and
  its chips, and its tpu_fit rows with their microbatches (MaxText is compiled with each
  number of them)."""
  dims: Mapping[str, int]
  tied: bool
  tpu: str
  chips: int
  rows: Mapping[str, int]


MODELS = {
    # configs/models/llama/llama3_2_1b.gin
    'llama3.2-1b': Model(
        dims={'vocab_size': 128256, 'emb_dim': 2048, 'num_query_heads': 32,
              'num_kv_heads': 8, 'head_dim': 64, 'mlp_dim': 8192, 'num_decoder_layers': 16},
        tied=True, tpu='v4-32', chips=16,
        rows={'llama3.2-1b-v4-32': 2, 'llama3.2-1b-loss8-v4-32': 1,
              'llama3.2-1b-loss8-mb2-v4-32': 2}),
    # configs/models/llama/llama3_1_8b.gin; MaxText's configs/models/llama3.1-8b.yml
    'llama3.1-8b': Model(
        dims={'vocab_size': 128256, 'emb_dim': 4096, 'num_query_heads': 32,
              'num_kv_heads': 8, 'head_dim': 128, 'mlp_dim': 14336, 'num_decoder_layers': 32},
        tied=False, tpu='v4-64', chips=32,
        rows={'llama3.1-8b-v4-64': 2, 'llama3.1-8b-loss8-mb2-v4-64': 2}),
}
MAXTEXT_RUN = {
    'compile_topology_num_slices': 1, 'run_name': 'side_by_side',
    'dataset_type': 'synthetic', 'enable_checkpointing': 'false',
    'max_target_length': SEQUENCE,
    'dtype': 'bfloat16', 'weight_dtype': 'float32', 'opt_type': 'adamw',
    'remat_policy': 'full', 'attention': 'flash',
    'jax_cache_dir': ''}   # no persistent compilation cache (MaxText's default: ~/jax_cache)
# The counting copies' compiler options, as MaxText's compile_xla_flags takes them.
COUNTING_FLAGS = ' '.join(f'--{k}={str(v).lower()}' for k, v in aot.COUNTING_OPTIONS.items())
MARKER = 'MAXTEXT_COMPILED '

# Runs in MaxText's venv: `python -c DRIVER HLO_PATH BASE_YML KEY=VALUE...`. Keeps the
# executable train_compile.main compiles, writes its HLO text to HLO_PATH and prints its
# memory and cost analyses and the packages' versions after MARKER.
DRIVER = f'''
import importlib.metadata, json, sys
from maxtext.trainers.pre_train import train_compile
kept = []
compile_step = train_compile.jit_and_compile
def keep(*args, **kwargs):
  kept.append(compile_step(*args, **kwargs))
  return kept[-1]
train_compile.jit_and_compile = keep
hlo_path = sys.argv.pop(1)
train_compile.main(sys.argv)
memory, cost = kept[-1].memory_analysis(), kept[-1].cost_analysis()
cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {{}}
with open(hlo_path, 'w') as f:
  f.write(kept[-1].as_text())
print({MARKER!r} + json.dumps({{
    'memory': {{k: int(getattr(memory, k)) for k in (
        'argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
        'temp_size_in_bytes', 'generated_code_size_in_bytes')}},
    'flops': float(cost.get('flops', 0.0)),
    'bytes_accessed': float(cost.get('bytes accessed', 0.0)),
    'versions': {{p: importlib.metadata.version(p)
                 for p in ('maxtext', 'jax', 'jaxlib', 'libtpu', 'flax')}}}}), flush=True)
'''


class SideBySideError(Exception):
  """A missing venv, a failed MaxText compile, output without the driver's JSON."""


def maxtext_model(model: Model) -> Dict[str, Any]:
  """`model`'s dimensions and architecture as MaxText's settings."""
  dims = model.dims
  return {**{f'base_{k}': v for k, v in dims.items() if k not in ('vocab_size', 'head_dim')},
          'vocab_size': dims['vocab_size'], 'head_dim': dims['head_dim'],
          'mlp_activations': '["silu","linear"]',
          'logits_via_embedding': str(model.tied).lower(),
          'normalization_layer_epsilon': '1e-5', 'rope_max_timescale': 500000,
          'decoder_block': 'llama2', 'enable_dropout': 'false'}


def llama_parameters(*, vocab_size: int, emb_dim: int, num_query_heads: int,
                     num_kv_heads: int, head_dim: int, mlp_dim: int,
                     num_decoder_layers: int, tied: bool) -> int:
  """A Llama's parameter count: the embedding (and the output layer unless `tied`), per layer
  q / k / v / o, the gated MLP's three matrices and two RMS norms' scales, and the final
  norm's."""
  attention = emb_dim * head_dim * (2 * num_query_heads + 2 * num_kv_heads)
  layer = attention + 3 * emb_dim * mlp_dim + 2 * emb_dim
  embeddings = (1 if tied else 2) * vocab_size * emb_dim
  return embeddings + num_decoder_layers * layer + emb_dim


def kernel_flops_per_chip(model: Model) -> float:
  """The splash kernel's FLOPs per chip in MaxText's train step of `model` (BATCH over its
  chips, full remat: the forward twice), by this project's closed form of the same kernel and
  blocks (`fused_attention.splash_flops`, as the upcycle rows' `kernel_flops_per_device`)."""
  return model.dims['num_decoder_layers'] * fused_attention.splash_flops(
      rows=BATCH // model.chips, length=SEQUENCE, heads=model.dims['num_query_heads'],
      kv_heads=model.dims['num_kv_heads'], head_dim=model.dims['head_dim'], forwards=2,
      backward=True)


def maxtext_args(venv: str, workdir: str, *, model: Model, layers: int, microbatches: int,
                 scan: bool) -> List[str]:
  """`train_compile`'s arguments: MaxText's base.yml in `venv`, then key=value settings
  (its output directory in `workdir`): `model` on its slice, FSDP over its chips; with `scan`
  the step of `layers` scanned layers accumulating `microbatches` of the batch, else a
  counting copy of `layers` unscanned layers on one such microbatch, windowed einsums off."""
  run = {**MAXTEXT_RUN, 'base_output_directory': os.path.join(workdir, 'maxtext_output'),
         'compile_topology': model.tpu, 'ici_fsdp_parallelism': model.chips,
         'per_device_batch_size': BATCH // model.chips // microbatches,
         'scan_layers': str(scan).lower(),
         'gradient_accumulation_steps': microbatches if scan else 1}
  dims = {**maxtext_model(model), 'base_num_decoder_layers': layers}
  counting = {} if scan else {'compile_xla_flags': COUNTING_FLAGS}
  return [maxtext_base_yml(venv)] + [f'{k}={v}' for k, v in {**dims, **run,
                                                             **counting}.items()]


def venv_python(venv: str) -> str:
  return os.path.join(venv, 'bin', 'python')


def maxtext_base_yml(venv: str) -> str:
  site = f'python{MIN_PYTHON[0]}.{MIN_PYTHON[1]}'
  return os.path.join(venv, 'lib', site, 'site-packages', 'maxtext', 'configs', 'base.yml')


def parse_driver_output(stdout: str, log: str) -> Dict[str, Any]:
  """The JSON `DRIVER` printed after MARKER in `stdout` (written to `log`)."""
  for line in stdout.splitlines():
    if line.startswith(MARKER):
      return json.loads(line[len(MARKER):])
  raise SideBySideError(f"MaxText's compile printed no {MARKER.strip()} line: see {log}")


def maxtext_env(environ: Mapping[str, str]) -> Dict[str, str]:
  """MaxText's compile environment from this process's `environ`: the TPU compiler with no TPU
  (`aot.LIBTPU_ENV`), no XLA_FLAGS, and none of this project's modules, platform or libtpu
  (its jax points TPU_LIBRARY_PATH at its own venv's libtpu, which MaxText's jax refuses:
  'no such field: debug_locations')."""
  env = {k: v for k, v in environ.items()
         if k not in ('JAX_PLATFORMS', 'PYTHONPATH', 'TPU_LIBRARY_PATH')}
  return {**env, **aot.LIBTPU_ENV, 'XLA_FLAGS': ''}


def compile_maxtext(venv: str, workdir: str, name: str, args: Sequence[str]) -> Dict[str, Any]:
  """Runs DRIVER in `venv` with `args`; its parsed JSON with the HLO path and seconds."""
  python = venv_python(venv)
  if not os.path.exists(python):
    raise SideBySideError(f'no MaxText venv at {venv}: run this script with --setup '
                          f'(--venv {venv}) first')
  hlo = os.path.join(workdir, f'{name}.hlo.txt')
  log = os.path.join(workdir, f'{name}.log')
  start = time.perf_counter()
  done = subprocess.run([python, '-c', DRIVER, hlo, *args], cwd=workdir,
                        env=maxtext_env(os.environ),
                        capture_output=True, text=True)
  with open(log, 'w') as f:
    f.write(done.stdout + done.stderr)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ['(no output)'])[-1]
    raise SideBySideError(f"MaxText's compile {name} exited {done.returncode}: {last} "
                          f'(see {log})')
  return {**parse_driver_output(done.stdout, log), 'hlo': hlo,
          'seconds': round(time.perf_counter() - start, 1),
          'command': ['python', '-m', 'maxtext.trainers.pre_train.train_compile', *args]}


def maxtext_side(venv: str, workdir: str, name: str, microbatches: int) -> Dict[str, Any]:
  """MaxText's step of `MODELS[name]` in `microbatches` (memory) and its counting copies
  (FLOPs, bytes: `microbatches` x the 1- and 2-layer copies' extrapolation to its layers)."""
  model = MODELS[name]
  layers = model.dims['num_decoder_layers']
  prefix = f'{name}_maxtext_mb{microbatches}'
  step = compile_maxtext(venv, workdir, f'{prefix}_step',
                         maxtext_args(venv, workdir, model=model, layers=layers,
                                      microbatches=microbatches, scan=True))
  copies = {}

  def count_at(periods: Tuple[int, ...]) -> step_count.Counts:
    copy = compile_maxtext(venv, workdir, f'{prefix}_count_{periods[0]}_layers',
                           maxtext_args(venv, workdir, model=model, layers=periods[0],
                                        microbatches=microbatches, scan=False))
    loops = step_count.loops_over_matmuls(open(copy['hlo']).read())
    if loops:
      raise SideBySideError(f"MaxText's counting copy still loops over matmuls, at {loops[0]}")
    copies[periods[0]] = copy
    return copy['flops'], copy['bytes_accessed']

  flops, accessed = step_count.extrapolate(count_at, (layers,))
  return {'microbatches': microbatches, 'step': step, 'counting_copies': copies,
          'flops_per_device': microbatches * flops,
          'bytes_accessed_per_device': microbatches * accessed}


def column(*, parameters: float, optimizer_state: float, temp: float, compiler_flops: float,
           kernel_flops: float, bytes_accessed: float, model_flops_per_step: float,
           chips: int) -> Dict[str, Any]:
  """One side's per-chip numbers (bytes, FLOPs per step) with the roofline and MFU ceiling
  they imply on `chips` v4 chips (megacore), the kernel's FLOPs added to the compiler's."""
  flops = compiler_flops + kernel_flops
  bound = roofline.roofline(flops_per_device=flops, bytes_per_device=bytes_accessed,
                            device_kind=DEVICE_KIND, devices=chips,
                            model_flops=model_flops_per_step)
  return {'parameters': parameters, 'optimizer_state': optimizer_state, 'temp': temp,
          'compiler_flops': compiler_flops, 'kernel_flops': kernel_flops, 'flops': flops,
          'bytes_accessed': bytes_accessed, 'roofline_seconds': bound.seconds,
          'roofline_bound': bound.bound, 'mfu_ceiling': bound.mfu}


def upcycle_column(row: Mapping[str, Any], model: Model) -> Dict[str, Any]:
  """`column` of a tpu_fit row of `model` (upcycle.aot's JSON) for its train step."""
  step = row['functions']['train_step']
  b = step['per_device_bytes']
  return column(parameters=b['parameters'], optimizer_state=b['optimizer_state'],
                temp=b['temp'], compiler_flops=step['flops_per_device'],
                kernel_flops=step['kernel_flops_per_device'],
                bytes_accessed=step['bytes_accessed_per_device'],
                model_flops_per_step=step['model_flops_per_step'], chips=model.chips)


def maxtext_column(side: Mapping[str, Any], model: Model,
                   model_flops_per_step: float) -> Dict[str, Any]:
  """`column` of `maxtext_side`'s result: its parameters and AdamW moments float32, fully
  sharded (the compiler reports its arguments whole)."""
  parameters = llama_parameters(**model.dims, tied=model.tied) * 4 / model.chips
  return column(parameters=parameters, optimizer_state=2 * parameters,
                temp=side['step']['memory']['temp_size_in_bytes'],
                compiler_flops=side['flops_per_device'],
                kernel_flops=kernel_flops_per_chip(model),
                bytes_accessed=side['bytes_accessed_per_device'],
                model_flops_per_step=model_flops_per_step, chips=model.chips)


# (label, how to show a column's value) per table row.
ROWS = (
    ('parameters / optimizer state (GiB)',
     lambda c: f'{c["parameters"] / GIB:.3f} / {c["optimizer_state"] / GIB:.3f}'),
    ('temporaries (GiB)', lambda c: f'{c["temp"] / GIB:.2f}'),
    ('TFLOP per step (compiler + splash kernel)',
     lambda c: f'{c["flops"] / 1e12:.1f} ({c["compiler_flops"] / 1e12:.1f} + '
               f'{c["kernel_flops"] / 1e12:.1f})'),
    ('GB accessed per step', lambda c: f'{c["bytes_accessed"] / 1e9:.0f}'),
    ('roofline (s), bound', lambda c: f'{c["roofline_seconds"]:.2f}, {c["roofline_bound"]}'),
    ('MFU ceiling', lambda c: f'{100 * c["mfu_ceiling"]:.0f}%'),
)
# The ratio shown per table row: upcycle's value over MaxText's.
RATIOS = (lambda c: c['parameters'] + c['optimizer_state'], lambda c: c['temp'],
          lambda c: c['flops'], lambda c: c['bytes_accessed'],
          lambda c: c['roofline_seconds'], lambda c: c['mfu_ceiling'])


def table(columns: Mapping[str, Mapping[str, Any]],
          pairs: Sequence[Tuple[str, str]]) -> str:
  """Markdown: a row per measure, a column per side (`columns`' keys, in order), then a
  ratio column per (ours, theirs) of `pairs`: ours' value over theirs'."""
  head = (['per chip, train step'] + list(columns)
          + [f'{ours} / {theirs}' for ours, theirs in pairs])
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for (label, show), ratio in zip(ROWS, RATIOS):
    cells = [label] + [show(c) for c in columns.values()]
    cells += [f'{ratio(columns[ours]) / ratio(columns[theirs]):.2f}' for ours, theirs in pairs]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def maxtext_name(microbatches: int) -> str:
  return f'MaxText, {microbatches} microbatch' + ('es' if microbatches > 1 else '')


def setup(venv: str, python: str) -> None:
  """MaxText's venv at `venv` from `python` (>= MIN_PYTHON), with PINS installed."""
  try:
    found = subprocess.run([python, '-c', 'import sys; print(tuple(sys.version_info[:2]))'],
                           capture_output=True, text=True, check=False)
  except OSError:   # no such program
    found = None
  if not found or found.returncode or ast.literal_eval(found.stdout.strip()) < MIN_PYTHON:
    raise SideBySideError(
        f'--python {python} is not Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} (MaxText needs '
        'it): name one, e.g. --python ~/.pyenv/versions/3.12.1/bin/python')
  if not os.path.exists(venv_python(venv)):
    subprocess.run([python, '-m', 'venv', venv], check=True)
  subprocess.run([venv_python(venv), '-m', 'pip', 'install', *PINS], check=True)


def versions() -> Dict[str, str]:
  return {p: importlib.metadata.version(p) for p in ('jax', 'jaxlib', 'libtpu', 'flax')}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--setup', action='store_true', help="create MaxText's venv (PINS) and stop")
  p.add_argument('--model', choices=sorted(MODELS), default='llama3.2-1b',
                 help='the compared Llama and its slice')
  p.add_argument('--venv', default=DEFAULT_VENV, help="MaxText's virtualenv")
  p.add_argument('--python', default='python3.12',
                 help='the Python (>= 3.12) --setup makes the venv from')
  p.add_argument('--workdir', default='/tmp/maxtext_side_by_side')
  p.add_argument('--output', default=os.path.join(REPO, 'benchmarks', 'results',
                                                  'maxtext_side_by_side.json'))
  p.add_argument('--reuse_maxtext', action='store_true',
                 help="MaxText's side as --output's entry for the model recorded it (compiled "
                      'with the same PINS), not compiled again: for a change on this side only')
  return p


def recorded_maxtext(path: str, name: str) -> Dict[str, Any]:
  """MaxText's columns of model `name` as the JSON at `path` recorded them; refused in one
  line where there are none, or where they were compiled with other PINS."""
  entry = {}
  if os.path.exists(path):
    with open(path) as f:
      entry = json.load(f).get(name, {})
  if not entry.get('maxtext'):
    raise SideBySideError(f'--reuse_maxtext: {path} records no MaxText side of {name}: run '
                          'without it')
  if entry.get('maxtext_pins') != list(PINS):
    raise SideBySideError(f'--reuse_maxtext: {path} recorded MaxText with '
                          f'{entry.get("maxtext_pins")}, not {list(PINS)}: run without it')
  return entry['maxtext']


def run(args: argparse.Namespace) -> None:
  if args.setup:
    setup(args.venv, args.python)
    return
  os.makedirs(args.workdir, exist_ok=True)
  model = MODELS[args.model]
  # MaxText first: a missing venv stops the run before this project's minutes of compiles.
  theirs = (recorded_maxtext(args.output, args.model) if args.reuse_maxtext else
            {maxtext_name(m): maxtext_side(args.venv, args.workdir, args.model, m)
             for m in sorted(set(model.rows.values()), reverse=True)})
  rows = {}
  for name in model.rows:
    rows[name] = tpu_fit.run_row(name, args.workdir)
    if 'error' in rows[name]:
      raise SideBySideError(f'upcycle.aot {name}: {rows[name]["error"]}')
  model_flops = next(iter(rows.values()))['functions']['train_step']['model_flops_per_step']
  columns = {**{n: upcycle_column(r, model) for n, r in rows.items()},
             **{n: maxtext_column(side, model, model_flops) for n, side in theirs.items()}}
  pairs = [(n, maxtext_name(m)) for n, m in model.rows.items()]
  print(table(columns, pairs))
  first = next(iter(theirs.values()))
  entry = {'columns': columns, 'ratios': pairs, 'upcycle': rows, 'maxtext': theirs,
           'versions': {'upcycle': versions(), 'maxtext': first['step']['versions']},
           'maxtext_pins': list(PINS)}
  write_entry(args.output, args.model, entry)


def write_entry(path: str, name: str, entry: Mapping[str, Any]) -> None:
  """Writes `entry` as model `name`'s in the JSON at `path`, keeping the other models'."""
  document = {}
  if os.path.exists(path):
    with open(path) as f:
      document = json.load(f)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump({**document, name: entry}, f, indent=2)


def main(argv: Sequence[str]) -> None:
  try:
    run(build_parser().parse_args(argv))
  except SideBySideError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  main(sys.argv[1:])
