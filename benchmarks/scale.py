"""Compile time and compiled memory of big T5 MoE train steps: scanned vs unrolled, remat.

  python benchmarks/scale.py [--batch 64 --measure_batch 8 --measure_num_experts 32]

1. Lowers and compiles (never runs, nothing allocated: abstract `ShapeDtypeStruct` inputs) the
   train step of T5 v1.1 Large + `moe/paper_t5.gin` (E=32, every other layer) — T5X's
   Adafactor, the state donated as the trainer does — unrolled and scanned, remat 'none' and
   'full', on the default backend (CPU here), and reports lowering and compile seconds and the
   compiled memory analysis (temp / argument / output / alias bytes).
2. Runs measured training steps of `t5_1_1/base.gin` + `moe/paper_t5.gin` at a small batch
   (`--measure_num_experts` overrides E where host memory is short), unrolled and scanned.

Prints tables and writes benchmarks/results/scale.json.
"""

import argparse
import dataclasses
import json
import os
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np

from upcycle import gin_utils, partitioning, tree
from upcycle.convert import target_from_gin
from upcycle.models import T5
from upcycle.train import objectives, optimizers
from upcycle.train_state import TrainState
from upcycle.train.step import make_train_step

GiB = 2 ** 30


def config_from_gin(files, bindings=()):
  gin.clear_config()
  gin_utils.parse_files_and_bindings(files, bindings, finalize=False)
  return target_from_gin()


def train_step_and_state(config, batch, inputs_length, targets_length):
  """-> jitted train step, abstract TrainState, abstract batch (no array allocated)."""
  model = T5(config)
  objective = objectives.Seq2Seq(model)
  enc = jax.ShapeDtypeStruct((batch, inputs_length), jnp.int32)
  dec = jax.ShapeDtypeStruct((batch, targets_length), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), enc, dec)['params']
  adafactor = optimizers.T5XAdafactor()
  optimizer = adafactor.build(partitioning.logical_axes(boxed))
  params = tree.unbox(boxed)
  state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                     jax.eval_shape(optimizer.init, params))
  data = {'encoder_input_tokens': enc, 'decoder_input_tokens': dec,
          'decoder_target_tokens': dec}
  step = jax.jit(make_train_step(objective, optimizer, adafactor.schedule), donate_argnums=(0,))
  return step, state, data


def compile_row(config, args):
  step, state, data = train_step_and_state(config, args.batch, args.inputs_length,
                                           args.targets_length)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  start = time.perf_counter()
  lowered = step.lower(state, data, rng)
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  get = lambda name: None if memory is None else int(getattr(memory, name, 0))
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  return {'scan_layers': config.scan_layers, 'remat_policy': config.remat_policy,
          'lower_s': lower_s, 'compile_s': compile_s, 'params': params,
          'temp_bytes': get('temp_size_in_bytes'),
          'argument_bytes': get('argument_size_in_bytes'),
          'output_bytes': get('output_size_in_bytes'),
          'alias_bytes': get('alias_size_in_bytes')}


def measured_row(config, args):
  step, abstract_state, abstract_data = train_step_and_state(
      config, args.measure_batch, args.inputs_length, args.targets_length)
  model = T5(config)
  rng = np.random.default_rng(0)
  data = {k: jnp.asarray(rng.integers(1, config.vocab_size, v.shape), jnp.int32)
          for k, v in abstract_data.items()}
  start = time.perf_counter()
  compiled = step.lower(abstract_state, data, jax.random.PRNGKey(0)).compile()
  compile_s = time.perf_counter() - start
  params = tree.unbox(model.init(jax.random.PRNGKey(0), data['encoder_input_tokens'][:1],
                                 data['decoder_input_tokens'][:1]))['params']
  opt_state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_state.opt_state)
  state = TrainState(jnp.zeros((), jnp.int32), params, opt_state)
  state, metrics = compiled(state, data, jax.random.PRNGKey(0))   # warm-up step
  jax.block_until_ready(state)
  times = []
  for _ in range(args.measure_steps):
    start = time.perf_counter()
    state, metrics = compiled(state, data, jax.random.PRNGKey(0))
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
  return {'scan_layers': config.scan_layers, 'remat_policy': config.remat_policy,
          'num_experts': config.encoder_moe.num_experts, 'compile_s': compile_s,
          'step_s': float(np.median(times)), 'loss': float(metrics['loss'])}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='models/t5_1_1/large.gin')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--inputs_length', type=int, default=512)
  parser.add_argument('--targets_length', type=int, default=114)
  parser.add_argument('--variants', default='unrolled:none,unrolled:full,scan:none,scan:full',
                      help='comma-separated layout:remat_policy pairs to compile')
  parser.add_argument('--measure_model', default='models/t5_1_1/base.gin')
  parser.add_argument('--measure_batch', type=int, default=8)
  parser.add_argument('--measure_num_experts', type=int, default=32)
  parser.add_argument('--measure_steps', type=int, default=2)
  parser.add_argument('--measure_variants', default='unrolled:none,scan:none',
                      help="'' to skip the measured steps")
  parser.add_argument('--output', default=os.path.join(os.path.dirname(__file__), 'results',
                                                       'scale.json'))
  return parser


def main():
  args = build_parser().parse_args()

  large = config_from_gin([args.model, 'moe/paper_t5.gin'])
  rows = []
  print(f'{args.model} + moe/paper_t5.gin, batch {args.batch} x ({args.inputs_length}, '
        f'{args.targets_length}), backend {jax.default_backend()}: compile only')
  print(f'{"layout":9s} {"remat":7s} {"lower s":>8s} {"compile s":>10s} {"temp GiB":>9s} '
        f'{"argument GiB":>13s} {"output GiB":>11s} {"alias GiB":>10s}')
  for variant in filter(None, args.variants.split(',')):
    layout, policy = variant.split(':')
    config = dataclasses.replace(large, scan_layers=layout == 'scan', remat_policy=policy)
    row = compile_row(config, args)
    rows.append(row)
    gib = lambda key: '' if row[key] is None else f'{row[key] / GiB:.2f}'
    print(f'{layout:9s} {policy:7s} {row["lower_s"]:8.1f} {row["compile_s"]:10.1f} '
          f'{gib("temp_bytes"):>9s} {gib("argument_bytes"):>13s} {gib("output_bytes"):>11s} '
          f'{gib("alias_bytes"):>10s}', flush=True)

  measured = []
  if args.measure_variants:
    base = config_from_gin([args.measure_model, 'moe/paper_t5.gin'],
                           [f'NUM_EXPERTS = {args.measure_num_experts}'])
    print(f'\n{args.measure_model} + moe/paper_t5.gin (E={args.measure_num_experts}), batch '
          f'{args.measure_batch} x ({args.inputs_length}, {args.targets_length}): measured steps')
    print(f'{"layout":9s} {"remat":7s} {"compile s":>10s} {"step s":>8s} {"loss":>8s}')
    for variant in args.measure_variants.split(','):
      layout, policy = variant.split(':')
      config = dataclasses.replace(base, scan_layers=layout == 'scan', remat_policy=policy)
      row = measured_row(config, args)
      measured.append(row)
      print(f'{layout:9s} {policy:7s} {row["compile_s"]:10.1f} {row["step_s"]:8.2f} '
            f'{row["loss"]:8.3f}', flush=True)

  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, 'w') as f:
    json.dump({'args': vars(args), 'backend': jax.default_backend(), 'compile': rows,
               'measured': measured}, f, indent=2)
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
