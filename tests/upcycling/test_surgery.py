"""surgery.upcycle: the one naming rule, the report, and its errors."""

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import tree
from upcycle.upcycling import experts, router_init, stream
from upcycle.upcycling.surgery import make_plan, upcycle, upcycle_from_checkpoints

MLP = 'encoder/layers_1/mlp'


def test_copy_tiles_mlp_and_copies_the_rest(t5, target):
  dense = t5()
  params, _ = upcycle(dense, target(dense, [MLP], 4), rng=0)
  flat, flat_dense = tree.flatten(params), tree.flatten(dense)
  for name in ('wi_0/kernel', 'wi_1/kernel', 'wo/kernel'):
    out = np.asarray(flat[f'{MLP}/expert/{name}'])
    assert out.shape == (4,) + flat_dense[f'{MLP}/{name}'].shape
    for e in range(4):
      np.testing.assert_array_equal(out[e], flat_dense[f'{MLP}/{name}'])
  for path, leaf in flat_dense.items():
    if not path.startswith(MLP + '/'):
      np.testing.assert_array_equal(np.asarray(flat[path]), leaf)
  router = np.asarray(flat[f'{MLP}/router/router_weights/w/kernel'])
  assert router.shape == (8, 4) and router.dtype == np.float32


def test_vit_biases_are_tiled_too(vit, target):
  dense = vit()
  mlp = 'Transformer/encoderblock_1/MlpBlock_0'
  params, report = upcycle(dense, target(dense, [mlp], 3), rng=0)
  bias = np.asarray(tree.flatten(params)[f'{mlp}/expert/Dense_0/bias'])
  assert bias.shape == (3, 32)
  np.testing.assert_array_equal(bias, np.tile(dense['Transformer']['encoderblock_1']['MlpBlock_0']
                                              ['Dense_0']['bias'], (3, 1)))
  assert f'{mlp}/expert/Dense_1/bias' in report.experts


def test_report_lists_every_leaf_and_prints_a_table(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  dense['extra'] = {'kernel': np.zeros((2, 2), np.float32)}
  _, report = upcycle(dense, tgt, experts=experts.Drop(0.25), router='zeros', rng=1)
  assert set(report.experts) == {f'{MLP}/expert/{n}/kernel' for n in ('wi_0', 'wi_1', 'wo')}
  assert report.fresh == (f'{MLP}/router/router_weights/w/kernel',)
  assert len(report.copied) == len(tree.flatten(tgt)) - 4
  assert 'encoder/layers_0/mlp/wi_0/kernel' in report.copied
  assert report.unused == ('extra/kernel',)
  assert report.num_experts == {MLP: 4}
  text = str(report)
  assert 'Drop(ratio=0.25' in text and 'Zeros()' in text
  assert f'<- {MLP}/wo/kernel' in text
  assert 'dense leaves left unused:\n  extra/kernel' in text
  assert text.splitlines()[0].startswith('13 target leaves: 9 copied, 3 expert leaves')


def test_source_tree_is_not_mutated(t5, target):
  dense = t5()
  before = copy.deepcopy(dense)
  tgt = target(dense, [MLP], 4)
  target_before = jax.tree.map(lambda x: x, tgt)
  for init in (experts.Copy(), experts.Drop(0.5), experts.Noise(), experts.Granular(2)):
    t = tgt if not isinstance(init, experts.Granular) else target(dense, [MLP], 4, expert_d_ff=16)
    upcycle(dense, t, experts=init, rng=0)
  jax.tree.map(np.testing.assert_array_equal, dense, before)
  assert jax.tree.structure(tgt) == jax.tree.structure(target_before)


def test_boxed_abstract_target_is_unboxed(t5, target):
  dense = t5()
  boxed = jax.tree.map(lambda s: nn.LogicallyPartitioned(s, ('embed',) * len(s.shape)),
                       target(dense, [MLP], 2))
  params, report = upcycle(dense, boxed, rng=0)
  assert tree.flatten(params)[f'{MLP}/expert/wo/kernel'].shape == (2, 32, 8)
  assert report.num_experts == {MLP: 2}


def test_same_seed_same_params_and_layers_independent(t5, target):
  dense = t5()
  a, _ = upcycle(dense, target(dense, [MLP], 4), experts='drop', rng=3)
  b, _ = upcycle(dense, target(dense, [MLP], 4), experts='drop', rng=3)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  both, _ = upcycle(dense, target(dense, ['encoder/layers_0/mlp', MLP], 4), experts='drop', rng=3)
  np.testing.assert_array_equal(tree.flatten(a)[f'{MLP}/expert/wo/kernel'],
                                tree.flatten(both)[f'{MLP}/expert/wo/kernel'])


def test_target_leaf_matching_nothing_names_path_and_shape(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  tgt['encoder']['layers_0']['attention']['keyy'] = {
      'kernel': jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  with pytest.raises(ValueError, match=r'encoder/layers_0/attention/keyy/kernel \(8, 8\) float32 '
                     r'matches nothing.*Closest dense leaves: '
                     r'encoder/layers_0/attention/query/kernel'):
    upcycle(dense, tgt, rng=0)


def test_missing_dense_mlp_leaf_names_both_paths(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  del dense['encoder']['layers_1']['mlp']['wi_1']
  with pytest.raises(ValueError, match=rf'{MLP}/expert/wi_1/kernel \(4, 8, 32\).*dense leaf '
                     rf'{MLP}/wi_1/kernel, which does not exist'):
    upcycle(dense, tgt, rng=0)


def test_wrapped_target_gets_a_hint(t5, target):
  dense = t5()
  with pytest.raises(ValueError, match=r"no 'params'.*target\[\"params\"\]"):
    upcycle(dense, {'params': target(dense, [MLP], 4)}, rng=0)


def test_shape_mismatch_names_path_and_both_shapes(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  tgt['token_embedder']['embedding'] = jax.ShapeDtypeStruct((32, 8), jnp.float32)
  with pytest.raises(ValueError, match=r'token_embedder/embedding has shape \(32, 8\) but dense '
                     r'leaf token_embedder/embedding has shape \(16, 8\)'):
    upcycle(dense, tgt, rng=0)


def test_expert_shape_mismatch_names_paths_and_shapes(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4, expert_d_ff=64)
  with pytest.raises(ValueError, match=rf'{MLP}/expert/wi_0/kernel has shape \(4, 8, 64\) but '
                     rf'Copy\(\) makes \(4, 8, 32\) from dense leaf {MLP}/wi_0/kernel \(8, 32\)'):
    upcycle(dense, tgt, rng=0)


def test_experts_disagreeing_on_num_experts(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  tgt['encoder']['layers_1']['mlp']['expert']['wo']['kernel'] = jax.ShapeDtypeStruct(
      (3, 32, 8), jnp.float32)
  with pytest.raises(ValueError, match='disagree on the number of experts'):
    upcycle(dense, tgt, rng=0)


def test_bfloat16_into_float32_is_cast_exactly_and_rounding_needs_cast(t5, target):
  """A bfloat16 checkpoint (every published Llama) upcycles into a float32 model, each value
  kept (the report says so); float32 into a bfloat16 model rounds values and needs cast."""
  dense = t5()
  tgt = target(dense, [MLP], 4)
  bf16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), dense)
  params, report = upcycle(bf16, tgt, rng=0)
  out = tree.flatten(params)[f'{MLP}/expert/wo/kernel']
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out[2], np.asarray(bf16['encoder']['layers_1']['mlp']['wo']
                                                   ['kernel'], np.float32))
  assert 'cast bfloat16 -> float32 (exact)' in str(report)
  tgt_bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), tgt)
  with pytest.raises(ValueError, match=r'dtype bfloat16 but dense leaf .* is float32: casting '
                                       r'would round its values. Fix: allow it .*--cast'):
    upcycle(dense, tgt_bf16, rng=0)
  params, report = upcycle(dense, tgt_bf16, rng=0, cast=True)
  np.testing.assert_array_equal(
      tree.flatten(params)[f'{MLP}/expert/wo/kernel'][1],
      np.asarray(dense['encoder']['layers_1']['mlp']['wo']['kernel']).astype(jnp.bfloat16))
  assert 'cast float32 -> bfloat16 (rounds values)' in str(report)


def test_unknown_initializer_names():
  with pytest.raises(ValueError, match=r"experts='dropp'.*'copy', 'drop', 'noise', 'random'"):
    experts.get('dropp')
  with pytest.raises(ValueError, match=r"router='gauss'.*'normal', 'uniform', 'zeros'"):
    router_init.get('gauss')


def test_from_checkpoints_goes_through_its_own_entry_point(t5, target):
  dense = t5()
  init = experts.FromCheckpoints([dense, dense])
  with pytest.raises(ValueError, match='upcycle_from_checkpoints'):
    upcycle(dense, target(dense, [MLP], 2), experts=init, rng=0)
  with pytest.raises(ValueError, match='needs FromCheckpoints or Merge'):
    upcycle_from_checkpoints(experts.Copy(), target(dense, [MLP], 2), rng=0)


def test_from_identical_checkpoints_equals_copy_exactly(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4)
  want, _ = upcycle(dense, tgt, rng=5)
  got, report = upcycle_from_checkpoints(experts.FromCheckpoints([dense] * 4), tgt, rng=5)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
  assert 'mean of 4 sources' in str(report)


def test_from_checkpoints_experts_and_averaged_shared_params(t5, target):
  sources = [t5(seed=s) for s in range(2)]
  params, report = upcycle_from_checkpoints(
      experts.Merge(sources, method='average'), target(sources[0], [MLP], 3), rng=0)
  flat = tree.flatten(params)
  wo = [s['encoder']['layers_1']['mlp']['wo']['kernel'] for s in sources]
  np.testing.assert_array_equal(flat[f'{MLP}/expert/wo/kernel'][1], wo[1])
  np.testing.assert_allclose(flat[f'{MLP}/expert/wo/kernel'][2], (wo[0] + wo[1]) / 2, rtol=1e-6)
  np.testing.assert_allclose(flat['token_embedder/embedding'],
                             (sources[0]['token_embedder']['embedding'] +
                              sources[1]['token_embedder']['embedding']) / 2, rtol=1e-6, atol=1e-6)
  assert "Merge(2 sources, method='average', drop_rate=0.5, base=None)" in report.summary()
  assert 'mean of 2 sources' in str(report)


def test_target_without_moe_blocks_is_an_error(t5, target):
  dense = t5()
  with pytest.raises(ValueError, match='no MoE blocks'):
    upcycle(dense, target(dense, [], 4), rng=0)


@pytest.mark.parametrize('init', ['copy', 'drop', 'noise', experts.Granular(2)])
def test_upcycle_traces_under_jit(init, t5, target):
  """The restore hook can jit surgery with output shardings: values equal the eager ones."""
  dense = jax.tree.map(jnp.asarray, t5())
  tgt = target(dense, [MLP], 4, expert_d_ff=16 if isinstance(init, experts.Granular) else None)
  eager, _ = upcycle(dense, tgt, experts=init, rng=jax.random.PRNGKey(2))
  jitted = jax.jit(lambda d, k: upcycle(d, tgt, experts=init, rng=k)[0])(
      dense, jax.random.PRNGKey(2))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), jitted, eager)


def test_shared_expert_is_the_dense_mlp_in_every_executor(t5, target):
  dense = t5()
  tgt = target(dense, [MLP], 4, shared_d_ff=32)
  params, report = upcycle(dense, tgt, experts='zero_output', rng=0)
  flat, flat_dense = tree.flatten(params), tree.flatten(dense)
  for name in ('wi_0/kernel', 'wi_1/kernel', 'wo/kernel'):
    mlp = flat_dense[f'{MLP}/{name}']
    np.testing.assert_array_equal(flat[f'{MLP}/shared_expert/{name}'], mlp)
    expert = 0 * mlp if name == 'wo/kernel' else mlp   # ZeroOutput zeroes the output projection
    np.testing.assert_array_equal(flat[f'{MLP}/expert/{name}'],
                                  np.broadcast_to(expert, (4,) + mlp.shape))
  assert set(report.shared) == {f'{MLP}/shared_expert/{n}/kernel' for n in ('wi_0', 'wi_1', 'wo')}
  assert report.unused == ()
  assert ', 3 shared-expert leaves; ' in report.summary()
  assert f'{MLP}/shared_expert/wo/kernel' in str(report)
  plan = make_plan(dense, tgt, experts='zero_output')
  streamed = {p: x.read() for p, x in tree.flatten(stream.leaves(plan, dense, 0)).items()}
  jitted = tree.flatten(jax.jit(lambda d: upcycle(d, tgt, experts='zero_output', rng=0)[0])(
      jax.tree.map(jnp.asarray, dense)))
  for path, value in flat.items():
    np.testing.assert_array_equal(streamed[path], value, err_msg=path)
    np.testing.assert_allclose(jitted[path], value, rtol=1e-6, atol=1e-6, err_msg=path)


def test_narrower_shared_expert_takes_the_first_units_wider_is_refused(vit, target):
  dense = vit()
  mlp = 'Transformer/encoderblock_1/MlpBlock_0'
  params, report = upcycle(dense, target(dense, [mlp], 2, shared_d_ff=12), rng=0)
  flat, flat_dense = tree.flatten(params), tree.flatten(dense)
  shared = lambda name: np.asarray(flat[f'{mlp}/shared_expert/{name}'])
  src = lambda name: flat_dense[f'{mlp}/{name}']
  np.testing.assert_array_equal(shared('Dense_0/kernel'), src('Dense_0/kernel')[:, :12])
  np.testing.assert_array_equal(shared('Dense_0/bias'), src('Dense_0/bias')[:12])
  np.testing.assert_array_equal(shared('Dense_1/kernel'), src('Dense_1/kernel')[:12])
  np.testing.assert_array_equal(shared('Dense_1/bias'), src('Dense_1/bias'))
  assert 'first 12 of 32 d_ff units' in str(report)
  with pytest.raises(ValueError, match=rf'{mlp}/shared_expert/Dense_0/kernel has shape \(8, 64\) '
                     rf'but dense leaf {mlp}/Dense_0/kernel has shape \(8, 32\).*'
                     rf'shared_expert_d_ff <= the dense d_ff'):
    upcycle(dense, target(dense, [mlp], 2, shared_d_ff=64), rng=0)


def test_zero_output_wraps_an_initializer_by_name():
  init = experts.get('zero_output')
  assert init == experts.ZeroOutput(experts.Copy())
  assert experts.ZeroOutput('drop') == experts.ZeroOutput(experts.Drop())
  mlp = {'Dense_0/kernel': np.ones((2, 3), np.float32), 'Dense_0/bias': np.ones(3, np.float32),
         'Dense_1/kernel': np.ones((3, 2), np.float32), 'Dense_1/bias': np.ones(2, np.float32)}
  out = init(mlp, 2, jax.random.PRNGKey(0))
  assert not np.any(out['Dense_1/kernel']) and not np.any(out['Dense_1/bias'])
  np.testing.assert_array_equal(out['Dense_0/kernel'], np.ones((2, 2, 3)))
  np.testing.assert_array_equal(out['Dense_0/bias'], np.ones((2, 3)))
