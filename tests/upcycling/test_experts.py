"""Expert initializers, on the MLP of one layer."""

import jax
import numpy as np
import pytest

from upcycle import tree
from upcycle.models.families import abstract_params
from upcycle.models import T5Config, ViTConfig
from upcycle.moe import MoeConfig, routers
from upcycle.upcycling import base as base_lib
from upcycle.upcycling import experts, ffn
from upcycle.upcycling import sources as sources_lib
from upcycle.upcycling.sources import most_distant_pair
from upcycle.upcycling.surgery import make_plan, upcycle, upcycle_from_checkpoints

KEY = jax.random.PRNGKey(0)


def _t5_mlp(t5, d_ff=32, seed=0):
  return {f'{n}/kernel': v['kernel']
          for n, v in t5(seed=seed, d_ff=d_ff)['encoder']['layers_1']['mlp'].items()}


def _vit_mlp(vit, mlp_dim=32, seed=0):
  mlp = vit(seed=seed, mlp_dim=mlp_dim)['Transformer']['encoderblock_1']['MlpBlock_0']
  return {f'{layer}/{leaf}': x for layer, leaves in mlp.items() for leaf, x in leaves.items()}


def test_copy_is_exact(t5):
  mlp = _t5_mlp(t5)
  out = experts.Copy()(mlp, 3, KEY)
  for name, x in mlp.items():
    np.testing.assert_array_equal(np.asarray(out[name]), np.broadcast_to(x, (3,) + x.shape))


@pytest.mark.parametrize('model', ['t5', 'vit'])
def test_drop_ratio_zero_is_copy_and_ratio_one_redraws_everything(model, t5, vit, untouched):
  mlp = _t5_mlp(t5) if model == 't5' else _vit_mlp(vit)
  copy = experts.Copy()(mlp, 4, KEY)
  zero = experts.Drop(0.0)(mlp, 4, KEY)
  for name in mlp:
    np.testing.assert_array_equal(np.asarray(zero[name]), np.asarray(copy[name]))
  one = experts.Drop(1.0)(mlp, 4, KEY)
  assert not untouched(mlp, one, 4).any()
  if model == 'vit':  # the output bias belongs to no unit: kept
    np.testing.assert_array_equal(np.asarray(one['Dense_1/bias']), np.asarray(copy['Dense_1/bias']))


@pytest.mark.parametrize('model,matrices', [('t5', 3), ('vit', 2)])
@pytest.mark.parametrize('ratio', [0.25, 0.5])
def test_drop_untouched_fraction(model, matrices, ratio, t5, vit, untouched):
  d_ff, num_experts = 64, 32
  mlp = _t5_mlp(t5, d_ff) if model == 't5' else _vit_mlp(vit, d_ff)
  shared = untouched(mlp, experts.Drop(ratio, 'shared')(mlp, num_experts, KEY), num_experts)
  # Shared indices: exactly round(r * d_ff) units per expert are re-drawn.
  np.testing.assert_array_equal(shared.sum(1), d_ff - round(ratio * d_ff))
  per = untouched(mlp, experts.Drop(ratio, 'per_matrix')(mlp, num_experts, KEY), num_experts)
  expected = (1 - ratio) ** matrices
  sampling_std = np.sqrt(expected * (1 - expected) / per.size)
  assert abs(per.mean() - expected) < 4 * sampling_std + 0.01, (per.mean(), expected)


def test_drop_dense0_bias_follows_its_kernel(vit):
  mlp = _vit_mlp(vit)
  out = experts.Drop(0.5, 'per_matrix')(mlp, 8, KEY)
  kernel_changed = (np.asarray(out['Dense_0/kernel']) != mlp['Dense_0/kernel'][None]).any(axis=1)
  bias_changed = np.asarray(out['Dense_0/bias']) != mlp['Dense_0/bias'][None]
  np.testing.assert_array_equal(kernel_changed, bias_changed)


def test_drop_redraws_with_the_replaced_weights_statistics(t5):
  d_ff, num_experts = 256, 4
  mlp = _t5_mlp(t5, d_ff)
  out = experts.Drop(0.5, 'per_matrix')(mlp, num_experts, KEY)
  for name, x in mlp.items():
    axis = ffn.d_ff_axis(name)
    for e in range(num_experts):
      new = np.moveaxis(np.asarray(out[name][e]), axis, -1)
      old = np.moveaxis(x, axis, -1)
      replaced = (new != old).all(axis=0)                       # units of this matrix
      assert replaced.sum() == d_ff // 2
      before, after = old[:, replaced].ravel(), new[:, replaced].ravel()
      n = before.size
      assert abs(after.mean() - before.mean()) < 4 * before.std() / np.sqrt(n)
      assert abs(after.std() / before.std() - 1) < 4 / np.sqrt(2 * n)
      np.testing.assert_array_equal(new[:, ~replaced], old[:, ~replaced])


def test_drop_experts_differ_and_seed_reproduces(t5):
  mlp = _t5_mlp(t5)
  a = experts.Drop(0.5)(mlp, 4, KEY)
  b = experts.Drop(0.5)(mlp, 4, KEY)
  c = experts.Drop(0.5)(mlp, 4, jax.random.PRNGKey(1))
  for name in mlp:
    np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    assert not np.array_equal(np.asarray(a[name]), np.asarray(c[name]))
    w = np.asarray(a[name])
    for e in range(1, 4):
      assert not np.array_equal(w[0], w[e])


def test_drop_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r'Drop.ratio=1.5: must be in \[0, 1\]'):
    experts.Drop(1.5)
  with pytest.raises(ValueError, match="Drop.index_sharing='global'"):
    experts.Drop(0.5, 'global')


def test_layer_positions_from_the_names_and_from_the_model_configs_agree():
  assert tree.layer_positions(['encoder/layers_3/mlp', 'decoder/layers_11/mlp',
                               'Transformer/encoderblock_5/MlpBlock_0', 'enc/mlp']) == {
      'encoder/layers_3/mlp': ('encoder/layers', 3),
      'decoder/layers_11/mlp': ('decoder/layers', 11),
      'Transformer/encoderblock_5/MlpBlock_0': ('Transformer/encoderblock', 5),
      'enc/mlp': None}
  t5 = T5Config(vocab_size=8, d_model=4, num_heads=1, d_kv=4, d_ff=8, num_encoder_layers=4,
                num_decoder_layers=4, encoder_moe=MoeConfig(num_experts=2),
                decoder_moe=MoeConfig(num_experts=2, router=routers.TopK()),
                decoder_moe_layers='all')
  vit = ViTConfig(num_classes=2, image_size=(4, 4), patch_size=(2, 2), width=4, depth=4,
                  mlp_dim=8, num_heads=1, moe=MoeConfig(num_experts=2), moe_layers=(0, 3))
  for config in (t5, vit):
    moe = tree.moe_layers(tree.flatten(abstract_params(config)))
    assert config.moe_positions() == tree.layer_positions(moe)
  assert sorted(t5.moe_positions().values()) == [
      ('decoder/layers', i) for i in range(4)] + [('encoder/layers', 1), ('encoder/layers', 3)]
  assert vit.moe_positions() == {'Transformer/encoderblock_0/MlpBlock_0': (
      'Transformer/encoderblock', 0), 'Transformer/encoderblock_3/MlpBlock_0': (
      'Transformer/encoderblock', 3)}


def test_linear_ratio_ramps_over_each_stacks_moe_layers():
  drop = experts.Drop('linear:0.2:0.8').for_layers(tree.layer_positions(
      ['decoder/layers_3/mlp', 'decoder/layers_5/mlp', 'encoder/layers_1/mlp',
       'encoder/layers_11/mlp', 'encoder/layers_3/mlp', 'Transformer/encoderblock_7/MlpBlock_0']))
  ratios = {layer: drop.ratio_at(layer) for layer, _ in drop.positions}
  assert hash(drop) == hash(experts.Drop('linear:0.2:0.8').for_layers(dict(drop.positions)))
  np.testing.assert_allclose(
      [ratios[f'encoder/layers_{i}/mlp'] for i in (1, 3, 11)], [0.2, 0.32, 0.8])
  np.testing.assert_allclose([ratios['decoder/layers_3/mlp'], ratios['decoder/layers_5/mlp']],
                             [0.2, 0.8])
  assert ratios['Transformer/encoderblock_7/MlpBlock_0'] == 0.2   # a stack's only MoE layer
  assert repr(drop) == "Drop(ratio='linear:0.2:0.8', index_sharing='shared')"


def test_mapping_ratio_by_index_with_paths_overriding():
  drop = experts.Drop({1: 0.25, 3: 0.5, 'decoder/layers_3/mlp': 0.0}).for_layers(
      tree.layer_positions(['encoder/layers_3/mlp', 'decoder/layers_3/mlp',
                            'decoder/layers_1/mlp']))
  assert drop.ratio_at('encoder/layers_3/mlp') == 0.5
  assert drop.ratio_at('decoder/layers_3/mlp') == 0.0
  assert drop.ratio_at('decoder/layers_1/mlp') == 0.25


@pytest.mark.parametrize('ratio,expected', [
    ('linear:0.25:0.75', {0: 0.25, 2: 0.5, 4: 0.75}),
    ({0: 0.75, 2: 0.0, 4: 0.5}, {0: 0.75, 2: 0.0, 4: 0.5})])
def test_layerwise_drop_redraws_each_layers_ratio_of_units(ratio, expected, t5, target):
  d_ff, num_experts = 32, 4
  dense = t5(d_ff=d_ff, num_layers=5)
  mlps = [f'encoder/layers_{i}/mlp' for i in expected]
  params, _ = upcycle(dense, target(dense, mlps, num_experts), experts=experts.Drop(ratio), rng=0)
  flat, flat_dense = tree.flatten(params), tree.flatten(dense)
  for i, r in expected.items():
    wi = np.asarray(flat[f'encoder/layers_{i}/mlp/expert/wi_0/kernel'])  # [E, d_model, d_ff]
    redrawn = (wi != flat_dense[f'encoder/layers_{i}/mlp/wi_0/kernel'][None]).any(axis=1)
    np.testing.assert_array_equal(redrawn.sum(1), round(r * d_ff))


def test_constant_schedules_are_bit_identical_to_a_float_ratio(t5, target):
  dense = t5(num_layers=4)
  tgt = target(dense, ['encoder/layers_1/mlp', 'encoder/layers_3/mlp'], 4)
  base, _ = upcycle(dense, tgt, experts=experts.Drop(0.25), rng=0)
  for ratio in ('linear:0.25:0.25', {1: 0.25, 3: 0.25}):
    same, _ = upcycle(dense, tgt, experts=experts.Drop(ratio), rng=0)
    jax.tree.map(np.testing.assert_array_equal, same, base)
  mlp = tree.flatten(dense['encoder']['layers_1']['mlp'])
  direct = experts.Drop(0.25)(mlp, 4, jax.random.PRNGKey(5), layer='encoder/layers_1/mlp')
  bound = experts.Drop(0.25).for_layers({'encoder/layers_1/mlp': ('encoder/layers', 1)})(
      mlp, 4, jax.random.PRNGKey(5), layer='encoder/layers_1/mlp')
  jax.tree.map(np.testing.assert_array_equal, direct, bound)


def test_the_plan_takes_the_configs_positions_and_refuses_another_models(t5, target):
  dense = t5(num_layers=4)
  tgt = target(dense, ['encoder/layers_1/mlp', 'encoder/layers_3/mlp'], 4)
  given = {'encoder/layers_1/mlp': ('encoder/layers', 1),
           'encoder/layers_3/mlp': ('encoder/layers', 3)}
  drop = experts.Drop('linear:0.25:0.75')
  by_config, _ = upcycle(dense, tgt, experts=drop, rng=0, layers=given)
  by_names, _ = upcycle(dense, tgt, experts=drop, rng=0)
  jax.tree.map(np.testing.assert_array_equal, by_config, by_names)
  with pytest.raises(ValueError, match=r"The model config places MoE blocks at "
                     r"\['encoder/layers_1/mlp'\], but the target has them at "
                     r"\['encoder/layers_1/mlp', 'encoder/layers_3/mlp'\]\. Fix: build"):
    make_plan(dense, tgt, experts=drop, layers={'encoder/layers_1/mlp': ('encoder/layers', 1)})


@pytest.mark.parametrize('ratio,message', [
    ('linaer:0.2:0.8', r"Drop.ratio='linaer:0.2:0.8': not a schedule. Fix: Drop.ratio is a "
                       r"float in \[0, 1\], 'linear:R_FIRST:R_LAST'"),
    ('linear:0.2', r"Drop.ratio='linear:0.2': not a schedule"),
    ('linear:0.2:x', r"Drop.ratio='linear:0.2:x': not a schedule"),
    ('linear:0.2:1.5', r"Drop.ratio='linear:0.2:1.5': R_LAST=1.5: must be in \[0, 1\]"),
    ({}, r'Drop.ratio=\{\}: an empty mapping gives no layer a ratio'),
    ({-1: 0.2}, r'Drop.ratio=\{-1: 0.2\}: key -1 is neither a layer index'),
    ({1: 2.0}, r'Drop.ratio\[1\]=2.0: must be in \[0, 1\]'),
    ({1: 'x'}, r"Drop.ratio\[1\]='x': not a number"),
    ([0.2, 0.4], r'Drop.ratio=\[0.2, 0.4\]: not a number. Fix: Drop.ratio is a float'),
])
def test_drop_rejects_bad_ratio_specs(ratio, message):
  with pytest.raises(ValueError, match=message):
    experts.Drop(ratio)


def test_layerwise_ratio_errors_name_the_layer_and_the_fix(t5, target):
  mlp = _t5_mlp(t5)
  with pytest.raises(ValueError, match=r"Drop.ratio='linear:0.2:0.8' varies with the layer "
                     r'index, but encoder/layers_1/mlp is not among.*for_layers'):
    experts.Drop('linear:0.2:0.8')(mlp, 2, KEY, layer='encoder/layers_1/mlp')
  with pytest.raises(ValueError, match=r"Drop.ratio=\{1: 0.2\} varies with the layer index, and "
                     r"the MLP path 'enc/mlp' has none.*Fix: a float Drop.ratio"):
    experts.Drop({1: 0.2}).for_layers(tree.layer_positions(['enc/mlp']))
  dense = t5(num_layers=4)
  tgt = target(dense, ['encoder/layers_1/mlp', 'encoder/layers_3/mlp'], 2)
  with pytest.raises(ValueError, match=r'Drop.ratio=\{1: 0.2\} has no ratio for the MoE layer '
                     r"encoder/layers_3/mlp. Fix: add 3 \(every stack\) or 'encoder/layers_3/mlp'"):
    make_plan(dense, tgt, experts=experts.Drop({1: 0.2}))   # before anything is read
  with pytest.raises(ValueError, match=r"\['encoder/layer_3/mlp'\] are not MoE layers of the "
                     r"model \(\['encoder/layers_1/mlp', 'encoder/layers_3/mlp'\]\)"):
    make_plan(dense, tgt, experts=experts.Drop({1: 0.2, 'encoder/layer_3/mlp': 0.5}))


def test_unknown_mlp_is_a_clear_error():
  mlp = {'fc1/kernel': np.zeros((4, 8), np.float32), 'fc2/kernel': np.zeros((8, 4), np.float32)}
  with pytest.raises(ValueError, match=r"'fc1/kernel' in the MLP at enc/mlp is not in the d_ff "
                     r'axis table.*D_FF_AXES in upcycle/upcycling/ffn.py'):
    experts.Drop(0.5)(mlp, 2, KEY, layer='enc/mlp')
  out = experts.Copy()(mlp, 2, KEY, layer='enc/mlp')  # Copy does not need the table
  assert out['fc1/kernel'].shape == (2, 4, 8)


@pytest.mark.parametrize('mode', ['add', 'replace'])
def test_noise_neurons(mode, t5, untouched):
  mlp = _t5_mlp(t5, d_ff=64)
  out = experts.Noise(std=0.1, fraction=0.25, mode=mode, unit='neuron')(mlp, 4, KEY)
  same = untouched(mlp, out, 4)
  np.testing.assert_array_equal(same.sum(1), 64 - 16)
  for name, x in mlp.items():
    axis = ffn.d_ff_axis(name)
    new = np.moveaxis(np.asarray(out[name]), axis + 1, -1)
    old = np.moveaxis(x, axis, -1)[None]
    noise = (new - old)[~same[:, None, :].repeat(new.shape[1], 1)] if mode == 'add' else \
        new[~same[:, None, :].repeat(new.shape[1], 1)]
    assert abs(noise.std() - 0.1) < 0.02 and abs(noise.mean()) < 0.02


def test_noise_elements_fraction(vit):
  mlp = _vit_mlp(vit, mlp_dim=64)
  out = experts.Noise(std=0.01, fraction=0.3, unit='element')(mlp, 8, KEY)
  changed = np.concatenate([(np.asarray(out[n]) != x[None]).ravel() for n, x in mlp.items()])
  assert abs(changed.mean() - 0.3) < 0.02


def test_random_ignores_dense_values_and_scales_by_fan_in(t5):
  mlp = _t5_mlp(t5, d_ff=256)
  out = experts.Random()(mlp, 2, KEY)
  wi = np.asarray(out['wi_0/kernel'])
  assert wi.shape == (2, 8, 256)
  assert abs(wi.std() - np.sqrt(1 / 8)) < 0.05 and abs(wi.mean()) < 0.02
  wo = np.asarray(out['wo/kernel'])
  assert abs(wo.std() - np.sqrt(1 / 256)) < 0.01
  assert not np.array_equal(wi[0], wi[1])
  custom = experts.Random(init_fn=jax.nn.initializers.zeros)(mlp, 2, KEY)
  assert not np.asarray(custom['wo/kernel']).any()


def test_random_vit_biases_are_zero(vit):
  out = experts.Random()(_vit_mlp(vit), 2, KEY)
  assert not np.asarray(out['Dense_0/bias']).any() and not np.asarray(out['Dense_1/bias']).any()


@pytest.mark.parametrize('model,copied', [('t5', 2), ('t5', 4), ('vit', 1)])
def test_partial_copies_the_first_experts_and_draws_the_rest_as_random(model, copied, t5, vit):
  num_experts = 4
  mlp = _t5_mlp(t5) if model == 't5' else _vit_mlp(vit)
  out = experts.Partial(copied=copied)(mlp, num_experts, KEY)
  scratch = experts.Random()(mlp, num_experts, KEY)
  for name, x in mlp.items():
    w = np.asarray(out[name])
    assert w.shape == (num_experts,) + x.shape and w.dtype == x.dtype
    np.testing.assert_array_equal(w[:copied], np.broadcast_to(x, (copied,) + x.shape))
    np.testing.assert_array_equal(w[copied:], np.asarray(scratch[name])[copied:])
    assert not any(np.array_equal(w[e], x) for e in range(copied, num_experts))


def test_partial_passes_its_scratch_initializer_on():
  mlp = {'wi/kernel': np.ones((4, 8), np.float32)}
  zeros = experts.Random(init_fn=jax.nn.initializers.zeros)
  out = np.asarray(experts.Partial(1, zeros)(mlp, 3, KEY)['wi/kernel'])
  assert out[0].all() and not out[1:].any()


def test_partial_rejects_bad_arguments(t5, target):
  for copied in (-1, 1.5, True):
    with pytest.raises(ValueError, match=rf'Partial.copied={copied!r}: must be an int >= 0'):
      experts.Partial(copied=copied)
  with pytest.raises(ValueError, match=r'Partial.scratch=Copy\(\): must be a Random'):
    experts.Partial(1, experts.Copy())
  with pytest.raises(ValueError, match=r'Partial.copied=5 at enc/mlp: the MoE block has only 4 '
                     r'experts. Fix: Partial.copied <= 4'):
    experts.Partial(5)(_t5_mlp(t5), 4, KEY, layer='enc/mlp')
  dense = t5()
  with pytest.raises(ValueError, match=r'Partial.copied=5 at encoder/layers_1/mlp'):
    make_plan(dense, target(dense, ['encoder/layers_1/mlp'], 4), experts=experts.Partial(5))


def _gelu(x):
  return np.asarray(jax.nn.gelu(x, approximate=True))


def _t5_ffn(x, p, e=None):
  get = (lambda n: p[n]) if e is None else (lambda n: p[n][e])
  return (_gelu(x @ get('wi_0/kernel')) * (x @ get('wi_1/kernel'))) @ get('wo/kernel')


def _vit_ffn(x, p, e=None):
  get = (lambda n: p[n]) if e is None else (lambda n: p[n][e])
  return (_gelu(x @ get('Dense_0/kernel') + get('Dense_0/bias')) @ get('Dense_1/kernel') +
          get('Dense_1/bias'))


def _moe(x, expert_params, router, ffn_fn, num_experts, router_type, k):
  """Reference MoE with normalized combine weights: top-k per token or experts' top-c tokens."""
  logits = x @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  taken = np.zeros_like(probs, bool)
  if router_type == 'tokens_choose':
    order = np.argsort(-probs, axis=-1, kind='stable')[:, :k]
    np.put_along_axis(taken, order, True, axis=-1)
  else:
    capacity = k
    order = np.argsort(-probs, axis=0, kind='stable')[:capacity]
    np.put_along_axis(taken, order, True, axis=0)
  weights = np.where(taken, probs, 0)
  weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-30)
  outs = np.stack([ffn_fn(x, expert_params, e) for e in range(num_experts)], 1)
  return (weights[..., None] * outs).sum(1), taken.any(-1)


@pytest.mark.parametrize('model', ['t5', 'vit'])
@pytest.mark.parametrize('router_type,k', [('tokens_choose', 2), ('tokens_choose', 4),
                                            ('experts_choose', 5)])
def test_granular_is_function_preserving(model, router_type, k, t5, vit):
  g, num_experts = 2, 6
  mlp = _t5_mlp(t5, 32) if model == 't5' else _vit_mlp(vit, 32)
  ffn_fn = _t5_ffn if model == 't5' else _vit_ffn
  init = experts.Granular(g)
  shapes = {n: x.shape for n, x in mlp.items()}
  out = {n: np.asarray(v) for n, v in init(mlp, num_experts, KEY).items()}
  assert {n: v.shape for n, v in out.items()} == init.expert_shapes(shapes, num_experts)
  router = np.random.default_rng(0).normal(0, 0.5, (8, num_experts)).astype(np.float32)
  router = np.asarray(init.tie_router({'w/kernel': router})['w/kernel'])
  np.testing.assert_array_equal(router[:, 0], router[:, 1])
  x = np.random.default_rng(1).normal(size=(10, 8)).astype(np.float32)
  y, routed = _moe(x, out, router, ffn_fn, num_experts, router_type, k)
  assert routed.any()
  np.testing.assert_allclose(y[routed], ffn_fn(x, mlp)[routed], rtol=1e-4, atol=1e-4)


def test_granular_checks_divisibility(t5):
  with pytest.raises(ValueError, match=r'num_experts \(3\) and the dense d_ff \(32\) to be '
                     r'multiples of 2'):
    experts.Granular(2)(_t5_mlp(t5), 3, KEY, layer='enc')


def test_from_checkpoints_of_identical_sources_equals_copy(t5):
  dense = t5()
  mlp = _t5_mlp(t5)
  init = experts.FromCheckpoints([dense, dense, dense])
  out = init(mlp, 3, KEY, layer='encoder/layers_1/mlp')
  copy = experts.Copy()(mlp, 3, KEY)
  for name in mlp:
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(copy[name]))
  shared = init.shared_params()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), shared, dense)


def test_from_checkpoints_assignment_and_base(t5):
  sources = [t5(seed=s) for s in range(3)]
  init = experts.FromCheckpoints(sources, assignment=[2, 0, 0, 1], base=1)
  out = init({'wo/kernel': None}, 4, KEY, layer='encoder/layers_1/mlp')
  wo = [s['encoder']['layers_1']['mlp']['wo']['kernel'] for s in sources]
  for e, a in enumerate([2, 0, 0, 1]):
    np.testing.assert_array_equal(np.asarray(out['wo/kernel'][e]), wo[a])
  assert (init.shared_params()['token_embedder']['embedding'] is
          sources[1]['token_embedder']['embedding'])
  mean = experts.FromCheckpoints(sources).shared_params()['token_embedder']['embedding']
  np.testing.assert_allclose(mean, np.mean([s['token_embedder']['embedding'] for s in sources], 0),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r'has 2 experts but the assignment names 4'):
    init({'wo/kernel': None}, 2, KEY, layer='encoder/layers_1/mlp')


def test_from_checkpoints_rejects_different_architectures(t5):
  with pytest.raises(ValueError, match=r'encoder/layers_0/mlp/wi_0/kernel is \(8, 32\) float32 in '
                     r'source 0 but \(8, 16\) float32 in source 1'):
    experts.FromCheckpoints([t5(d_ff=32), t5(d_ff=16)])


def _sources_with_known_distances():
  base = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
  noise = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
  a, b, c = base, base + 0.1 * noise, -base + 0.3 * noise  # (0, 2) are the most distant
  return [{'mlp': {'wi': {'kernel': x}, 'wo': {'kernel': x.T.copy()}}} for x in (a, b, c)]


def test_merge_picks_the_most_distant_pair():
  sources = _sources_with_known_distances()
  vectors = np.stack([np.concatenate([s['mlp']['wi']['kernel'].ravel(),
                                      s['mlp']['wo']['kernel'].ravel()])
                      for s in sources])
  assert most_distant_pair(vectors @ vectors.T) == (0, 2)
  assert most_distant_pair(vectors @ vectors.T, {(0, 2)}) == (1, 2)
  mlp = {'wi/kernel': sources[0]['mlp']['wi']['kernel'],
         'wo/kernel': sources[0]['mlp']['wo']['kernel']}
  out = experts.Merge(sources)(mlp, 5, KEY, layer='mlp')
  wi = np.asarray(out['wi/kernel'])
  for e in range(3):
    np.testing.assert_array_equal(wi[e], sources[e]['mlp']['wi']['kernel'])
  np.testing.assert_allclose(wi[3], (wi[0] + wi[2]) / 2, rtol=1e-6)
  assert not np.allclose(wi[4], wi[3])  # the next expert merges a different pair


def _mlp_of(source):
  return {'wi/kernel': source['mlp']['wi']['kernel'], 'wo/kernel': source['mlp']['wo']['kernel']}


def test_merge_dare_adds_dropped_and_rescaled_deltas_to_the_base():
  sources = _sources_with_known_distances()
  base = {'mlp': {'wi': {'kernel': np.full((4, 6), 0.5, np.float32)},
                  'wo': {'kernel': np.full((6, 4), 0.5, np.float32)}}}
  out = experts.Merge(sources, method='dare', drop_rate=0.5, dare_base=base)(
      _mlp_of(sources[0]), 4, KEY, layer='mlp')
  a, c, b0 = sources[0]['mlp']['wi']['kernel'], sources[2]['mlp']['wi']['kernel'], 0.5
  new = np.asarray(out['wi/kernel'][3])
  # Each entry is b0 + (ma * (a - b0) + mc * (c - b0)) / 0.5 / 2 for masks ma, mc in {0, 1}.
  candidates = np.stack([np.full_like(a, b0), a, c, a + c - b0])
  matches = np.isclose(new[None], candidates, rtol=1e-5, atol=1e-6)
  assert matches.any(0).all()
  assert matches[0].any() and matches[3].any()   # both masks varied
  with pytest.raises(ValueError, match='sources.Merge.dare_base'):
    experts.Merge(sources, method='dare')
  with pytest.raises(ValueError, match='2 sources but the MoE block at mlp has only 1'):
    experts.Merge(sources[:2])(_mlp_of(sources[0]), 1, KEY, layer='mlp')


@pytest.mark.parametrize('drop_rate,seed', [(0.0, 0), (0.3, 1), (0.5, 2), (0.9, 3)])
def test_dare_of_experts_equal_to_the_base_is_the_base_exactly(drop_rate, seed):
  theta = np.random.default_rng(seed).normal(size=(5, 7)).astype(np.float32)
  merged = sources_lib.dare_merge([{'w': theta}, {'w': theta.copy()}], {'w': theta}, drop_rate,
                                  jax.random.PRNGKey(seed))
  np.testing.assert_array_equal(np.asarray(merged['w']), theta)


def test_dare_is_unbiased_around_the_base():
  # Constant deltas 1 and 3 around base 2: E[merge] = 2 + (1 + 3) / 2 = 4 per entry; the mean of
  # n entries has standard deviation sqrt(p / (1 - p) * (1 + 9) / 4 / n) (independent masks).
  n, p = 40000, 0.5
  base = np.full((n,), 2.0, np.float32)
  merged = np.asarray(sources_lib.dare_merge([{'w': base + 1}, {'w': base + 3}], {'w': base}, p,
                                             jax.random.PRNGKey(0))['w'])
  std = np.sqrt(p / (1 - p) * 10 / 4 / n)
  assert abs(merged.mean() - 4.0) < 5 * std
  assert set(np.unique(merged).tolist()) == {2.0, 3.0, 5.0, 6.0}   # 2 + (m1 * 2 + m2 * 6) / 2


@pytest.mark.parametrize('name', sorted(experts.EXPERT_INITS))
def test_every_expert_name_convert_accepts_is_one_get_accepts(name):
  """`python -m upcycle.convert --experts=NAME` and `experts.get(NAME)` share one registry."""
  from upcycle import convert  # pylint: disable=g-import-not-at-top
  parsed = convert.parse_init(name, experts.EXPERT_INITS, '--experts')
  assert parsed == experts.get(name) == experts.EXPERT_INITS[name]()
  assert isinstance(parsed, experts.ExpertInit)


def test_granular_by_name_is_granular_2():
  assert experts.get('granular') == experts.Granular(2)
  with pytest.raises(ValueError, match=r"experts='grain': expected a ExpertInit instance or one of "
                     r"\('copy', 'drop', 'noise', 'random', 'partial', 'granular', "
                     r"'zero_output'\)"):
    experts.get('grain')


MOE_LAYERS = ('encoder/layers_0/mlp', 'encoder/layers_1/mlp')


def _sources_whose_pairs_differ_by_scope(t5):
  """Three sources and a DARE base, all T5 trees of 2 layers: in layer 0 sources 0 and 1 are
  opposite (cosine distance 2), in layer 1 sources 1 and 2 are, at 10x the scale: layer 0
  alone picks (0, 1), layer 1 and the whole model (1, 2)."""
  rng = np.random.default_rng(7)
  sources, base = [t5(seed=s) for s in range(3)], t5(seed=9)
  for layer, scale, opposite in ((0, 1.0, (0, 1)), (1, 10.0, (1, 2))):
    for name, leaf in base['encoder'][f'layers_{layer}']['mlp'].items():
      x, y = (scale * rng.normal(size=leaf['kernel'].shape).astype(np.float32) for _ in 'xy')
      values = {opposite[0]: x, opposite[1]: -x}
      for s, source in enumerate(sources):
        source['encoder'][f'layers_{layer}']['mlp'][name]['kernel'] = values.get(s, y)
      leaf['kernel'] = 0.1 * rng.normal(size=leaf['kernel'].shape).astype(np.float32)
  return sources, base


def _mlp_leaves(tree_, layer):
  """{'wi_0/kernel': array, ...} of `layer`'s MLP in a dense tree, names sorted."""
  flat = tree.flatten(tree_)
  return {p[len(layer) + 1:]: np.asarray(v, np.float32) for p, v in sorted(flat.items())
          if p.startswith(layer + '/')}


def _numpy_dare(a, b, base, key, drop_rate):
  """DARE of MLPs a and b around base, in numpy, with masks from jax.random.uniform(key): one
  draw for all leaves, a's leaves (sorted) first, then b's."""
  names = sorted(base)
  u = np.asarray(jax.random.uniform(key, (2 * sum(base[n].size for n in names),)))
  keep, out, start = 1.0 - drop_rate, {}, 0
  kept = []
  for expert in (a, b):
    for name in names:
      size = base[name].size
      kept.append((expert, name, u[start:start + size].reshape(base[name].shape) < keep))
      start += size
  for name in names:
    deltas = [np.where(mask, (e[name] - base[name]) / keep, 0.0) for e, n, mask in kept
              if n == name]
    out[name] = base[name] + (deltas[0] + deltas[1]) / 2
  return out


def _cosine_distance(inner):
  norms = np.sqrt(np.diag(inner))
  return 1.0 - inner / np.outer(norms, norms)


def _numpy_upit(sources, base, scope, num_experts, seed, drop_rate):
  """{layer: [expert MLPs]} and {layer: [pair of each merged expert]} by UpIT's rule in numpy:
  while fewer than E, merge the unmerged pair at the largest cosine distance (of the layer's
  MLPs, or of every layer's concatenated), the merge joining the pool."""
  experts_key = jax.random.split(jax.random.PRNGKey(seed))[0]   # the plan's experts' key
  keys = {layer: base_lib.key_for(experts_key, layer) for layer in MOE_LAYERS}
  pools = {layer: [_mlp_leaves(s, layer) for s in sources] for layer in MOE_LAYERS}
  bases = {layer: _mlp_leaves(base, layer) for layer in MOE_LAYERS}
  pairs = {layer: [] for layer in MOE_LAYERS}

  def inner(layer):
    v = np.stack([np.concatenate([e[n].ravel() for n in sorted(e)]) for e in pools[layer]])
    return v.astype(np.float64) @ v.T.astype(np.float64)

  while len(pools[MOE_LAYERS[0]]) < num_experts:
    groups = [MOE_LAYERS] if scope == 'model' else [(layer,) for layer in MOE_LAYERS]
    for group in groups:
      distance = _cosine_distance(sum(inner(layer) for layer in group))
      k = len(distance)
      pair = max(((i, j) for i in range(k) for j in range(i + 1, k)
                  if (i, j) not in pairs[group[0]]), key=lambda p: distance[p])
      for layer in group:
        pairs[layer].append(pair)
        pools[layer].append(_numpy_dare(
            pools[layer][pair[0]], pools[layer][pair[1]], bases[layer],
            base_lib.key_for(keys[layer], str(len(pools[layer]))), drop_rate))
  return pools, pairs


@pytest.mark.parametrize('scope', ['layer', 'model'])
def test_merge_pair_scope_merges_the_pair_its_rule_names_in_every_layer(t5, target, scope):
  """UpIT with 3 sources and 5 experts (two DARE merges) through the plan: every expert of
  every MoE layer equals the numpy DARE merge of the pair the rule picks (layer by layer, or
  once for the model); 'model' gives expert model 3 of the router stage one pair everywhere."""
  from upcycle.train import router_stage  # pylint: disable=g-import-not-at-top
  sources, base = _sources_whose_pairs_differ_by_scope(t5)
  init = experts.Merge(sources, method='dare', drop_rate=0.5, dare_base=base, pair_scope=scope)
  params, _ = upcycle_from_checkpoints(init, target(sources[0], list(MOE_LAYERS), 5), rng=3)
  want, pairs = _numpy_upit(sources, base, scope, num_experts=5, seed=3, drop_rate=0.5)
  first = {layer: pairs[layer][0] for layer in MOE_LAYERS}
  assert first == ({MOE_LAYERS[0]: (0, 1), MOE_LAYERS[1]: (1, 2)} if scope == 'layer' else
                   {MOE_LAYERS[0]: (1, 2), MOE_LAYERS[1]: (1, 2)})
  flat = tree.flatten(params)
  for layer in MOE_LAYERS:
    for e in range(5):
      for name, value in want[layer][e].items():
        np.testing.assert_allclose(np.asarray(flat[f'{layer}/expert/{name}'][e]), value,
                                   rtol=1e-5, atol=1e-5, err_msg=f'{layer} expert {e} {name}')
  if scope == 'model':   # the router stage's expert model 3: DARE(source 1, source 2) everywhere
    model_3 = tree.flatten(router_stage.expert_params(params, 3))
    for layer in MOE_LAYERS:
      for name, value in want[layer][3].items():
        np.testing.assert_allclose(np.asarray(model_3[f'{layer}/{name}']), value, rtol=1e-5,
                                   atol=1e-5)


def test_merge_pair_scope_is_checked_and_model_needs_the_plan():
  sources = _sources_with_known_distances()
  with pytest.raises(ValueError, match=r"^sources.Merge.pair_scope='global': expected one of "
                                       r"\('layer', 'model'\).$"):
    experts.Merge(sources, pair_scope='global')
  with pytest.raises(ValueError, match=r"^Merge\(pair_scope='model'\) picks each merged "
                                       r'expert.s pair over every MoE layer, and was called for '
                                       r'mlp without them. Fix: upcycle through the plan'):
    experts.Merge(sources, pair_scope='model')(_mlp_of(sources[0]), 4, KEY, layer='mlp')
