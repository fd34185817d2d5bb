"""Growing trained checkpoints: more experts (function kept where the docstring says) and more
layers; parameters, optimizer states and errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.checkpoints import helpers
from upcycle import layers, tree
from upcycle.models.families import abstract_params
from upcycle.moe import MoeConfig, MoeLayer, ROUTER_LOGITS, capacity, router_logits, routers
from upcycle.train import optimizers
from upcycle.upcycling import depth_growth, expert_growth, grow_depth, grow_experts
from upcycle.upcycling import carry_optimizer_state, router_usage

S = jax.ShapeDtypeStruct
WI, ROUTER = 'mlp/expert/wi/kernel', 'mlp/router/w/kernel'


@pytest.mark.slow
def test_tiling_every_expert_with_k_and_capacity_scaled_keeps_the_t5_logits():
  """E 2 -> 4, every expert copied once ('tile'), unnormalized weights, binding capacity:
  Expert Choice (encoder) with the capacity factor doubled, Top-1 -> Top-2 (decoder) at the
  same 'vmoe' capacity factor."""
  one_layer = dataclasses.replace(helpers.CHECKPOINT_T5, num_encoder_layers=1, num_decoder_layers=1)
  moe = lambda e, c, k: dataclasses.replace(
      one_layer, encoder_moe=MoeConfig(num_experts=e, router=routers.ExpertsChoose(),
                                       eval_capacity_factor=c,
                                       capacity_convention=capacity.Vmoe(multiple_of=1)),
      decoder_moe=MoeConfig(num_experts=e, router=routers.TopK(k=k),
                            eval_capacity_factor=1.0,
                            capacity_convention=capacity.Vmoe(multiple_of=1)),
      encoder_moe_layers='all', decoder_moe_layers='all')
  small, grown = moe(2, 1.0, 1), moe(4, 2.0, 2)
  params = helpers.random_params(small, scale=1.0)
  new, growth = grow_experts(params, abstract_params(grown), sources='tile')
  np.testing.assert_allclose(helpers.t5_logits(new, grown), helpers.t5_logits(params, small),
                             atol=2e-5)
  assert 'decoder/layers_0/mlp: 2 -> 4 experts, new experts [2, 3] copy [0, 1]' in str(growth)


def test_top1_normalized_keeps_its_output_with_the_most_used_expert_copied():
  """E 2 -> 3, Top-1 with normalized combine weights, capacity not binding; usage measured."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8))
  config = lambda e: MoeConfig(num_experts=e, router=routers.TopK(k=1),
                               capacity_convention=capacity.Vmoe(multiple_of=1),
                               normalize_combine_weights=True, eval_capacity_factor=4.0)
  layer = lambda e: MoeLayer(config(e), functools.partial(layers.GatedMlp, d_ff=16))
  apply = lambda e, p: jax.jit(lambda p: layer(e).apply(
      {'params': p}, x, True, mutable=[ROUTER_LOGITS]))(p['mlp'])
  abstract = lambda e: {'mlp': tree.unbox(jax.eval_shape(
      lambda key: layer(e).init(key, x, True), jax.random.PRNGKey(0)))['params']}
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), abstract(2))
  target = abstract(3)
  want, state = apply(2, params)
  usage = {'mlp': router_usage(router_logits(state))['']}
  new, _ = grow_experts(params, target, sources='most_used', usage=usage)
  np.testing.assert_allclose(apply(3, new)[0], want, atol=1e-6)
  source = int(np.argmax(usage['mlp']))
  old, got = tree.flatten(params), tree.flatten(new)
  wo, kernel = 'mlp/expert/wo/kernel', 'mlp/router/router_weights/w/kernel'
  np.testing.assert_array_equal(got[wo][:2], old[wo])
  np.testing.assert_array_equal(got[wo][2], old[wo][source])
  np.testing.assert_array_equal(got[kernel][:, 2], old[kernel][:, source])


def _params(num_experts, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return {'mlp': {'expert': {'wi': {'kernel': normal(num_experts, 4, 6)}},
                  'router': {'w': {'kernel': normal(4, num_experts)}}},
          'norm': {'scale': normal(4)}}


def _trained(optimizer, params, steps=2):
  update = jax.jit(optimizer.update)   # one compilation instead of one per operation
  state = optimizer.init(params)
  for seed in range(steps):
    _, state = update(_params(2, seed + 1), state, params)
  return state


AXES = {WI: ('expert', 'embed', 'mlp'), ROUTER: ('embed', 'unmodeled'), 'norm/scale': ('embed',)}
OPTIMIZERS = {
    'adam': lambda: optax.adam(1e-3),
    # min_dim 2: the router [4, E] is factored over its expert axis (its estimate is rebuilt).
    'adafactor': lambda: optax.adafactor(1e-3, min_dim_size_to_factor=2, momentum=0.9),
    't5x': lambda: optimizers.T5XAdafactor(min_dim_size_to_factor=2, beta1=0.9).build(AXES),
}


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_new_experts_get_their_sources_weights_and_moments(name):
  optimizer = OPTIMIZERS[name]()
  params = _params(2)
  state = _trained(optimizer, params)
  target = jax.tree.map(lambda x: S(x.shape, x.dtype), _params(3))
  new, growth = grow_experts(params, target, sources=[1])
  np.testing.assert_array_equal(new['mlp']['expert']['wi']['kernel'][2],
                                params['mlp']['expert']['wi']['kernel'][1])
  np.testing.assert_array_equal(new['mlp']['router']['w']['kernel'][:, 2],
                                params['mlp']['router']['w']['kernel'][:, 1])
  grown = jax.jit(lambda s, p: carry_optimizer_state(s, growth, p, optimizer))(state, new)
  assert jax.tree.structure(grown) == jax.tree.structure(optimizer.init(new))
  counts = [x for p, x in jax.tree_util.tree_leaves_with_path(grown) if 'count' in str(p)]
  assert counts and all(int(c) == 2 for c in counts)
  index = [0, 1, 1]
  if name == 't5x':
    slot = lambda s, path, k: np.asarray(getattr(tree.flatten(s.param_states)[path], k))
  else:   # optax: ScaleByAdamState / FactoredState first in the chain
    slot = lambda s, path, k: np.asarray(tree.flatten(getattr(s[0], k))[path])
  if name == 'adam':
    for k in ('mu', 'nu'):
      np.testing.assert_array_equal(slot(grown, WI, k), slot(state, WI, k)[index])
      np.testing.assert_array_equal(slot(grown, ROUTER, k), slot(state, ROUTER, k)[:, index])
    return
  if name == 'adafactor':
    np.testing.assert_array_equal(tree.flatten(grown[4].ema)[WI],
                                  np.asarray(tree.flatten(state[4].ema)[WI])[index])
  # Experts [E, 4, 6] are factored over (4, 6) alike: each expert's factors are taken.
  for k in ('v_row', 'v_col') + (('m',) if name == 't5x' else ()):
    np.testing.assert_array_equal(slot(grown, WI, k), slot(state, WI, k)[index])
  # The router [4, E] is factored over its expert axis: the rank-one estimate v_col x v_row /
  # mean(v_row) is rebuilt, taken and refactored (exactly, being rank one).
  rank_one = lambda s: np.outer(slot(s, ROUTER, 'v_col'), slot(s, ROUTER, 'v_row')) / slot(
      s, ROUTER, 'v_row').mean()
  assert slot(state, ROUTER, 'v_row').shape == (2,)
  np.testing.assert_allclose(rank_one(grown), rank_one(state)[:, index], rtol=1e-6)


def test_growing_experts_refuses_what_it_cannot_do():
  params = _params(2)
  target = lambda e: jax.tree.map(lambda x: S(x.shape, x.dtype), _params(e))
  with pytest.raises(ValueError, match=r'sources=\[1\] for mlp, which grows from 2 to 4 '
                     r'experts: expected 2 source indices \(one per new expert\), each in '
                     r'\[0, 2\)'):
    grow_experts(params, target(4), sources=[1])
  with pytest.raises(ValueError, match=r'sources=\[0, 2\] .* in \[0, 2\)'):
    grow_experts(params, target(4), sources=[0, 2])
  with pytest.raises(ValueError, match=r"sources='most_used' needs the usage of the experts of "
                     r'mlp, which usage is not given. Fix: pass usage='):
    grow_experts(params, target(3), sources='most_used')
  with pytest.raises(ValueError, match=r'2 experts in the checkpoint and 1 in the target'):
    grow_experts(params, target(1))
  with pytest.raises(ValueError, match=r"sources\['mlp'\]='best': expected one of"):
    grow_experts(params, target(3), sources={'mlp': 'best'})
  half = dict(tree.flatten(target(4)), **{WI: S((4, 4, 6), jnp.bfloat16)})
  with pytest.raises(ValueError, match=r'Target leaf mlp/expert/wi/kernel has dtype bfloat16 '
                     r'but checkpoint leaf mlp/expert/wi/kernel has float32'):
    grow_experts(params, tree.unflatten(half))
  router_norm = expert_growth.plan(params, target(4), sources='router_norm')
  norms = np.linalg.norm(params['mlp']['router']['w']['kernel'], axis=0)
  assert {l.path: l for l in router_norm.copies}[WI].op.index == (0, 1) + tuple(np.argsort(-norms))


def _dense(num_layers):
  return {'encoder': {f'layers_{i}': {'mlp': {'wo': {'kernel': np.full((3, 2), i, np.float32)}}}
                      for i in range(num_layers)},
          'token_embedder': {'embedding': np.ones((5, 2), np.float32)}}


def test_depth_tiles_repeats_or_maps_layers_and_names_the_binding():
  abstract = lambda n: jax.tree.map(lambda x: S(x.shape, x.dtype), _dense(n))
  for spec, want in (('tile', [0, 1, 0, 1]), ('repeat', [0, 0, 1, 1]), ([1, 1, 0, 1], [1, 1, 0, 1]),
                     ({'encoder/layers': 'tile'}, [0, 1, 0, 1])):
    new, growth = grow_depth(_dense(2), abstract(4), layer_map=spec)
    got = [int(new['encoder'][f'layers_{i}']['mlp']['wo']['kernel'][0, 0]) for i in range(4)]
    assert got == want, spec
    assert f'encoder/layers: 2 -> 4 layers, from layers {want}' in str(growth)
  bad = [('tile', 3, r"modes.GrowDepth.layer_map='tile': encoder/layers grows from 2 to 3 layers, "
                     r'not a multiple of 2'),
         ([0, 1, 2, 0], 4, r'modes.GrowDepth.layer_map=\[0, 1, 2, 0\] for encoder/layers, which '
                           r'grows from 2 to 4 layers: expected 4 source layers, each in \[0, 2\)'),
         ([0, 1], 4, r'expected 4 source layers'),
         ('stack', 4, r"modes.GrowDepth.layer_map='stack': expected one of \('tile', 'repeat'\)"),
         ({'decoder/layers': 'tile'}, 4, r"names \['decoder/layers'\], which are not layer stacks"),
         ({}, 4, r'modes.GrowDepth.layer_map has no entry for encoder/layers')]
  for spec, depth, message in bad:
    with pytest.raises(ValueError, match=message):
      depth_growth.plan(_dense(2), abstract(depth), layer_map=spec,
                        binding='modes.GrowDepth.layer_map')


def test_a_deepened_vit_runs_and_its_new_layers_are_copies():
  deep = dataclasses.replace(helpers.CHECKPOINT_VIT, depth=4)
  params = helpers.random_params(helpers.CHECKPOINT_VIT)
  new, _ = grow_depth(params, abstract_params(deep), layer_map='repeat')
  flat, old = tree.flatten(new), tree.flatten(params)
  for path, value in flat.items():
    parts = depth_growth.split(path)
    source = path if parts is None else f'{parts[0]}_{parts[1] // 2}/{parts[2]}'
    np.testing.assert_array_equal(value, old[source], err_msg=path)
  assert 'Transformer/encoderblock_3/MlpBlock_0/Dense_1/bias' in flat
  logits = helpers.vit_logits(new, deep)
  assert logits.shape == (2, helpers.CHECKPOINT_VIT.num_classes) and np.isfinite(logits).all()
