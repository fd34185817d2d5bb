"""MoE layer vs the dense MLP it replaces: forward+backward time and compiled memory.

  python benchmarks/moe_layer.py [--d_model 256 --d_ff 1024 --batch 8 --length 256 --experts 8]

Prints a table and writes benchmarks/results/moe_layer.json. The dense MLP is measured in the
same run as the baseline; times are medians over repeats after compilation.
"""

import argparse
import functools
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from upcycle import layers
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses


def measure(fn, *args, repeats):
  compiled = jax.jit(fn).lower(*args).compile()
  memory = compiled.memory_analysis()
  temp = getattr(memory, 'temp_size_in_bytes', None) if memory is not None else None
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), temp


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--d_ff', type=int, default=1024)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--experts', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument('--output', default=os.path.join(os.path.dirname(__file__), 'results',
                                                       'moe_layer.json'))
  args = parser.parse_args()
  x = jax.random.normal(jax.random.PRNGKey(0), (args.batch, args.length, args.d_model))
  expert = functools.partial(layers.GatedMlp, d_ff=args.d_ff)

  def dense_loss(params, x):
    return jnp.sum(expert().apply({'params': params}, x, True) ** 2)

  rows = []
  dense_params = nn.meta.unbox(expert().init(jax.random.PRNGKey(1), x, True))['params']
  seconds, temp = measure(jax.value_and_grad(dense_loss), dense_params, x, repeats=args.repeats)
  rows.append({'layer': 'dense MLP', 'seconds': seconds, 'temp_bytes': temp})
  for router, k, factor in (('experts_choose', 1, 2.0), ('tokens_choose', 2, 1.25)):
    for dispatch in ('masked', 'indices'):
      config = MoeConfig(num_experts=args.experts, router=router, k=k, dispatch=dispatch,
                         train_capacity_factor=factor, eval_capacity_factor=factor)
      layer = MoeLayer(config, expert)
      params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x, True))['params']

      def moe_loss(params, x, layer=layer):
        y, state = layer.apply({'params': params}, x, True, mutable=MOE_COLLECTIONS)
        return jnp.sum(y ** 2) + aux_losses(state)['total']

      seconds, temp = measure(jax.value_and_grad(moe_loss), params, x, repeats=args.repeats)
      rows.append({'layer': f'MoE {router} k={k} C={factor} {dispatch}', 'seconds': seconds,
                   'temp_bytes': temp})
  base = rows[0]['seconds']
  print(f'{args.batch}x{args.length} tokens, d_model {args.d_model}, d_ff {args.d_ff}, '
        f'E={args.experts}, backend {jax.default_backend()}')
  print(f'{"layer":45s} {"ms (fwd+bwd)":>13s} {"x dense":>8s} {"temp MiB":>9s}')
  for row in rows:
    temp = '' if row['temp_bytes'] is None else f'{row["temp_bytes"] / 2**20:.1f}'
    print(f'{row["layer"]:45s} {row["seconds"] * 1e3:13.2f} {row["seconds"] / base:8.2f} '
          f'{temp:>9s}')
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, 'w') as f:
    json.dump({'args': vars(args), 'backend': jax.default_backend(), 'rows': rows}, f, indent=2)
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
