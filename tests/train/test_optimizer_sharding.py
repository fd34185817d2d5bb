"""Optimizer-state shardings on a 2x2x2 mesh (data x expert x model) of simulated devices.

Every slot is sharded like its parameter along the axes it keeps
(`upcycle/optimizer_state/shardings.py`): in the trainer's abstract state, in the arrays it creates,
and in the states the restore and growth hooks build from checkpoints.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from tests.checkpoints import helpers, t5x_writer
from tests.train.helpers import mesh_run
from upcycle import checkpoints, partitioning, tree
from upcycle.checkpoints import orbax
from upcycle.models import T5, ViT
from upcycle.moe import MoeConfig, capacity, routers
from upcycle.optimizer_state import shardings as slots
from upcycle.train import objectives, optimizers, resume
from upcycle.restore import Restore
from upcycle.train_state import TrainState
from upcycle.upcycling import modes, sharded

ENCODER_MOE = MoeConfig(num_experts=4, router=routers.ExpertsChoose(),
                        capacity_convention=capacity.Vmoe(multiple_of=1))
DECODER_MOE = MoeConfig(num_experts=4, router=routers.TopK(k=2),
                        capacity_convention=capacity.Vmoe(multiple_of=1))
T5_MOE = dataclasses.replace(helpers.CHECKPOINT_T5, encoder_moe=ENCODER_MOE,
                             decoder_moe=DECODER_MOE)
VIT_MOE = dataclasses.replace(helpers.CHECKPOINT_VIT, moe=ENCODER_MOE)
T5_BATCH = {'encoder_input_tokens': np.zeros((4, 6), np.int32),
            'decoder_input_tokens': np.zeros((4, 4), np.int32),
            'decoder_target_tokens': np.zeros((4, 4), np.int32)}
VIT_BATCH = {'image': np.zeros((4, 8, 8, 3), np.float32), 'label': np.zeros((4,), np.int32)}
SCHEDULE = optax.constant_schedule(1e-3)
# min_dim_size_to_factor 4: the tiny kernels' second moments are factored.
OPTIMIZERS = {
    'adafactor': optimizers.Adafactor(SCHEDULE, min_dim_size_to_factor=4),
    'adamw': optimizers.AdamW(SCHEDULE),
    't5x': optimizers.T5XAdafactor(SCHEDULE, min_dim_size_to_factor=4),
    't5x_momentum': optimizers.T5XAdafactor(SCHEDULE, min_dim_size_to_factor=4, beta1=0.9),
    'big_vision': optimizers.BigVisionAdafactor(SCHEDULE, min_dim_size_to_factor=4),
}
# Expert kernels [E 4, d_model 8, d_ff 12] over ('expert', None, 'model') and
# [E 4, d_ff 12, d_model 8] over ('expert', 'model', None).
T5_WI, T5_WO = 'encoder/layers_1/mlp/expert/wi_0/kernel', 'encoder/layers_1/mlp/expert/wo/kernel'
VIT_WI = 'Transformer/encoderblock_1/MlpBlock_0/expert/Dense_0/kernel'
VIT_WO = 'Transformer/encoderblock_1/MlpBlock_0/expert/Dense_1/kernel'
FULL_WI, FULL_WO = P('expert', None, 'model'), P('expert', 'model', None)
# Factored: optax drops the largest axis (d_ff) from v_row, the second largest (d_model) from
# v_col; T5X drops the column axis (d_ff) from v_row, the row axis (d_model) from v_col. Both
# keep the expert axis: v_row [E, d_model], v_col [E, d_ff].
ROW, COLUMN = P('expert', None), P('expert', 'model')


def _factored(prefix):
  return {f'{prefix}/v_row/{{}}': ROW, f'{prefix}/v_col/{{}}': COLUMN, f'{prefix}/v/{{}}': P(),
          f'{prefix}/count': P()}


def _t5x(m_wi, m_wo):
  return {'param_states/{}/v_row': ROW, 'param_states/{}/v_col': COLUMN,
          'param_states/{}/v': P(), 'param_states/{}/m': (m_wi, m_wo), 'count': P()}


# optimizer -> {state key path ('{}': the kernel's path): spec, or (wi spec, wo spec)}
EXPECTED = {
    'adafactor': _factored('0'),
    'adamw': {'1/0/mu/{}': (FULL_WI, FULL_WO), '1/0/nu/{}': (FULL_WI, FULL_WO),
              '1/0/count': P()},
    't5x': _t5x(P(), P()),
    't5x_momentum': _t5x(FULL_WI, FULL_WO),
    'big_vision': {**_factored('1'), '3/ema/{}': (FULL_WI, FULL_WO), '3/count': P(),
                   '6/count': P()},
}


def _t5(name):
  return mesh_run(objectives.Seq2Seq(T5(T5_MOE)), OPTIMIZERS[name], T5_BATCH)


def _specs(state):
  return {key: x.sharding.spec for key, x in tree.leaves_by_path(state).items()}


def _assert_like_params(opt_state, params):
  """Every param-shaped leaf whose key path holds a param path has that param's spec; every
  scalar is replicated."""
  shapes_specs = {p: (x.shape, x.sharding.spec) for p, x in tree.flatten(params).items()}
  full = 0
  for key, leaf in tree.leaves_by_path(opt_state).items():
    owners = [p for p in shapes_specs if f'/{p}/' in f'/{key}/']
    owner = max(owners, key=len, default=None)
    if owner is not None and leaf.shape == shapes_specs[owner][0]:
      assert leaf.sharding.spec == shapes_specs[owner][1], key
      full += 1
    if not leaf.shape:
      assert leaf.sharding.spec == P(), key
  return full


@pytest.mark.parametrize('model,name', [('t5', n) for n in OPTIMIZERS] +
                         [('vit', 'adamw'), ('vit', 'big_vision')])
def test_every_slot_is_sharded_like_its_parameter(model, name):
  if model == 't5':
    _, abstract = _t5(name)
    kernels = (T5_WI, T5_WO)
  else:
    _, abstract = mesh_run(objectives.Classification(ViT(VIT_MOE)), OPTIMIZERS[name],
                               VIT_BATCH)
    kernels = (VIT_WI, VIT_WO)
  params = tree.flatten(abstract.params)
  assert params[kernels[0]].sharding.spec == FULL_WI
  assert params[kernels[1]].sharding.spec == FULL_WO
  specs = _specs(abstract.opt_state)
  for template, want in EXPECTED[name].items():
    for kernel, spec in zip(kernels, want if isinstance(want, tuple) else (want, want)):
      assert specs[template.format(kernel)] == spec, template.format(kernel)
  full = _assert_like_params(abstract.opt_state, abstract.params)
  moments = {'adamw': 2, 't5x_momentum': 1, 'big_vision': 1}.get(name, 0)  # mu, nu / m / ema
  assert full >= moments * len(params)


def test_slot_map_says_which_axes_each_slot_keeps():
  _, abstract = _t5('t5x_momentum')
  got = slots.slot_map(abstract.opt_state, abstract.params)
  assert got.count == slots.SCALAR
  wi = tree.flatten(got.param_states)[T5_WI]
  assert (wi.v_row, wi.v_col, wi.v, wi.m) == (
      slots.Slot(T5_WI, 'row', (0, 1)), slots.Slot(T5_WI, 'column', (0, 2)), slots.SCALAR,
      slots.Slot(T5_WI, 'full', (0, 1, 2)))
  wo = tree.flatten(got.param_states)[T5_WO]   # rows: d_model (axis 2), columns: d_ff (axis 1)
  assert (wo.v_row.kept_axes, wo.v_col.kept_axes) == ((0, 2), (0, 1))
  adafactor = slots.slot_map(jax.eval_shape(OPTIMIZERS['adafactor'].build().init,
                                            abstract.params), abstract.params)
  # [E 4, d_ff 12, d_model 8]: d0 = 1 (d_ff), d1 = 2 (d_model).
  assert tree.flatten(adafactor[0].v_row)[T5_WO] == slots.Slot(T5_WO, 'row', (0, 2))
  assert tree.flatten(adafactor[0].v_col)[T5_WO] == slots.Slot(T5_WO, 'column', (0, 1))
  assert tree.flatten(adafactor[0].v)[T5_WO] == slots.SCALAR


def _assert_placed(state, abstract):
  assert jax.tree.structure(state) == jax.tree.structure(abstract)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
    assert got.sharding == want.sharding


def _per_device_bytes(leaves):
  return sum(x.addressable_shards[0].data.nbytes for x in leaves)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['adamw', 't5x_momentum'])
def test_fresh_and_resumed_states_are_placed_so_each_device_holds_its_share(name, tmp_path):
  built, abstract = _t5(name)
  with partitioning.activate(built.mesh):
    state = built.fresh_state(0)
  _assert_placed(state, abstract)
  with orbax.CheckpointManager(str(tmp_path), async_save=False) as manager:
    manager.save(1, state.params, state.opt_state)
    resumed = resume.restore(manager, abstract, str(tmp_path))
  _assert_placed(TrainState(state.step, resumed.params, resumed.optimizer_state), abstract)
  leaves = tree.leaves_by_path(state.opt_state)
  experts = {k: x for k, x in leaves.items() if '/expert/' in k and x.ndim >= 2}
  full = [x for k, x in experts.items() if x.ndim == 3]
  assert len(full) == {'adamw': 2, 't5x_momentum': 1}[name] * 6   # wi_0, wi_1, wo x 2 stacks
  total = sum(x.nbytes for x in full)
  assert _per_device_bytes(full) * 4 == total   # expert 2 x model 2
  if name == 't5x_momentum':   # v_row over 'expert' only, v_col over 'expert' and 'model'
    rows = [x for k, x in experts.items() if k.endswith('/v_row')]
    cols = [x for k, x in experts.items() if k.endswith('/v_col')]
    assert _per_device_bytes(rows) * 2 == sum(x.nbytes for x in rows)
    assert _per_device_bytes(cols) * 4 == sum(x.nbytes for x in cols)
  # Replicated, each device would hold all of it; the tiny model's norm scales stay so.
  assert _per_device_bytes(leaves.values()) < 0.5 * sum(x.nbytes for x in leaves.values())


def _recording_reads(monkeypatch):
  """{stored leaf path: spec} of every lazy leaf the hook reads onto the mesh."""
  reads, read = {}, sharded.read

  def recorded(leaf, sharding):
    if isinstance(leaf, checkpoints.LazyArray):
      reads[leaf.param] = sharding.spec
    return read(leaf, sharding)

  monkeypatch.setattr(sharded, 'read', recorded)
  return reads


def test_upcycled_t5x_state_is_read_and_placed_like_the_params(tmp_path, monkeypatch):
  params = helpers.random_params(helpers.CHECKPOINT_T5)
  stored = 'state/param_states/encoder/layers_1/mlp/wi_0/kernel/'
  directory = t5x_writer.write(
      str(tmp_path), 6, params, helpers.t5x_slots(params),
      t5x_writer.Layout(zarr={stored + 'v_row': 'gzip', stored + 'v_col': 'gzip'}))
  built, abstract = _t5('t5x_momentum')
  reads = _recording_reads(monkeypatch)
  with partitioning.activate(built.mesh):
    state = Restore(directory, modes.Upcycle(),
                    reuse_optimizer_state=True)(abstract, built.optimizer)
  _assert_placed(state, abstract)
  wi = tree.flatten(state.opt_state.param_states)[T5_WI]
  assert (wi.v_row.sharding.spec, wi.v_col.sharding.spec, wi.m.sharding.spec) == (
      ROW, COLUMN, FULL_WI)
  np.testing.assert_array_equal(  # the dense [d_model] v_row, tiled over the experts
      np.asarray(wi.v_row), np.broadcast_to(tree.flatten(helpers.t5x_slots(params))[
          'encoder/layers_1/mlp/wi_0/kernel/v_row'], (4, 8)))
  # The dense [d_model, d_ff] kernel is read over (None, 'model'), as each expert needs it; its
  # stored factors along the axes they keep.
  assert reads == {stored + 'v_row': P(None), stored + 'v_col': P('model')}


def test_grown_adafactor_state_is_placed_like_the_params(tmp_path, monkeypatch):
  small = dataclasses.replace(
      T5_MOE, num_encoder_layers=1, num_decoder_layers=1,
      encoder_moe=dataclasses.replace(ENCODER_MOE, num_experts=2),
      decoder_moe=dataclasses.replace(DECODER_MOE, num_experts=2, router=routers.TopK(k=1)),
      encoder_moe_layers='all', decoder_moe_layers='all')
  params = helpers.random_params(small)
  optimizer = OPTIMIZERS['adafactor'].build()
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.1, x.dtype), params)
  _, opt_state = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
  with orbax.CheckpointManager(str(tmp_path), async_save=False) as manager:
    manager.save(5, params, opt_state)
  grown = dataclasses.replace(
      small, encoder_moe=dataclasses.replace(small.encoder_moe, num_experts=4))
  built, abstract = mesh_run(objectives.Seq2Seq(T5(grown)), OPTIMIZERS['adafactor'],
                                   T5_BATCH)
  reads = _recording_reads(monkeypatch)
  with partitioning.activate(built.mesh):
    state = Restore(str(tmp_path), modes.GrowExperts(),
                    reuse_optimizer_state=True)(abstract, built.optimizer)
  _assert_placed(state, abstract)
  wi = T5_WI.replace('layers_1', 'layers_0')
  assert tree.flatten(state.opt_state[0].v_row)[wi].sharding.spec == ROW
  assert tree.flatten(state.opt_state[0].v_col)[wi].sharding.spec == COLUMN
  # The stored [2, d_model, d_ff] experts' factors are read like the grown ones.
  assert reads[f'0/v_row/{wi}'] == ROW and reads[f'0/v_col/{wi}'] == COLUMN


def _saved(built, abstract, directory):
  """A checkpoint of `built`'s fresh state (step 5), written with orbax."""
  with partitioning.activate(built.mesh):
    state = built.fresh_state(0)
  with orbax.CheckpointManager(str(directory), async_save=False) as manager:
    manager.save(5, jax.device_get(state.params), jax.device_get(state.opt_state))
  return str(directory)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_every_optimizer_is_placed_like_the_params_by_upcycling_and_growth(name, tmp_path):
  """Each optimizer's reused state, upcycled from a dense run's checkpoint and grown from an
  MoE run's, comes out with the abstract state's shardings (slots like their parameters)."""
  dense = _saved(*mesh_run(objectives.Seq2Seq(T5(helpers.CHECKPOINT_T5)), OPTIMIZERS[name],
                               T5_BATCH), tmp_path / 'dense')
  built, abstract = _t5(name)
  with partitioning.activate(built.mesh):
    upcycled = Restore(dense, modes.Upcycle(),
                       reuse_optimizer_state=True)(abstract, built.optimizer)
  _assert_placed(upcycled, abstract)
  _assert_like_params(upcycled.opt_state, abstract.params)
  two = dataclasses.replace(T5_MOE, encoder_moe=dataclasses.replace(ENCODER_MOE, num_experts=2))
  small = _saved(*mesh_run(objectives.Seq2Seq(T5(two)), OPTIMIZERS[name], T5_BATCH),
                 tmp_path / 'small')
  with partitioning.activate(built.mesh):
    grown = Restore(small, modes.GrowExperts(),
                    reuse_optimizer_state=True)(abstract, built.optimizer)
  _assert_placed(grown, abstract)
  _assert_like_params(grown.opt_state, abstract.params)
