"""The growth restore hooks on a 2x2x2 mesh: a trained MoE checkpoint (ours, with an AdamW
state) grown to more experts and to more layers equals the library's growth."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

from tests.checkpoints import helpers
from tests.train.helpers import mesh_run
from upcycle import console, partitioning, tree
from upcycle.checkpoints import orbax
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers
from upcycle.train import objectives, optimizers
from upcycle.restore import Restore
from upcycle.upcycling import carry_optimizer_state, depth_growth, execute, expert_growth, modes

ADAMW = optimizers.AdamW(optax.linear_schedule(0.0, 1e-3, 10_000))
BATCH = {'encoder_input_tokens': np.zeros((4, 6), np.int32),
         'decoder_input_tokens': np.zeros((4, 4), np.int32),
         'decoder_target_tokens': np.zeros((4, 4), np.int32)}
SMALL = dataclasses.replace(
    helpers.CHECKPOINT_T5, num_encoder_layers=1, num_decoder_layers=1,
    encoder_moe=MoeConfig(num_experts=2, router=routers.ExpertsChoose()),
    decoder_moe=MoeConfig(num_experts=2, router=routers.TopK(k=1)),
    encoder_moe_layers='all', decoder_moe_layers='all')
WO = 'encoder/layers_0/mlp/expert/wo/kernel'


def _abstract(config):
  return mesh_run(objectives.Seq2Seq(T5(config)), ADAMW, BATCH)


@pytest.fixture(scope='module')
def moe(tmp_path_factory):
  """The small MoE's params and a trained AdamW state, in our orbax format at step 5."""
  params = helpers.random_params(SMALL)
  optimizer = ADAMW.build()
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.1, x.dtype), params)
  _, opt_state = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  directory = str(tmp_path_factory.mktemp('moe'))
  with orbax.CheckpointManager(directory, async_save=False) as manager:
    manager.save(5, params, opt_state)
  return dict(dir=directory, params=params, opt_state=opt_state)


def _assert_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _assert_placed(state, abstract):
  assert jax.tree.structure(state) == jax.tree.structure(abstract)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
    assert got.sharding == want.sharding


def _assert_grown(moe, state, growth, abstract, optimizer):
  _assert_equal(state.params, execute.run(growth, moe['params'], jax.random.PRNGKey(0)))
  _assert_equal(state.opt_state,
                carry_optimizer_state(moe['opt_state'], growth, abstract.params, optimizer))
  assert int(state.step) == 5 and int(state.opt_state[1][0].count) == 1


def test_grow_experts_hook_equals_the_library(moe, capsys, tmp_path):
  console.show_progress()   # as the entry points do
  grown = dataclasses.replace(
      SMALL, encoder_moe=dataclasses.replace(SMALL.encoder_moe, num_experts=4))
  usage = tmp_path / 'usage.json'
  usage.write_text(json.dumps({'encoder/layers_0/mlp': [0.25, 0.75]}))
  built, abstract = _abstract(grown)
  with partitioning.activate(built.mesh):
    state = Restore(moe['dir'], modes.GrowExperts(sources='most_used', usage=str(usage)),
                    reuse_optimizer_state=True)(abstract, built.optimizer)
  _assert_placed(state, abstract)
  growth = expert_growth.plan(moe['params'], abstract.params, sources=[1, 0])
  _assert_grown(moe, state, growth, abstract, built.optimizer)
  np.testing.assert_array_equal(tree.flatten(state.params)[WO][2],
                                tree.flatten(moe['params'])[WO][1])
  out = capsys.readouterr().out
  assert 'encoder/layers_0/mlp: 2 -> 4 experts, new experts [2, 3] copy [1, 0]' in out


def test_grow_depth_hook_equals_the_library_and_names_the_binding(moe):
  deep = dataclasses.replace(SMALL, num_encoder_layers=2)
  built, abstract = _abstract(deep)
  with partitioning.activate(built.mesh):
    with pytest.raises(ValueError, match=r"Restore\('.*', format 'orbax'\): "
                       r'modes.GrowDepth.layer_map=\[0, 1\] for encoder/layers, which grows from '
                       r'1 to 2 layers: expected 2 source layers, each in \[0, 1\)'):
      Restore(moe['dir'], modes.GrowDepth(layer_map=[0, 1]),
              reuse_optimizer_state=True)(abstract, built.optimizer)
    state = Restore(moe['dir'], modes.GrowDepth(),
                    reuse_optimizer_state=True)(abstract, built.optimizer)
  growth = depth_growth.plan(moe['params'], abstract.params)
  _assert_grown(moe, state, growth, abstract, built.optimizer)
  mu = tree.flatten(state.opt_state[1][0].mu)
  np.testing.assert_array_equal(mu[WO.replace('layers_0', 'layers_1')], mu[WO])
