"""MoE layer speed and memory: each dispatch against pure experts, the dense MLP, Flaxformer.

  python benchmarks/moe_layer.py [--flaxformer DIR] [--quick] [--repeats 5]
  python benchmarks/moe_layer.py --topology v4:2x2x1 [--mesh 1x4x1] [--flaxformer DIR]
  [--only Top-2] [--papers]

Work (forward + backward: value_and_grad of sum(y^2) w.r.t. the parameters and the input),
float32, tokens [8, 512, 768], gated-GELU experts with d_ff 2048; three cases:

  EC C=2, E=8    8 groups x 512 tokens, 128 slots per expert and group
  EC C=2, E=32   32 groups x 128 tokens, 8 slots
  Top-2 BPR, E=8 8 groups x 512 tokens, 160 slots (T5X capacity factor 2.5)

Groups and capacity follow T5X/Flaxformer (`capacity.T5X()`,
`grouping.Flaxformer(max_group_size=length)`). Rows per case, all measured in one process,
interleaved:
  dense MLP       the MLP the MoE layer replaces, on all tokens
  pure experts    the vmapped expert MLPs on already-dispatched [E, groups*capacity, d]
                  inputs: the floor any dispatch can reach
  ours <dispatch> `MoeLayer` with dispatch='masked' and 'indices'; for Top-K also 'ragged'
                  (dropless: every token's k choices, sorted rows through ragged_dot; on
                  CPU a masked dense product over all experts, E times the work) and
                  'ragged blocked' (the rows in blocks, each by its expert's kernel: what
                  grouped_kernel 'megablox' runs off TPU)
  ... +metrics    the same with the auxiliary losses in the loss and every logged metric
                  returned (what a training step computes)
  flaxformer ...  with --flaxformer DIR (a directory holding flaxformer/, e.g. from
                  `git archive HEAD flaxformer` of google/flaxformer; never a dependency):
                  Flaxformer's MoeLayer with its masked (and, for Top-K, scatter) router on
                  the same groups and capacity. Before timing, both layers get the same
                  weights and their outputs and gradients are checked to agree.

Times are medians over repeats after compilation; memory is XLA's compiled temporary
memory. Prints a table and writes benchmarks/results/moe_layer.json.

With --topology (e.g. v4:2x2x1) nothing runs: the same cases (rows as above, without
+metrics) are compiled by the TPU compiler (libtpu) for that topology's devices, on this
host. Activations are bfloat16 (as on TPU), parameters float32. The mesh is the trainer's
('data', 'expert', 'model'), by default 1 x devices x 1 (--mesh DxExM); parameters are sharded
by their logical axes as in training, the tokens' batch over ('expert', 'data'), the pure
experts' input [E, slots, d] like the layer's expert slots (experts over 'expert'). The batch
is 32 sequences per data x expert shard (128 on v4:2x2x1: 16,384 tokens per chip; a given
--batch is rounded up to a multiple of the shards), so group counts differ from the CPU
cases (printed per case): at the CPU mode's 1,024 tokens per chip the compiler kept the
scratch of the E=8 EC rows in the v4 chip's on-chip memory (0 temporary HBM bytes for all).
Flaxformer's layer gets T5X's MoE rule `expert_replicas` -> 'data' and num_expert_partitions =
the 'expert' axis, as T5X runs it (it counts expert replicas from this host's devices: 1, so
its groups match only a mesh with data 1); its equality check with ours needs execution, so
it is done in the CPU mode only. Per case and row, per device: temporary HBM bytes
(`memory_analysis()`), the compiler's FLOPs and bytes accessed (`cost_analysis()`) and the
compile seconds, and the roofline time max(FLOPs / 275 TFLOP/s, bytes / 1.2 TB/s), a v4
chip's bfloat16 peak and HBM bandwidth: the least time the work can take. Prints a table and
writes benchmarks/results/moe_layer_tpu.json.

--papers (with --topology): the cases at the group sizes the configs run at (PAPER_CASES:
T5's groups of 4096 for the encoder's Expert Choice and the decoder's Top-2, ViT's one group
per 197-token image, Mixtral's one group per 4096-token sequence, dropless), about 32,768
tokens per chip, with the dropless rows 'ours ragged'
(`jax.lax.ragged_dot`) and 'ours ragged megablox' (megablox's Pallas `gmm` / `tgmm`; its
FLOPs and bytes are the kernel's own declared estimate) and the floor 'pure experts (k
rows/token)'. Writes benchmarks/results/moe_layer_tpu_papers.json.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import types
from typing import Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from upcycle import layers, partitioning, platforms
from upcycle.fit import aot
from upcycle.moe import (MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses, capacity, grouping,
                         routers)
from upcycle.moe.slots import EXPERT_SLOT_AXES

@dataclasses.dataclass(frozen=True)
class Case:
  """One MoE layer setting: groups and capacity by T5X's rules (`capacity.T5X()`,
  `max_group_size`: groups span examples up to that many tokens; None: --length)."""

  name: str
  num_experts: int
  router: str
  k: int
  factor: float                        # T5X capacity factor (slots = round(factor * S / E))
  batch_priority: bool = True          # Top-K only
  max_group_size: Optional[int] = None
  length: Optional[int] = None         # sequence length; None: --length
  sequences_per_shard: Optional[int] = None   # with --topology; None: 32
  dropless: bool = False               # Top-K: also the dropless rows (ragged, megablox)


CASES = (
    Case('EC C=2, E=8', 8, 'experts_choose', 1, 2.0),
    Case('EC C=2, E=32', 32, 'experts_choose', 1, 2.0),
    Case('Top-2 BPR, E=8', 8, 'tokens_choose', 2, 2.5, dropless=True),
)
# --papers: the group sizes the configs run at, about 32,768 tokens per chip (the T5 cases need 32
# groups of 4096 for Flaxformer's rule, groups >= E). T5 (moe/paper_t5.gin): groups of up to
# 4096 tokens, the encoder's Expert Choice and the decoder's Top-2 (no BPR: causal); ViT
# (moe/paper_vit.gin): one group per image, 197 tokens at 224^2/16; Mixtral (moe/mixtral.gin):
# one group per sequence of 4096, dropless, beside slot dispatches at capacity factor 2.5
# (1.25 slots per choice, some tokens dropped).
PAPER_CASES = (
    Case('T5 enc EC C=2, E=32, groups 4096', 32, 'experts_choose', 1, 2.0,
         max_group_size=4096, length=512, sequences_per_shard=64),
    Case('T5 dec Top-2, E=32, groups 4096', 32, 'tokens_choose', 2, 1.25, batch_priority=False,
         max_group_size=4096, length=512, sequences_per_shard=64),
    Case('ViT EC C=2, E=32, groups 197', 32, 'experts_choose', 1, 2.0, max_group_size=197,
         length=197, sequences_per_shard=166),
    Case('Mixtral Top-2, E=8, groups 4096', 8, 'tokens_choose', 2, 2.5, batch_priority=False,
         max_group_size=4096, length=4096, sequences_per_shard=8, dropless=True),
)
# TPU v4 per chip (megacore): bfloat16 peak and HBM bandwidth (Cloud TPU v4 documentation).
V4_PEAK_FLOPS, V4_HBM_BYTES_PER_SECOND = 275e12, 1.2e12
TOKEN_AXES = ('batch', 'length', 'embed')


class Compiled:
  """value_and_grad of `loss(params, x)` w.r.t. both, jitted and compiled once; the params
  are `init(x)`, boxed with their logical axes. Without a mesh, `()` runs it. With one,
  params and `x` are abstract, sharded over it, and nothing runs. Keeps XLA's per-device
  temporary bytes, FLOPs and bytes accessed, and the compile seconds."""

  def __init__(self, loss, init, x, mesh=None, has_aux=False):
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=has_aux))
    if mesh is None:
      self.params = nn.meta.unbox(init(x))
    else:
      boxed = jax.eval_shape(init, x)
      self.params = jax.tree.map(
          lambda sharding, box: jax.ShapeDtypeStruct(box.value.shape, box.value.dtype,
                                                     sharding=sharding),
          partitioning.logical_sharding(boxed, mesh), boxed)
    start = time.perf_counter()
    self._compiled = grad.lower(self.params, x).compile()
    self.compile_seconds = time.perf_counter() - start
    memory = self._compiled.memory_analysis()
    self.temp_bytes = getattr(memory, 'temp_size_in_bytes', None) if memory else None
    self.flops, self.bytes_accessed = aot.compiled_counts(self._compiled)
    self._args = (self.params, x)
    if mesh is None:
      self()

  def __call__(self):
    return jax.block_until_ready(self._compiled(*self._args))


def inputs(shape, axes, mesh=None, seed=0):
  """float32 values; for a mesh, abstract bfloat16 (as on TPU) sharded by logical `axes`."""
  if mesh is None:
    return jax.random.normal(jax.random.PRNGKey(seed), shape)
  sharding = nn.logical_to_mesh_sharding(PartitionSpec(*axes), mesh,
                                         partitioning.LOGICAL_AXIS_RULES)
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)


def median_seconds(runs, repeats):
  """Median time of each run; interleaved, so that load on the machine hits all alike."""
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def sum_squares(y):
  return jnp.sum(jnp.square(y.astype(jnp.float32)))


def expert_mlp(d_ff, dtype):
  return functools.partial(layers.GatedMlp, d_ff=d_ff, dtype=dtype)


def dense(x, d_ff, mesh=None):
  mlp = expert_mlp(d_ff, x.dtype)()
  return Compiled(lambda p, x: sum_squares(mlp.apply({'params': p}, x, True)),
                  lambda x: mlp.init(jax.random.PRNGKey(1), x, True)['params'], x, mesh)


def pure_experts(num_experts, slots, d_model, d_ff, mesh=None):
  """The vmapped expert MLPs on `[E, slots, d_model]` inputs, nothing else."""
  x = inputs((num_experts, slots, d_model), EXPERT_SLOT_AXES, mesh, seed=3)
  experts = nn.vmap(expert_mlp(d_ff, x.dtype), in_axes=(0, None), out_axes=0,
                    variable_axes={'params': 0}, split_rngs={'params': True},
                    metadata_params={nn.PARTITION_NAME: 'expert'})(intermediate_axes=None)
  return Compiled(lambda p, x: sum_squares(experts.apply({'params': p}, x, True)),
                  lambda x: experts.init(jax.random.PRNGKey(1), x, True)['params'], x, mesh)


def moe_config(case, length, dispatch, grouped_kernel='ragged_dot'):
  router = (routers.ExpertsChoose() if case.router == 'experts_choose' else
            routers.TopK(k=case.k, batch_priority=case.batch_priority))
  return MoeConfig(num_experts=case.num_experts, router=router,
                   train_capacity_factor=case.factor, eval_capacity_factor=case.factor,
                   capacity_convention=capacity.T5X(minimum=1),
                   grouping=grouping.Flaxformer(max_group_size=case.max_group_size or length),
                   dispatch=dispatch, grouped_kernel=grouped_kernel)


def ours(x, config, d_ff, mesh=None, with_metrics=False):
  """(Compiled, the layer)."""
  layer = MoeLayer(config, expert_mlp(d_ff, x.dtype))

  def loss(p, x):
    y, state = layer.apply({'params': p}, x, True, mutable=MOE_COLLECTIONS)
    if not with_metrics:
      return sum_squares(y)
    return sum_squares(y) + aux_losses(state)['total'], state['moe_metrics']

  init = lambda x: layer.init(jax.random.PRNGKey(1), x, True)['params']
  return Compiled(loss, init, x, mesh, has_aux=with_metrics), layer


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
  from flaxformer.architectures.moe import (  # pylint: disable=g-import-not-at-top
      moe_layers, routing)
  from flaxformer.components import dense as ff_dense  # pylint: disable=g-import-not-at-top
  return moe_layers, routing, ff_dense


# The trainer's rules plus T5X's MoE rule for Flaxformer's own axis name (t5x/contrib/moe/
# partitioning.py); no-ops on CPU, where there is no mesh.
FLAXFORMER_RULES = partitioning.LOGICAL_AXIS_RULES + (('expert_replicas', 'data'),)


def flaxformer(flax_modules, x, case, d_ff, scatter, mesh=None):
  """Flaxformer's MoeLayer on `x`: (Compiled, apply(params, x) -> y)."""
  moe_layers, routing, ff_dense = flax_modules
  weights = routing.RouterWeights(dtype=jnp.float32, use_bias=False)
  common = dict(router_weights=weights, jitter_noise=0.0, dtype=jnp.float32,
                ignore_padding_tokens=False)
  if case.router == 'experts_choose':
    ff_router = routing.ExpertsChooseMaskedRouter(**common)
  else:
    cls = routing.TokensChooseScatterRouter if scatter else routing.TokensChooseMaskedRouter
    ff_router = cls(num_selected_experts=case.k, batch_prioritized_routing=case.batch_priority,
                    **common)
  expert = ff_dense.MlpBlock(use_bias=False, intermediate_dim=d_ff,
                             activations=('gelu', 'linear'), intermediate_dropout_rate=0.0,
                             final_dropout_rate=0.0, dtype=x.dtype)
  layer = moe_layers.MoeLayer(
      num_experts=case.num_experts, max_group_size=case.max_group_size or x.shape[1],
      train_capacity_factor=case.factor, eval_capacity_factor=case.factor, expert=expert,
      router=ff_router,
      num_expert_partitions=mesh.shape['expert'] if mesh else case.num_experts,
      num_model_partitions=mesh.shape['model'] if mesh else 1, dropout_rate=0.0,
      dtype=x.dtype, min_expert_capacity=1)

  def apply(p, x):
    with nn.logical_axis_rules(FLAXFORMER_RULES):
      return layer.apply({'params': p}, x, enable_dropout=False, mutable=['intermediates'])[0]

  def init(x):
    """Its params, boxed with the logical axes it keeps in 'params_axes'."""
    with nn.logical_axis_rules(FLAXFORMER_RULES):
      variables = layer.init({'params': jax.random.PRNGKey(1), 'jitter': jax.random.PRNGKey(2)},
                             x, enable_dropout=False)
    axes = flax.core.unfreeze(nn.partitioning.get_axis_names(variables['params_axes']))
    return jax.tree.map(lambda v, names: nn.LogicallyPartitioned(v, tuple(names)),
                        variables['params'], axes)

  return Compiled(lambda p, x: sum_squares(apply(p, x)), init, x, mesh), apply


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


def case_runs(case, x, args, dense_run, flax_modules, mesh=None):
  """One case's rows, name -> Compiled (on CPU also `+metrics`, and Flaxformer's layer is
  first checked to compute ours' function); prints the case's groups and capacity."""
  batch, length, d_model = x.shape
  config = moe_config(case, length, 'indices')
  plan = config.group_plan(batch, length)
  capacity = config.capacity(plan.group_size, deterministic=True)
  runs = {} if dense_run is None else {'dense MLP': dense_run}
  runs['pure experts'] = pure_experts(case.num_experts, plan.num_groups * capacity, d_model,
                                      args.d_ff, mesh)
  if case.dropless:   # the floor of a dropless layer: every token's k rows, evenly spread
    runs['pure experts (k rows/token)'] = pure_experts(
        case.num_experts, -(-batch * length * case.k // case.num_experts), d_model, args.d_ff,
        mesh)
  for dispatch in ('masked', 'indices'):
    config = moe_config(case, length, dispatch)
    runs[f'ours {dispatch}'], layer = ours(x, config, args.d_ff, mesh)
  if case.dropless:   # each token's k rows, no capacity slots
    runs['ours ragged'] = ours(x, moe_config(case, length, 'ragged'), args.d_ff, mesh)[0]
    if mesh is not None:   # the Pallas TPU kernel (interpreted on CPU: not timed)
      runs['ours ragged megablox'] = ours(x, moe_config(case, length, 'ragged', 'megablox'),
                                          args.d_ff, mesh)[0]
    else:   # blocks of rows in a scan, what 'megablox' runs off TPU
      runs['ours ragged blocked'] = ours(x, moe_config(case, length, 'ragged', 'blocked'),
                                         args.d_ff)[0]
  if mesh is None:
    runs['ours indices +metrics'] = ours(x, config, args.d_ff, with_metrics=True)[0]
  scatters = ((False, True) if case.router == 'tokens_choose' else (False,)) if flax_modules else ()
  for scatter in scatters:
    run, apply = flaxformer(flax_modules, x, case, args.d_ff, scatter, mesh)
    if mesh is None:
      check_same_function(layer, runs['ours indices'].params, apply, run.params, x)
    runs[f'flaxformer {"scatter" if scatter else "masked"}'] = run
  print(f'\n{case.name}: {plan.num_groups} groups x {plan.group_size} tokens, {capacity} slots '
        f'per expert and group', flush=True)
  return runs


def cpu_rows(case, runs, args):
  """Times the runs; prints and returns their rows and the case's verdict."""
  seconds = median_seconds(runs, args.repeats)
  pure = seconds['pure experts']
  print(f'  {"":28s} {"ms":>8s} {"x pure":>7s} {"temp MiB":>9s} {"x pure":>7s}')
  rows = []
  for impl, run in runs.items():
    temp = run.temp_bytes
    ratio = '' if temp is None else f'{temp / runs["pure experts"].temp_bytes:7.2f}'
    print(f'  {impl:28s} {seconds[impl] * 1e3:8.1f} {seconds[impl] / pure:7.2f} '
          f'{"" if temp is None else f"{temp / 2**20:9.1f}"} {ratio}')
    rows.append({'case': case, 'impl': impl, 'seconds': seconds[impl], 'temp_bytes': temp})
  best = min(('ours masked', 'ours indices'), key=seconds.get)
  verdict = {'case': case, 'ours_best': best,
             'ours_over_pure_time': seconds[best] / pure,
             'ours_over_pure_memory': runs[best].temp_bytes / runs['pure experts'].temp_bytes,
             'metrics_cost': seconds['ours indices +metrics'] / seconds['ours indices'] - 1}
  theirs = [impl for impl in runs if impl.startswith('flaxformer')]
  if theirs:
    theirs = min(theirs, key=seconds.get)
    verdict.update(flaxformer_best=theirs,
                   ours_over_flaxformer_time=seconds[best] / seconds[theirs],
                   ours_over_flaxformer_memory=runs[best].temp_bytes / runs[theirs].temp_bytes)
  return rows, verdict


def cpu_summary(verdicts):
  print('\nours best per case:')
  for v in verdicts:
    line = (f'  {v["case"]:16s} {v["ours_best"]:13s} time {v["ours_over_pure_time"]:.2f}x pure, '
            f'memory {v["ours_over_pure_memory"]:.2f}x pure, '
            f'metrics +{100 * v["metrics_cost"]:.1f}%')
    if 'flaxformer_best' in v:
      line += (f'; vs {v["flaxformer_best"]}: time {v["ours_over_flaxformer_time"]:.2f}x, '
               f'memory {v["ours_over_flaxformer_memory"]:.2f}x')
    print(line)


TPU_KEYS = ('temp_bytes', 'flops', 'bytes_accessed')


def ratios(run, base):
  """run's TPU figures over base's (None where base's is 0)."""
  return {key: getattr(run, key) / getattr(base, key) if getattr(base, key) else None
          for key in TPU_KEYS}


def roofline_seconds(run):
  """The step's lower bound on a v4 chip: max(FLOPs / peak, bytes / HBM bandwidth)."""
  return max(run.flops / V4_PEAK_FLOPS, run.bytes_accessed / V4_HBM_BYTES_PER_SECOND)


def tpu_rows(case, runs, args):  # pylint: disable=unused-argument
  """The compiled runs' per-device figures; prints and returns their rows and the verdict
  (indices over masked; ours' lower-memory dispatch over Flaxformer's; each row's roofline
  time, and ours' lowest)."""
  print(f'  {"":28s} {"temp MiB":>9s} {"x pure":>7s} {"GFLOP":>8s} {"x pure":>7s} '
        f'{"GB accessed":>11s} {"x pure":>7s} {"roofline ms":>11s} {"compile s":>9s}')
  rows = []
  for impl, run in runs.items():
    over = {k: f'{"-":>7s}' if v is None else f'{v:7.2f}'
            for k, v in ratios(run, runs['pure experts']).items()}
    print(f'  {impl:28s} {run.temp_bytes / 2**20:9.1f} {over["temp_bytes"]} '
          f'{run.flops / 1e9:8.2f} {over["flops"]} {run.bytes_accessed / 1e9:11.3f} '
          f'{over["bytes_accessed"]} {roofline_seconds(run) * 1e3:11.2f} '
          f'{run.compile_seconds:9.1f}')
    rows.append({'case': case, 'impl': impl, 'temp_bytes': run.temp_bytes, 'flops': run.flops,
                 'bytes_accessed': run.bytes_accessed, 'compile_seconds': run.compile_seconds,
                 'roofline_seconds': roofline_seconds(run)})
  lowest = lambda impls: min(impls, key=lambda impl: runs[impl].temp_bytes)
  best = lowest(('ours masked', 'ours indices'))
  fastest = min((impl for impl in runs if impl.startswith('ours')),
                key=lambda impl: roofline_seconds(runs[impl]))
  verdict = {'case': case, 'ours_best_memory': best, 'ours_fastest_roofline': fastest,
             'indices_over_masked': ratios(runs['ours indices'], runs['ours masked'])}
  theirs = [impl for impl in runs if impl.startswith('flaxformer')]
  if theirs:
    verdict['flaxformer_best_memory'] = lowest(theirs)
    verdict['ours_over_flaxformer'] = ratios(runs[best], runs[lowest(theirs)])
  return rows, verdict


def tpu_summary(verdicts):
  show = lambda r: ', '.join(f'{key} {"-" if r[key] is None else f"{r[key]:.2f}x"}'
                             for key in TPU_KEYS)
  print('\nper device:')
  for v in verdicts:
    line = (f'  {v["case"]:16s} lowest roofline: {v["ours_fastest_roofline"]}; indices over '
            f'masked: {show(v["indices_over_masked"])}')
    if 'flaxformer_best_memory' in v:
      line += (f'; {v["ours_best_memory"]} over {v["flaxformer_best_memory"]}: '
               f'{show(v["ours_over_flaxformer"])}')
    print(line)


def topology_mesh(topology, shape):
  """The trainer's mesh over `topology`'s devices; `shape` 'DxExM', default 1 x all x 1."""
  from upcycle.fit.aot import topology_devices  # pylint: disable=g-import-not-at-top
  devices = topology_devices(topology, megacore=True)
  data, expert, model = map(int, shape.split('x')) if shape else (1, len(devices), 1)
  if data * expert * model != len(devices):
    raise ValueError(f'--mesh {shape}: {data * expert * model} devices, {topology} has '
                     f'{len(devices)}')
  return partitioning.make_mesh(expert, model, devices=devices)


def case_inputs(args, mesh):
  """(case, tokens, dense MLP run or None) per case to measure: --papers' cases each with its
  own tokens and no dense row; the others share one input and its dense MLP."""
  if args.papers:
    shards = mesh.shape['data'] * mesh.shape['expert']
    for case in [case for case in PAPER_CASES if args.only in case.name]:
      shape = (case.sequences_per_shard * shards, case.length, args.d_model)
      yield case, inputs(shape, TOKEN_AXES, mesh), None
    return
  x = inputs((args.batch, args.length, args.d_model), TOKEN_AXES, mesh)
  dense_run = dense(x, args.d_ff, mesh)
  for case in [case for case in CASES if args.only in case.name]:
    yield case, x, dense_run


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--flaxformer', default=None,
                      help='directory holding a flaxformer/ checkout, to measure it alongside')
  parser.add_argument('--topology', default=None,
                      help="compile only, for this TPU topology (e.g. 'v4:2x2x1')")
  parser.add_argument('--mesh', default=None, help="with --topology: data x expert x model, "
                      "e.g. '1x4x1' (default: 1 x devices x 1)")
  parser.add_argument('--batch', type=int, default=None,
                      help='default 8; with --topology 32 per data x expert shard')
  parser.add_argument('--length', type=int, default=512)
  parser.add_argument('--d_model', type=int, default=768)
  parser.add_argument('--d_ff', type=int, default=2048)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--quick', action='store_true', help='4x128 tokens, d 128, d_ff 256')
  parser.add_argument('--papers', action='store_true',
                      help='with --topology: the cases at the configs\' group sizes (PAPER_CASES)')
  parser.add_argument('--only', default='',
                      help="run the cases whose name holds this, e.g. 'Top-2'")
  parser.add_argument('--output', default=None, help='default: benchmarks/results/'
                      'moe_layer.json, with --topology moe_layer_tpu.json')
  return parser


def main():
  parser = build_parser()
  args = parser.parse_args()
  if args.quick:
    args.batch, args.length, args.d_model, args.d_ff, args.repeats = 4, 128, 128, 256, 3
  name = ('moe_layer_tpu_papers.json' if args.papers else 'moe_layer_tpu.json') if args.topology \
      else 'moe_layer.json'
  args.output = args.output or os.path.join(os.path.dirname(__file__), 'results', name)
  flax_modules = import_flaxformer(args.flaxformer) if args.flaxformer else None
  mesh = topology_mesh(args.topology, args.mesh) if args.topology else None
  if mesh is None:
    rows_of, summary = cpu_rows, cpu_summary
    args.batch = args.batch or 8
    print(f'{args.batch}x{args.length} tokens, d_model {args.d_model}, d_ff {args.d_ff} (gated '
          f'GELU), float32, forward+backward, backend {jax.default_backend()}, '
          f'{os.cpu_count()} CPUs, median of {args.repeats}', flush=True)
  else:
    rows_of, summary = tpu_rows, tpu_summary
    shards = mesh.shape['data'] * mesh.shape['expert']
    args.batch = math.lcm(args.batch, shards) if args.batch else 32 * shards
    tokens = ("each case's groups and ~32,768 tokens per chip" if args.papers
              else f'{args.batch}x{args.length} tokens')
    print(f'{tokens}, d_model {args.d_model}, d_ff {args.d_ff} (gated '
          f'GELU), bfloat16 activations, float32 parameters, forward+backward, compiled for '
          f'{args.topology} ({mesh.devices.size} x {mesh.devices.flat[0].device_kind}), mesh '
          f'{dict(mesh.shape)}; per device', flush=True)
  if args.papers and mesh is None:
    parser.error('--papers needs --topology (the cases are sized for a TPU chip)')
  # A topology's executables have no client to be loaded back: none goes into JAX's cache.
  with (partitioning.activate(mesh) if mesh else contextlib.nullcontext()), \
       (platforms.compilation_cache_off() if mesh else contextlib.nullcontext()):
    rows, verdicts = [], []
    for case, x, dense_run in case_inputs(args, mesh):
      case_rows, verdict = rows_of(case.name, case_runs(case, x, args, dense_run, flax_modules,
                                                        mesh), args)
      rows += case_rows
      verdicts.append(verdict)
  summary(verdicts)
  os.makedirs(os.path.dirname(args.output), exist_ok=True)
  with open(args.output, 'w') as f:
    target = ({'backend': jax.default_backend()} if mesh is None
              else {'backend': 'tpu', 'mesh': dict(mesh.shape)})
    json.dump({'args': vars(args), **target, 'cpus': os.cpu_count(), 'rows': rows,
               'verdicts': verdicts}, f, indent=2)
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
