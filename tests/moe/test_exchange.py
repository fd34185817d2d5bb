"""Expert parallelism of the dropless block on 8 simulated devices: the Mixtral block with its
experts split over the mesh's 'expert' axis equals the block on one device (outputs, input
and parameter gradients, aux losses, metrics), with padding and with every token choosing the
same expert; each device multiplies by its own experts' kernels only, the rows crossing in
all-to-alls; and the slots' copies are each other's adjoints."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import layers, partitioning
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, MoeLayer, aux_losses, exchange, metrics
from upcycle.moe import routers

E, D, D_FF = 8, 16, 24
SWIGLU = functools.partial(layers.GatedMlp, d_ff=D_FF, activation='silu')
X = jax.random.normal(jax.random.PRNGKey(0), (8, 6, D))
PADDING = jnp.arange(6)[None, :] < jnp.array([[6], [4], [6], [6], [1], [6], [6], [5]])
CONFIG = MoeConfig(num_experts=E, router=routers.TopK(k=2), dispatch='ragged',
                   normalize_combine_weights=True, grouped_kernel='blocked')
LAYER = MoeLayer(CONFIG, SWIGLU, causal=True)
WEIGHTS = jnp.cos(jnp.arange(X.size, dtype=X.dtype)).reshape(X.shape)


def loss_and_grads(params, x):
  def loss(params, x):
    out, state = LAYER.apply({'params': params}, x, True, PADDING, mutable=MOE_COLLECTIONS)
    return jnp.sum(out * WEIGHTS) + aux_losses(state)['total'], (out, metrics(state))
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


@functools.lru_cache(maxsize=None)
def case(router: str):
  """('spread' | 'one_expert') -> boxed params, params, input, and the one-device result."""
  boxed = LAYER.init(jax.random.PRNGKey(1), X, True, PADDING)['params']
  params = nn.meta.unbox(boxed)
  kernel = params['router']['router_weights']['w']['kernel']           # [d_model, E]
  x = X
  if router == 'spread':   # uneven loads, some experts empty on some devices
    kernel = 3.0 * jax.random.normal(jax.random.PRNGKey(2), kernel.shape)
  else:   # every token's first choice expert 5: one device receives every device's rows
    x = X + 3.0
    kernel = kernel.at[:, 5].set(1.0)
  params['router']['router_weights']['w']['kernel'] = kernel
  return boxed, params, x, jax.jit(loss_and_grads)(params, x)


def sharded(params, boxed, x, mesh_shape, rules):
  rules = partitioning.rules(rules, 'rules')
  mesh = partitioning.make_mesh(num_expert_partitions=mesh_shape[1],
                                num_model_partitions=mesh_shape[2])
  with partitioning.activate(mesh, rules):
    shardings = partitioning.logical_sharding(boxed, mesh, rules)
    on_mesh = jax.device_put(params, shardings)
    x = jax.device_put(x, partitioning.batch_sharding(mesh, x.ndim))
    step = jax.jit(loss_and_grads)
    return step(on_mesh, x), step.lower(on_mesh, x).compile().as_text(), shardings


@pytest.mark.parametrize('router', ['spread', 'one_expert'])
@pytest.mark.parametrize('mesh_shape, rules', [((1, 8, 1), 'default'), ((2, 4, 1), 'fsdp'),
                                               ((2, 2, 2), 'default')],
                         ids=['experts-8', 'fsdp-2x4', '2x2x2'])
def test_expert_parallel_equals_one_device(router, mesh_shape, rules):
  boxed, params, x, ((loss, (out, stats)), grads) = case(router)
  if router == 'one_expert':   # the case this test is for: expert 5 has every real token
    assert float(stats['expert_load'][5]) == pytest.approx(float(jnp.mean(PADDING)))
  ((loss_s, (out_s, stats_s)), grads_s), hlo, shardings = sharded(params, boxed, x,
                                                                   mesh_shape, rules)
  # Outputs reach ~12: summed in another order, float32 differs by ~1e-6 of that scale, which
  # an output near 0 sees as absolute error (1.5e-6 at -0.049 on an AVX2 host).
  np.testing.assert_allclose(out_s, out, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out_s)[1, 4:], 0.0)      # padding: no expert
  np.testing.assert_allclose(loss_s, loss, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               grads_s, grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), stats_s, stats)
  # The rows cross over the expert axis, and no device gathers all 8 experts' kernels.
  assert 'all-to-all' in hlo
  n = mesh_shape[1]
  wi_0 = shardings['expert']['wi_0']['kernel']
  assert wi_0.shard_shape((E, D, D_FF))[0] == E // n
  assert f'f32[{E},{D},{D_FF}]' not in hlo and f'f32[{E},{D_FF},{D}]' not in hlo


def test_without_expert_partitions_the_kernels_are_gathered():
  boxed, params, x, ((loss, (out, _)), _) = case('spread')
  ((loss_s, (out_s, _)), _), hlo, _ = sharded(params, boxed, x, (8, 1, 1), 'default')
  # Outputs reach ~12: summed in another order, float32 differs by ~1e-6 of that scale, which
  # an output near 0 sees as absolute error (1.5e-6 at -0.049 on an AVX2 host).
  np.testing.assert_allclose(out_s, out, rtol=1e-5, atol=1e-5)
  assert 'all-to-all' not in hlo


def test_slots_hold_each_destinations_rows_and_come_back():
  rows = jnp.arange(1.0, 8.0)[:, None] * jnp.ones((1, 2))                # 7 rows, d 2
  starts, counts = jnp.array([0, 2, 2]), jnp.array([2, 0, 4])            # the 7th: padding
  slots = exchange._to_slots(rows, starts, counts)                      # [3, 7, 2]
  expected = np.zeros((3, 7, 2))
  expected[0, :2] = [[1, 1], [2, 2]]
  expected[2, :4] = [[3, 3], [4, 4], [5, 5], [6, 6]]
  np.testing.assert_array_equal(slots, expected)
  back = exchange._from_slots(slots, starts, counts)
  np.testing.assert_array_equal(back, np.where(np.arange(7)[:, None] < 6, rows, 0))
  # Adjoints: <to(r), s> = <r, from(s)> for any r, s; each one's gradient is the other.
  r = jax.random.normal(jax.random.PRNGKey(3), rows.shape)
  s = jax.random.normal(jax.random.PRNGKey(4), slots.shape)
  lhs = jnp.vdot(exchange._to_slots(r, starts, counts), s)
  np.testing.assert_allclose(lhs, jnp.vdot(r, exchange._from_slots(s, starts, counts)),
                             rtol=1e-6)
  np.testing.assert_allclose(
      jax.grad(lambda r: jnp.vdot(exchange._to_slots(r, starts, counts), s))(r),
      exchange._from_slots(s, starts, counts), rtol=1e-6)


def ragged_all_to_all_as_documented(operands, outputs, arguments):
  """`jax.lax.ragged_all_to_all` over n devices, by the pseudo-code of its docstring: device
  k sends operand[input_offsets[i]:+send_sizes[i]] to device i, written there at its
  output_offsets[i] (which the receiver learns by an all-to-all of them)."""
  results = [np.array(out) for out in outputs]
  for k, (input_offsets, send_sizes, output_offsets, _) in enumerate(arguments):
    for i in range(len(outputs)):
      block = operands[k][input_offsets[i]:input_offsets[i] + send_sizes[i]]
      results[i][output_offsets[i]:output_offsets[i] + len(block)] = block
  return results


def test_ragged_arguments_fill_the_same_slots_as_the_dense_exchange():
  """On TPU the blocks go by `ragged_all_to_all` (XLA:CPU has none): its documented semantics,
  given `ragged_arguments`, leave every device the buffer that the slots' all-to-all does."""
  n, rows, d = 3, 5, 2
  rng = np.random.default_rng(0)
  counts = np.array([[2, 0, 3], [1, 1, 1], [0, 5, 0]])       # counts[k, j]: k's rows for j
  operands = [rng.normal(size=(rows, d)).astype(np.float32) for _ in range(n)]
  starts = np.cumsum(counts, axis=1) - counts
  arguments = [tuple(np.asarray(a) for a in exchange.ragged_arguments(
      k, rows, jnp.asarray(starts[k]), jnp.asarray(counts[k]), jnp.asarray(counts[:, k])))
      for k in range(n)]
  results = ragged_all_to_all_as_documented(
      operands, [np.zeros((n * rows, d), np.float32)] * n, arguments)
  for i in range(n):        # the dense exchange: device i's slot k is device k's slot i
    expected = np.stack([np.asarray(exchange._to_slots(
        jnp.asarray(operands[k]), jnp.asarray(starts[k]), jnp.asarray(counts[k])))[i]
                         for k in range(n)])
    np.testing.assert_array_equal(results[i].reshape(n, rows, d), expected)


@pytest.mark.slow   # ~30 s: the block's gradient compiled by libtpu's compiler
def test_on_tpu_the_blocks_travel_by_ragged_all_to_all():
  pytest.importorskip('libtpu', reason="compiling for TPU needs libtpu (pip install -e '.[test]')")
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  devices = aot.topology_devices('v4:2x2x1')
  mesh = partitioning.make_mesh(num_expert_partitions=4, devices=devices)
  boxed, params, x, _ = case('spread')
  with partitioning.activate(mesh):
    shardings = partitioning.logical_sharding(boxed, mesh)
    spec = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    hlo = jax.jit(loss_and_grads).lower(
        jax.tree.map(spec, params, shardings),
        spec(x, partitioning.batch_sharding(mesh, x.ndim))).compile().as_text()
  assert hlo.count('ragged-all-to-all') >= 4      # there and back, forward and backward


def test_the_fit_analysis_gives_no_roofline_where_the_rows_are_exchanged():
  """The compile-ahead analysis (`upcycle.aot`) keeps the compiler's counts of an
  expert-parallel dropless step but gives them no roofline: megablox declares its cost over
  the whole receive buffer, n times the rows a balanced routing sends."""
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  from upcycle.models import LlamaConfig  # pylint: disable=g-import-not-at-top
  llama = LlamaConfig(vocab_size=64, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                      num_layers=2, moe=CONFIG)
  reason = aot.exchange_buffers(llama, partitioning.make_mesh(num_expert_partitions=4))
  assert reason.startswith('no roofline: the expert-parallel dropless block multiplies a '
                           'receive buffer of 4 x the rows')
  assert aot.exchange_buffers(llama, partitioning.make_mesh()) is None
  slots = dataclasses.replace(llama, moe=dataclasses.replace(CONFIG, dispatch='indices'))
  assert aot.exchange_buffers(slots, partitioning.make_mesh(num_expert_partitions=4)) is None
  report = aot.FunctionReport(arguments=0, outputs=0, alias=0, temp=0, code=0,
                              hbm=aot.hbm_sizes.capacity('TPU v4', True), flops_per_device=1e12,
                              bytes_per_device=1e9, devices=4, compile_seconds=1.0, parts={})
  kept = aot.with_roofline(report, device_kind='TPU v4', megacore=True, not_work=reason)
  assert kept.roofline is None and kept.uncounted == reason
  assert kept.flops_per_device == 1e12
  assert aot.with_roofline(report, device_kind='TPU v4', megacore=True).roofline is not None
