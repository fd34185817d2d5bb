"""MoE layer speed and memory: each dispatch against pure experts, the dense MLP, Flaxformer.

  python benchmarks/moe_layer.py [--flaxformer DIR] [--quick] [--repeats 5]

Work (forward + backward: value_and_grad of sum(y^2) w.r.t. the parameters and the input),
float32, tokens [8, 512, 768], gated-GELU experts with d_ff 2048; three cases:

  EC C=2, E=8    8 groups x 512 tokens, 128 slots per expert and group
  EC C=2, E=32   32 groups x 128 tokens, 8 slots
  Top-2 BPR, E=8 8 groups x 512 tokens, 160 slots (T5X capacity factor 2.5)

Groups and capacity follow T5X/Flaxformer (`capacity_convention='t5x'`,
`max_group_size=length`). Rows per case, all measured in one process, interleaved:
  dense MLP       the MLP the MoE layer replaces, on all tokens
  pure experts    the vmapped expert MLPs on already-dispatched [E, groups*capacity, d]
                  inputs: the floor any dispatch can reach
  ours <dispatch> `MoeLayer` with dispatch='masked' and 'indices'
  ... +metrics    the same with the auxiliary losses in the loss and every logged metric
                  returned (what a training step computes)
  flaxformer ...  with --flaxformer DIR (a directory holding flaxformer/, e.g. from
                  `git archive HEAD flaxformer` of google/flaxformer; never a dependency):
                  Flaxformer's MoeLayer with its masked (and, for Top-K, scatter) router on
                  the same groups and capacity. Before timing, both layers get the same
                  weights and their outputs and gradients are checked to agree.

Times are medians over repeats after compilation; memory is XLA's compiled temporary
memory. Prints a table and writes benchmarks/results/moe_layer.json.
"""

import argparse
import functools
import json
import os
import sys
import time
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from upcycle import layers
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses

CASES = (  # name, experts, router, k, T5X capacity factor
    ('EC C=2, E=8', 8, 'experts_choose', 1, 2.0),
    ('EC C=2, E=32', 32, 'experts_choose', 1, 2.0),
    ('Top-2 BPR, E=8', 8, 'tokens_choose', 2, 2.5),
)


class Compiled:
  """A jitted value_and_grad, compiled once; `()` runs it, `.temp_bytes` is its scratch."""

  def __init__(self, loss, *args, has_aux=False):
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=has_aux)
    self._compiled = jax.jit(grad).lower(*args).compile()
    self._args = args
    memory = self._compiled.memory_analysis()
    self.temp_bytes = getattr(memory, 'temp_size_in_bytes', None) if memory else None
    self()

  def __call__(self):
    return jax.block_until_ready(self._compiled(*self._args))


def median_seconds(runs, repeats):
  """Median time of each run; interleaved, so that load on the machine hits all alike."""
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def expert_mlp(d_ff):
  return functools.partial(layers.GatedMlp, d_ff=d_ff)


def dense(x, d_ff):
  mlp = expert_mlp(d_ff)()
  params = nn.meta.unbox(mlp.init(jax.random.PRNGKey(1), x, True))['params']
  return Compiled(lambda p, x: jnp.sum(mlp.apply({'params': p}, x, True) ** 2), params, x)


def pure_experts(num_experts, slots, d_model, d_ff):
  """The vmapped expert MLPs on `[E, slots, d_model]` inputs, nothing else."""
  experts = nn.vmap(expert_mlp(d_ff), in_axes=(0, None), out_axes=0,
                    variable_axes={'params': 0}, split_rngs={'params': True},
                    metadata_params={nn.PARTITION_NAME: 'expert'})(intermediate_axes=None)
  x = jax.random.normal(jax.random.PRNGKey(3), (num_experts, slots, d_model))
  params = nn.meta.unbox(experts.init(jax.random.PRNGKey(1), x, True))['params']
  return Compiled(lambda p, x: jnp.sum(experts.apply({'params': p}, x, True) ** 2), params, x)


def moe_config(num_experts, router, k, factor, length, dispatch):
  return MoeConfig(num_experts=num_experts, router=router, k=k, train_capacity_factor=factor,
                   eval_capacity_factor=factor, capacity_convention='t5x',
                   min_expert_capacity=1, max_group_size=length, dispatch=dispatch,
                   batch_priority_routing=router == 'tokens_choose')


def ours(x, config, d_ff, with_metrics=False):
  layer = MoeLayer(config, expert_mlp(d_ff))
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x, True))['params']

  def loss(p, x):
    y, state = layer.apply({'params': p}, x, True, mutable=MOE_COLLECTIONS)
    if not with_metrics:
      return jnp.sum(y ** 2)
    return jnp.sum(y ** 2) + aux_losses(state)['total'], state['moe_metrics']

  return Compiled(loss, params, x, has_aux=with_metrics), layer, params


def import_flaxformer(directory):
  """Flaxformer's MoE modules from a checkout; its dense layers import aqt (quantization,
  unused here), which is stood in for by empty modules when it is not installed."""
  try:
    import aqt.jax_legacy.jax.quantization  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    names = ('aqt', 'aqt.jax_legacy', 'aqt.jax_legacy.jax', 'aqt.jax_legacy.jax.flax_layers',
             'aqt.jax_legacy.jax.quant_config', 'aqt.jax_legacy.jax.quantization')
    for name in names:
      sys.modules.setdefault(name, types.ModuleType(name))
    for parent, child in zip(names, names[1:]):
      setattr(sys.modules[parent], child.rsplit('.', 1)[1], sys.modules[child])
    quantization = sys.modules['aqt.jax_legacy.jax.quantization']
    quantization.QuantOps = types.SimpleNamespace(WeightParams=object, ActHParams=object)
    quantization.QuantType = types.SimpleNamespace(FAKE_QUANT='fake_quant', AQT='aqt')
  sys.path.insert(0, os.path.abspath(directory))
  from flaxformer.architectures.moe import moe_layers, routing  # pylint: disable=g-import-not-at-top
  from flaxformer.components import dense as ff_dense  # pylint: disable=g-import-not-at-top
  return moe_layers, routing, ff_dense


FLAXFORMER_RULES = [(name, None) for name in (
    'batch', 'length', 'embed', 'mlp', 'heads', 'kv', 'vocab', 'expert', 'expert_group',
    'expert_replicas', 'unmodeled', 'mlp_activations', 'joined_kv')]


def flaxformer(flax_modules, x, num_experts, router, k, factor, d_ff, scatter):
  """Flaxformer's MoeLayer on `x`: (Compiled, apply(params, x) -> y, its params)."""
  moe_layers, routing, ff_dense = flax_modules
  weights = routing.RouterWeights(dtype=jnp.float32, use_bias=False)
  common = dict(router_weights=weights, jitter_noise=0.0, dtype=jnp.float32,
                ignore_padding_tokens=False)
  if router == 'experts_choose':
    ff_router = routing.ExpertsChooseMaskedRouter(**common)
  else:
    cls = routing.TokensChooseScatterRouter if scatter else routing.TokensChooseMaskedRouter
    ff_router = cls(num_selected_experts=k, batch_prioritized_routing=True, **common)
  expert = ff_dense.MlpBlock(use_bias=False, intermediate_dim=d_ff,
                             activations=('gelu', 'linear'), intermediate_dropout_rate=0.0,
                             final_dropout_rate=0.0, dtype=jnp.float32)
  layer = moe_layers.MoeLayer(
      num_experts=num_experts, max_group_size=x.shape[1], train_capacity_factor=factor,
      eval_capacity_factor=factor, expert=expert, router=ff_router,
      num_expert_partitions=num_experts, num_model_partitions=1, dropout_rate=0.0,
      dtype=jnp.float32, min_expert_capacity=1)

  def apply(p, x):
    with nn.logical_axis_rules(FLAXFORMER_RULES):
      return layer.apply({'params': p}, x, enable_dropout=False, mutable=['intermediates'])[0]

  with nn.logical_axis_rules(FLAXFORMER_RULES):
    params = nn.meta.unbox(layer.init(
        {'params': jax.random.PRNGKey(1), 'jitter': jax.random.PRNGKey(2)}, x,
        enable_dropout=False))['params']
  return Compiled(lambda p, x: jnp.sum(apply(p, x) ** 2), params, x), apply, params


def check_same_function(our_layer, our_params, ff_apply, ff_params, x):
  """With our weights copied into Flaxformer's layer, outputs and gradients must agree."""
  copied = jax.tree.map(lambda a: a, ff_params)
  for name in ('wi_0', 'wi_1', 'wo'):
    copied['expert'][name]['kernel'] = our_params['expert'][name]['kernel']
  copied['router']['router_weights']['w']['kernel'] = (
      our_params['router']['router_weights']['w']['kernel'])

  def ours_loss(x):
    return jnp.sum(our_layer.apply({'params': our_params}, x, True, mutable=MOE_COLLECTIONS)[0]
                   ** 2)

  ours_y = our_layer.apply({'params': our_params}, x, True, mutable=MOE_COLLECTIONS)[0]
  theirs_y = ff_apply(copied, x)
  scale = float(jnp.max(jnp.abs(theirs_y)))
  np.testing.assert_allclose(ours_y, theirs_y, atol=1e-5 * scale, rtol=0)
  ours_dx = jax.grad(ours_loss)(x)
  theirs_dx = jax.grad(lambda x: jnp.sum(ff_apply(copied, x) ** 2))(x)
  np.testing.assert_allclose(ours_dx, theirs_dx, atol=1e-4 * float(jnp.max(jnp.abs(theirs_dx))),
                             rtol=0)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--flaxformer', default=None,
                      help='directory holding a flaxformer/ checkout, to measure it alongside')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--length', type=int, default=512)
  parser.add_argument('--d_model', type=int, default=768)
  parser.add_argument('--d_ff', type=int, default=2048)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--quick', action='store_true', help='4x128 tokens, d 128, d_ff 256')
  parser.add_argument('--output', default=os.path.join(os.path.dirname(__file__), 'results',
                                                       'moe_layer.json'))
  args = parser.parse_args()
  if args.quick:
    args.batch, args.length, args.d_model, args.d_ff, args.repeats = 4, 128, 128, 256, 3
  flax_modules = import_flaxformer(args.flaxformer) if args.flaxformer else None
  x = jax.random.normal(jax.random.PRNGKey(0), (args.batch, args.length, args.d_model))
  print(f'{args.batch}x{args.length} tokens, d_model {args.d_model}, d_ff {args.d_ff} (gated '
        f'GELU), float32, forward+backward, backend {jax.default_backend()}, '
        f'{os.cpu_count()} CPUs, median of {args.repeats}', flush=True)
  dense_run = dense(x, args.d_ff)
  rows, verdicts = [], []
  for name, num_experts, router, k, factor in CASES:
    config = moe_config(num_experts, router, k, factor, args.length, 'indices')
    plan = config.group_plan(args.batch, args.length)
    capacity = config.capacity(plan.group_size, deterministic=True)
    runs = {'dense MLP': dense_run,
            'pure experts': pure_experts(num_experts, plan.num_groups * capacity,
                                         args.d_model, args.d_ff)}
    for dispatch in ('masked', 'indices'):
      config = moe_config(num_experts, router, k, factor, args.length, dispatch)
      runs[f'ours {dispatch}'], layer, params = ours(x, config, args.d_ff)
    runs['ours indices +metrics'] = ours(x, config, args.d_ff, with_metrics=True)[0]
    if flax_modules:
      for scatter in ((False, True) if router == 'tokens_choose' else (False,)):
        run, apply, ff_params = flaxformer(flax_modules, x, num_experts, router, k, factor,
                                           args.d_ff, scatter)
        check_same_function(layer, params, apply, ff_params, x)
        runs[f'flaxformer {"scatter" if scatter else "masked"}'] = run
    seconds = median_seconds(runs, args.repeats)
    pure = seconds['pure experts']
    print(f'\n{name}: {plan.num_groups} groups x {plan.group_size} tokens, {capacity} slots per '
          f'expert and group')
    print(f'  {"":24s} {"ms":>8s} {"x pure":>7s} {"temp MiB":>9s} {"x pure":>7s}')
    for impl, run in runs.items():
      temp = run.temp_bytes
      ratio = '' if temp is None else f'{temp / runs["pure experts"].temp_bytes:7.2f}'
      print(f'  {impl:24s} {seconds[impl] * 1e3:8.1f} {seconds[impl] / pure:7.2f} '
            f'{"" if temp is None else f"{temp / 2**20:9.1f}"} {ratio}')
      rows.append({'case': name, 'impl': impl, 'seconds': seconds[impl], 'temp_bytes': temp})
    best = min(('ours masked', 'ours indices'), key=seconds.get)
    verdict = {'case': name, 'ours_best': best,
               'ours_over_pure_time': seconds[best] / pure,
               'ours_over_pure_memory': runs[best].temp_bytes / runs['pure experts'].temp_bytes,
               'metrics_cost': seconds['ours indices +metrics'] / seconds['ours indices'] - 1}
    if flax_modules:
      theirs = min((impl for impl in runs if impl.startswith('flaxformer')), key=seconds.get)
      verdict.update(flaxformer_best=theirs,
                     ours_over_flaxformer_time=seconds[best] / seconds[theirs],
                     ours_over_flaxformer_memory=runs[best].temp_bytes / runs[theirs].temp_bytes)
    verdicts.append(verdict)
  print('\nours best per case:')
  for v in verdicts:
    line = (f'  {v["case"]:16s} {v["ours_best"]:13s} time {v["ours_over_pure_time"]:.2f}x pure, '
            f'memory {v["ours_over_pure_memory"]:.2f}x pure, metrics +{100 * v["metrics_cost"]:.1f}%')
    if 'flaxformer_best' in v:
      line += (f'; vs {v["flaxformer_best"]}: time {v["ours_over_flaxformer_time"]:.2f}x, '
               f'memory {v["ours_over_flaxformer_memory"]:.2f}x')
    print(line)
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, 'w') as f:
    json.dump({'args': vars(args), 'backend': jax.default_backend(), 'cpus': os.cpu_count(),
               'rows': rows, 'verdicts': verdicts}, f, indent=2)
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
