"""The smallest program we found that crashed XLA's TPU compiler, and the layout that avoids it.

  python benchmarks/tpu_expert_axis_32.py [--direct]

Compiles (for TPU v4, with libtpu, on any host) value_and_grad of x + MoeLayer(x): Expert
Choice over 32 experts, T5X capacity C = 2, Flaxformer grouping with groups of 4096 tokens
(batch 256 x 512 -> 32 groups), bfloat16, d_model 64, d_ff 128, on the 64 TensorCores of a
v4:4x4x2 slice shown one device per core, mesh data 2 x expert 32 x model 1.

The masked dispatch computes `einsum('gecs,gsd->egcd', one_hot, tokens)` where the tokens are
(groups split over ('expert', 'data')) and only then moves the slots to the experts' layout
(`upcycle/moe/slots.py`, TOKEN_SLOT_AXES -> EXPERT_AXES), and back before combining.
`--direct` constrains the dispatch einsum's output straight to the experts' layout, as the
layer did before: libtpu 0.0.42.1 (and 0.0.52) then dies with SIGSEGV in the SPMD
partitioner (`MoveUsersIntoWindowedDotGeneralLoopOnNonContractingDimensions`). It takes the
residual (the gradient reaching x by two paths), 32 on the expert axis, the large one-hot
[32, 32, 256, 4096] and the per-core view: 16 experts, groups of 2048, no residual, or the
same slice shown one device per chip (megacore, as a v4 VM shows it) compile either way.
"""

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from upcycle import layers, tree  # pylint: disable=g-import-not-at-top,wrong-import-position
from upcycle.moe import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    MOE_COLLECTIONS, MoeConfig, MoeLayer, capacity, grouping, routers)
from upcycle.moe import slots  # pylint: disable=g-import-not-at-top,wrong-import-position
from upcycle.fit import aot  # pylint: disable=g-import-not-at-top,wrong-import-position
from upcycle import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    partitioning, platforms)

BATCH, LENGTH, GROUP, EXPERTS, D_MODEL, D_FF = 256, 512, 4096, 32, 64, 128


def dispatch_direct(x, decision, experts_fn):
  """The masked dispatch with its einsum constrained straight to the experts' layout."""
  dispatch = jax.nn.one_hot(decision.token_index, x.shape[1], dtype=x.dtype)
  dispatch = dispatch * decision.valid[..., None].astype(x.dtype)
  expert_in = layers.constrain(jnp.einsum('gecs,gsd->egcd', dispatch, x), slots.EXPERT_AXES)
  expert_out = layers.constrain(experts_fn(expert_in), slots.EXPERT_AXES)
  combine = dispatch * decision.combine_weight[..., None].astype(x.dtype)
  return jnp.einsum('gecs,egcd->gsd', combine, expert_out)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--direct', action='store_true',
                      help='the layout that crashes the compiler (the process dies)')
  return parser


def main() -> None:
  args = build_parser().parse_args()
  if args.direct:
    slots.SLOT_FUNCTIONS['masked'] = dispatch_direct
  devices = aot.topology_devices('v4:4x4x2', megacore=False)
  mesh = partitioning.make_mesh(EXPERTS, 1, devices)
  config = MoeConfig(num_experts=EXPERTS, router=routers.ExpertsChoose(), train_capacity_factor=2.0,
                     capacity_convention=capacity.T5X(),
                     grouping=grouping.Flaxformer(max_group_size=GROUP))
  layer = MoeLayer(config, functools.partial(layers.GatedMlp, d_ff=D_FF, dtype=jnp.bfloat16))
  x = jax.ShapeDtypeStruct((BATCH, LENGTH, D_MODEL), jnp.bfloat16)
  boxed = jax.eval_shape(lambda x: layer.init(jax.random.PRNGKey(0), x, False), x)['params']

  def loss(params, x):
    y, _ = layer.apply({'params': params}, x, False, mutable=MOE_COLLECTIONS)
    return jnp.mean(jnp.square((x + y).astype(jnp.float32)))

  with platforms.compilation_cache_off(), partitioning.activate(mesh):
    shardings = partitioning.logical_sharding(boxed, mesh)
    params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                          tree.unbox(boxed), shardings)
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        mesh, PartitionSpec(('expert', 'data'))))
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
  memory = compiled.memory_analysis()
  print(f'compiled: groups {config.group_plan(BATCH, LENGTH).num_groups} of {GROUP} tokens, '
        f'mesh {dict(mesh.shape)}, {time.perf_counter() - start:.1f} s, temp '
        f'{memory.temp_size_in_bytes / 2**20:.1f} MiB per device')


if __name__ == '__main__':
  main()
