"""Where the time to a Llama MoE's first training step goes, on this machine's CPU.

  python benchmarks/time_to_first_step.py [--repeats 3]
                                          [--json benchmarks/results/time_to_first_step.json]

The run is the LLM user's first command (docs/llm.md): an HF Llama directory of
`models/llama/tiny.gin`'s shapes (written by transformers, with the offline BPE's tokenizer
files) upcycled in the restore hook into `moe/mixtral.gin`'s MoE (8 experts, top 2) by
`models/hf.gin` + `runs/llm_upcycle.gin` on `data/offline_stdlib_lm.gin`, one step. Each
repeat is a fresh `python -m upcycle.train`-equivalent process; its phases are timed from
inside it:

  imports       the modules a training run imports: JAX, flax, optax, orbax, gin, and
                TensorFlow and seqio (for the data pipeline)
  tracing       JAX's own durations of jaxpr tracing and of lowering to StableHLO, summed over
                every function jitted before the first step (`jax.monitoring`)
  compile       XLA's compilation of those functions (`backend_compile_duration`)
  the rest      to the end of the first step: gin, the tokenizer, the first batches, reading
                and upcycling the checkpoint, running the step
  exit          from the run's end (its summary printed) to the process's end: the
                interpreter's shutdown

once with an empty persistent compilation cache (JAX's, which the command-line tools turn on:
`platforms.cache_compilations`; here JAX_COMPILATION_CACHE_DIR names a new one per repeat)
and once more against the cache the first run wrote; each of the two as the command runs
(the garbage collector off during its imports and frozen at exit: `upcycle.startup`) and with
the collector left on, the baseline. Prints a table of medians (and min-max) and writes JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_STEP = 'train step 1/1'
PHASES = ('imports', 'tracing', 'compile', 'rest', 'first_step', 'exit')
# How the timed process treats the garbage collector: as the command does, or left on.
COLLECTORS = ('command', 'left_on')
_TRACING_EVENTS = ('/jax/core/compile/jaxpr_trace_duration',
                   '/jax/core/compile/jaxpr_to_mlir_module_duration')
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


def _write_source(directory: str) -> None:
  """A dense HF Llama of models/llama/tiny.gin's shapes with the offline BPE's files."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
  model.save_pretrained(directory)
  tokenizer.load(tokenizer.OFFLINE_BPE).save(directory)


def _argv(source: str, model_dir: str):
  return ['--gin_file=models/hf.gin', '--gin_file=moe/mixtral.gin',
          '--gin_file=runs/llm_upcycle.gin', '--gin_file=data/offline_stdlib_lm.gin',
          f"--gin.HF_MODEL='{source}'", '--gin.INITIAL_CHECKPOINT_PATH=%HF_MODEL',
          f"--gin.MODEL_DIR='{model_dir}'", '--gin.TRAIN_STEPS=1']


def child(collector: str, argv) -> None:
  """One timed run (in this process, as `python -m upcycle.train` runs; with `collector`
  'left_on', without its `startup.begin()`): prints the phases' seconds as JSON on the last
  line, with the time the run ended."""
  start = time.perf_counter()
  if collector == 'command':
    from upcycle import startup  # pylint: disable=g-import-not-at-top
    startup.begin()
  import logging  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top,unused-import
  from upcycle.train import __main__ as train_main
  from upcycle import restore
  from upcycle.train import trainer
  from upcycle.data import lm
  # pylint: enable=g-import-not-at-top,unused-import
  imports = time.perf_counter() - start
  import jax  # pylint: disable=g-import-not-at-top
  durations = {'tracing': 0.0, 'compile': 0.0}

  def listen(event, seconds, **_):
    if event in _TRACING_EVENTS:
      durations['tracing'] += seconds
    elif event == _COMPILE_EVENT:
      durations['compile'] += seconds

  jax.monitoring.register_event_duration_secs_listener(listen)
  timings = {}

  class FirstStep(logging.Handler):
    def emit(self, record):
      if not timings and record.getMessage().startswith(FIRST_STEP):
        total = time.perf_counter() - start
        timings.update(imports=imports, **durations, first_step=total,
                       rest=total - imports - durations['tracing'] - durations['compile'])

  logging.getLogger('upcycle').addHandler(FirstStep())
  sys.modules['__main__'].train = train_main.train   # what `python -m upcycle.train` binds
  train_main.main(argv)
  print(json.dumps({**timings, 'ended_at': time.time()}), flush=True)


def _run(source: str, cache: str, collector: str) -> dict:
  with tempfile.TemporaryDirectory() as model_dir:
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_COMPILATION_CACHE_DIR=cache)
    done = subprocess.run(
        [sys.executable, __file__, '--child', collector, *_argv(source, model_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    ended = time.time()
  if done.returncode:
    raise SystemExit(f'the timed run failed:\n{done.stderr[-3000:]}')
  timings = json.loads(done.stdout.strip().splitlines()[-1])
  return {**timings, 'exit': ended - timings.pop('ended_at')}


def _summary(rows):
  return {phase: {'median': statistics.median(r[phase] for r in rows),
                  'min': min(r[phase] for r in rows), 'max': max(r[phase] for r in rows)}
          for phase in PHASES}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--json', default=os.path.join(ROOT, 'benchmarks', 'results',
                                                     'time_to_first_step.json'))
  return parser


def main() -> None:
  if sys.argv[1:2] == ['--child']:
    child(sys.argv[2], sys.argv[3:])
    return
  args = build_parser().parse_args()
  rows = {f'{cache}, collector {collector}': []
          for cache in ('empty_cache', 'warm_cache') for collector in COLLECTORS}
  with tempfile.TemporaryDirectory() as scratch:
    source = os.path.join(scratch, 'llama')
    _write_source(source)
    for _ in range(args.repeats):
      for collector in COLLECTORS:   # interleaved: the machine's drift falls on both alike
        cache = tempfile.mkdtemp(dir=scratch)
        # An empty cache (every function compiled), then the same run again (read back).
        rows[f'empty_cache, collector {collector}'].append(_run(source, cache, collector))
        rows[f'warm_cache, collector {collector}'].append(_run(source, cache, collector))
  result = {'machine': f'{os.cpu_count()} CPU cores', 'repeats': args.repeats,
            'run': ' '.join(['python -m upcycle.train', *_argv('<hf dir>', '<model dir>')]),
            **{name: _summary(r) for name, r in rows.items()}}
  print(f'{"seconds (median, min-max)":<34}' + ''.join(f'{p:>17}' for p in PHASES))
  for name in rows:
    cells = ''.join(f'{s["median"]:>6.1f} ({s["min"]:.1f}-{s["max"]:.1f})'.rjust(17)
                    for s in result[name].values())
    print(f'{name:<34}{cells}')
  os.makedirs(os.path.dirname(args.json), exist_ok=True)
  with open(args.json, 'w') as f:
    json.dump(result, f, indent=1)
  print(f'Wrote {args.json}')


if __name__ == '__main__':
  main()
