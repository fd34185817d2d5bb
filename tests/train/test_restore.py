"""The restore hook on a 2x2x2 mesh of simulated devices: sharded state == unsharded surgery.

Sources are written in the formats people start from (T5X, HF, our orbax); targets come
from the run's own abstract state (`built_run.build_run`), so the shardings are the ones
training uses.
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from tests.checkpoints import helpers, t5x_writer
from tests.train.helpers import mesh_run
from upcycle import checkpoints, console, partitioning, pretrained, tree
from upcycle.checkpoints import describe, orbax
from upcycle.models import T5, ViT, scan_layout
from upcycle.moe import MoeConfig, capacity, routers
from upcycle.optimizer_state import counts
from upcycle.optimizer_state import from_t5x_adafactor
from upcycle.optimizer_state.carry import carry_optimizer_state
from upcycle.train import objectives, optimizers
from upcycle.restore import Restore
from upcycle.upcycling import experts, modes, sharded
from upcycle.upcycling.surgery import make_plan, upcycle

# Capacity = group size: every token reaches an expert, and with normalized combine weights
# identical experts compute exactly the dense MLP (docs/upcycling.md, "Function preservation").
ENCODER_MOE = MoeConfig(num_experts=4, router=routers.ExpertsChoose(), eval_capacity_factor=4.0,
                        capacity_convention=capacity.Vmoe(multiple_of=1),
                        normalize_combine_weights=True)
DECODER_MOE = MoeConfig(num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=2.0,
                        capacity_convention=capacity.Vmoe(multiple_of=1),
                        normalize_combine_weights=True)
T5_BATCH = {'encoder_input_tokens': np.zeros((4, 6), np.int32),
            'decoder_input_tokens': np.zeros((4, 4), np.int32),
            'decoder_target_tokens': np.zeros((4, 4), np.int32)}
VIT_BATCH = {'image': np.zeros((4, 8, 8, 3), np.float32), 'label': np.zeros((4,), np.int32)}
ADAFACTOR = optimizers.Adafactor(min_dim_size_to_factor=4)
ADAMW = optimizers.AdamW(optax.linear_schedule(0.0, 1e-3, 10_000))
E_LEAF = 'encoder/layers_1/mlp/expert/wi_0/kernel'


def _run(built, abstract, hook):
  with partitioning.activate(built.mesh):
    return hook(abstract, built.optimizer)


def _assert_placed(state, abstract):
  got = jax.tree.map(lambda x: x.sharding, state)
  want = jax.tree.map(lambda x: x.sharding, abstract)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g == w


def _assert_trees_equal(got, want, rtol_for_experts=0.0):
  flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want)
  for (path, g), w in zip(flat_got, flat_want):
    where = jax.tree_util.keystr(path)
    if rtol_for_experts and "['expert']" in where:
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol_for_experts, atol=1e-6,
                                 err_msg=where)
    else:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=where)


@pytest.fixture(scope='module')
def t5(tmp_path_factory):
  """A dense T5 in the T5X format at step 6 (a leaf of each kind in zarr), and an MoE built."""
  params = helpers.random_params(helpers.CHECKPOINT_T5)
  layout = t5x_writer.Layout(zarr={
      'target/encoder/layers_1/mlp/wi_0/kernel': 'gzip',
      'target/token_embedder/embedding': 'zstd',
      'state/param_states/encoder/layers_1/mlp/wi_0/kernel/v_row': 'gzip'})
  directory = t5x_writer.write(str(tmp_path_factory.mktemp('t5x')), 6, params,
                               helpers.t5x_slots(params), layout)
  config = dataclasses.replace(helpers.CHECKPOINT_T5, encoder_moe=ENCODER_MOE,
                               decoder_moe=DECODER_MOE)
  built, abstract = mesh_run(objectives.Seq2Seq(T5(config)), ADAFACTOR, T5_BATCH)
  return dict(params=params, dir=directory, config=config, built=built, abstract=abstract)


def _unsharded(dense, target, **kwargs):
  """The same surgery jitted on one device, no shardings."""
  return jax.jit(lambda d: upcycle(d, target, rng=jax.random.PRNGKey(kwargs.pop('seed', 0)),
                                   **kwargs)[0])(dense)


@pytest.mark.slow
def test_t5x_upcycled_on_the_mesh_equals_unsharded_surgery(t5, capsys):
  console.show_progress()   # as the entry points do
  before = helpers.snapshot(t5['dir'])
  state = _run(t5['built'], t5['abstract'], Restore(t5['dir'], modes.Upcycle()))
  assert helpers.snapshot(t5['dir']) == before
  _assert_placed(state, t5['abstract'])
  kernel = tree.flatten(state.params)[E_LEAF]
  assert kernel.sharding.spec[0] == 'expert'
  assert {s.data.shape for s in kernel.addressable_shards} == {(2, 8, 6)}  # E/2, d_ff/2
  _assert_trees_equal(state.params, _unsharded(t5['params'], t5['abstract'].params))
  # copy + normalized combine weights: the MoE model computes the dense model.
  np.testing.assert_allclose(helpers.t5_logits(state.params, t5['config']),
                             helpers.t5_logits(t5['params']), rtol=1e-5, atol=1e-5)
  # The dense step continues, and with it the schedule; fresh moments count from 0.
  assert int(state.step) == 6
  factored_state, schedule_state = state.opt_state[0], state.opt_state[2]
  assert int(factored_state.count) == 0 and int(schedule_state.count) == 6
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(factored_state.v_row))
  out = capsys.readouterr().out
  assert f"Restore: {t5['dir']} (t5x, step 6) -> start at step 6, fresh" in out
  assert '6 expert leaves in 2 MoE blocks (experts 4; Copy())' in out


@pytest.mark.slow
def test_drop_experts_and_reused_t5x_adafactor_state(t5):
  hook = Restore(t5['dir'], modes.Upcycle(experts=experts.Drop(0.5)), reuse_optimizer_state=True,
                 seed=3)
  state = _run(t5['built'], t5['abstract'], hook)
  _assert_placed(state, t5['abstract'])
  want = _unsharded(t5['params'], t5['abstract'].params, experts=experts.Drop(0.5), seed=3)
  # Drop's mean/std of the replaced weights are reductions over d_ff, which is split over
  # 'model' on the mesh: partial sums change the rounding of the redrawn entries (only).
  _assert_trees_equal(state.params, want, rtol_for_experts=1e-5)
  dense_wo = t5['params']['encoder']['layers_1']['mlp']['wo']['kernel']
  kept = lambda x: (np.asarray(x) == dense_wo[None]).all(-1)  # [E, d_ff] units left as is
  flat, flat_want = tree.flatten(state.params), tree.flatten(want)
  wo = 'encoder/layers_1/mlp/expert/wo/kernel'
  np.testing.assert_array_equal(kept(flat[wo]), kept(flat_want[wo]))
  assert kept(flat[wo]).mean() == 0.5
  optimizer = t5['built'].optimizer
  t5x_state = checkpoints.materialize(checkpoints.load(t5['dir']).optimizer_state)
  dense_state = from_t5x_adafactor(t5x_state, t5['params'], optimizer)
  _assert_trees_equal(state.opt_state, carry_optimizer_state(
      dense_state, make_plan(t5['params'], want), want, optimizer))
  assert int(state.step) == 6 and int(state.opt_state[0].count) == 6
  v_row = tree.flatten(state.opt_state[0].v_row)[E_LEAF]
  np.testing.assert_array_equal(
      v_row, np.broadcast_to(t5x_state['param_states']['encoder']['layers_1']['mlp']['wi_0'][
          'kernel']['v_row'], (4, 8)))


def test_step_reset_zeroes_every_count_but_keeps_moments(t5):
  hook = Restore(t5['dir'], modes.Upcycle(), reuse_optimizer_state=True, step='reset')
  state = _run(t5['built'], t5['abstract'], hook)
  assert int(state.step) == 0
  assert int(state.opt_state[0].count) == 0 and int(state.opt_state[2].count) == 0
  assert np.asarray(tree.flatten(state.opt_state[0].v_row)[E_LEAF]).min() >= 0.5


@pytest.mark.slow
def test_from_checkpoints_of_identical_branches_equals_copy(t5, tmp_path):
  """Branch-Train-MiX through the hook: host surgery, then placed on the mesh."""
  second = t5x_writer.write(str(tmp_path), 6, t5['params'])
  hook = Restore([t5['dir'], second], modes.Upcycle(experts=functools.partial(
      experts.FromCheckpoints, assignment=(0, 1, 1, 0))))
  state = _run(t5['built'], t5['abstract'], hook)
  _assert_placed(state, t5['abstract'])
  want, _ = upcycle(t5['params'], t5['abstract'].params, rng=0)
  _assert_trees_equal(state.params, want)
  assert int(state.step) == 6
  # upcycle.aot sizes it too: the jit that places the host-made params and makes the fresh
  # optimizer state compiles with the run's shardings, nothing read.
  with partitioning.activate(t5['built'].mesh):
    compiled = hook.lower(t5['abstract'], t5['built'].optimizer).compile()
  for got, leaf in zip(jax.tree.leaves(compiled.output_shardings), jax.tree.leaves(state)):
    assert got.is_equivalent_to(leaf.sharding, leaf.ndim)


def test_hf_t5_upcycled_gives_the_transformers_logits(hf_t5):
  directory, reference = hf_t5
  dense_config = pretrained.load(directory).model_config
  config = dataclasses.replace(dense_config, encoder_moe=ENCODER_MOE, decoder_moe=DECODER_MOE)
  built, abstract = mesh_run(objectives.Seq2Seq(T5(config)), ADAFACTOR, T5_BATCH)
  state = _run(built, abstract, Restore(directory, modes.Upcycle()))
  assert int(state.step) == 0  # HF checkpoints carry no step.
  theirs = helpers.torch_t5_logits(reference, helpers.ENCODER_TOKENS, helpers.DECODER_TOKENS)
  assert np.abs(helpers.t5_logits(state.params, config) - theirs).max() <= 1e-4
  assert np.abs(theirs).max() > 1


@pytest.fixture(scope='module')
def vit(hf_vit, tmp_path_factory):
  """HF ViT; its params with a trained AdamW state in our orbax format at step 7; built runs."""
  directory, reference = hf_vit
  ckpt = pretrained.load(directory)
  dense = checkpoints.materialize(ckpt.params)
  optimizer = ADAMW.build()
  grads = jax.tree.map(lambda x: np.full(x.shape, 0.1, x.dtype), dense)
  _, opt_state = optimizer.update(grads, optimizer.init(dense), dense)
  opt_state = counts.set_counts(opt_state, 7, schedule_only=False)
  orbax_dir = str(tmp_path_factory.mktemp('orbax'))
  with orbax.CheckpointManager(orbax_dir, async_save=False) as manager:
    manager.save(7, dense, opt_state)
  moe_config = dataclasses.replace(ckpt.model_config, moe=ENCODER_MOE)
  moe = mesh_run(objectives.Classification(ViT(moe_config)), ADAMW, VIT_BATCH)
  return dict(hf=directory, reference=reference, dense=dense, opt_state=opt_state,
              orbax=orbax_dir, config=moe_config, dense_config=ckpt.model_config, moe=moe)


@pytest.mark.slow
def test_hf_vit_upcycled_gives_the_transformers_logits_at_a_given_step(vit):
  built, abstract = vit['moe']
  state = _run(built, abstract, Restore(vit['hf'], modes.Upcycle(), step=1000))
  _assert_placed(state, abstract)
  theirs = helpers.torch_vit_logits(vit['reference'], helpers.IMAGES)
  assert np.abs(helpers.vit_logits(state.params, vit['config']) - theirs).max() <= 1e-4
  assert int(state.step) == 1000
  adam, schedule = state.opt_state[1][0], state.opt_state[1][2]
  assert int(adam.count) == 0 and int(schedule.count) == 1000


def test_orbax_adamw_state_is_tiled_into_the_moe_state(vit):
  built, abstract = vit['moe']
  state = _run(built, abstract, Restore(vit['orbax'], modes.Upcycle(), reuse_optimizer_state=True))
  want = _unsharded(vit['dense'], abstract.params)
  _assert_trees_equal(state.params, want)
  _assert_trees_equal(state.opt_state,
                      carry_optimizer_state(vit['opt_state'], make_plan(vit['dense'], want), want,
                                            built.optimizer))
  assert int(state.step) == 7 and int(state.opt_state[1][0].count) == 7


def test_continue_dense_restores_params_and_optimizer_state(vit, capsys):
  console.show_progress()
  built, abstract = mesh_run(objectives.Classification(ViT(vit['dense_config'])), ADAMW,
                                   VIT_BATCH)
  with pytest.raises(ValueError, match=r'no MoE blocks .*modes.Continue'):
    _run(built, abstract, Restore(vit['orbax'], modes.Upcycle()))
  state = _run(built, abstract,
               Restore(vit['orbax'], modes.Continue(), reuse_optimizer_state=True))
  _assert_placed(state, abstract)
  _assert_trees_equal(state.params, vit['dense'])
  _assert_trees_equal(state.opt_state, vit['opt_state'])
  assert int(state.step) == 7
  assert 'Restore: ' in capsys.readouterr().out


def test_mistakes_fail_before_anything_is_read(t5, vit):
  built, abstract = vit['moe']
  with pytest.raises(ValueError, match=r'holds no optimizer state.*'
                     r'Restore.reuse_optimizer_state = False'):
    _run(built, abstract, Restore(vit['hf'], modes.Upcycle(), reuse_optimizer_state=True))
  with pytest.raises(ValueError, match=r'Restore\(.*there is no checkpoint leaf '
                     r'decoder/layers_1/mlp/expert/wi_0/kernel.*Fix: the model must be the '
                     r'architecture the checkpoint was trained with'):
    _run(t5['built'], t5['abstract'],
         Restore(t5['dir'], modes.Continue(), reuse_optimizer_state=True))
  wrong = dataclasses.replace(t5['config'], d_ff=16)
  built, abstract = mesh_run(objectives.Seq2Seq(T5(wrong)), ADAFACTOR, T5_BATCH)
  with pytest.raises(ValueError, match=r"Restore\('.*checkpoint_6', format 't5x'\): "
                     r'Target leaf decoder/layers_0/mlp/wi_0/kernel has shape \(8, 16\) but '
                     r'dense leaf .* \(8, 12\)'):
    _run(built, abstract, Restore(t5['dir'], modes.Upcycle()))
  with pytest.raises(ValueError, match=r"restore.Restore.step='last'"):
    Restore(t5['dir'], modes.Upcycle(), step='last')
  with pytest.raises(ValueError, match=r'A class .* takes several source checkpoints'):
    _run(built, abstract, Restore(t5['dir'], modes.Upcycle(experts=experts.FromCheckpoints)))
  with pytest.raises(ValueError, match=(
      r"^restore.Restore.mode = <class 'upcycle.upcycling.modes.Upcycle'>: expected a mode, "
      r'one of @modes.Continue\(\), @modes.Upcycle\(\), @modes.GrowExperts\(\), '
      r'@modes.GrowDepth\(\) \(gin, with parentheses\).$')):
    Restore(t5['dir'], modes.Upcycle)
  with pytest.raises(ValueError, match=(
      r"^restore.Restore.source lists 2 checkpoints, which only experts made from several "
      r'sources read: modes.Upcycle.experts = @sources.FromCheckpoints or @sources.Merge \(gin\), '
      r"not Continue\(cast=False\).$")):
    _run(built, abstract, Restore([t5['dir'], t5['dir']], modes.Continue()))


def test_restore_dataset_reads_the_position_a_training_step_saved_and_refuses_others(
    t5, tmp_path):
  position = {'shards': {'0': {'seed': 0, 'batch_size': 8, 'epoch': 0, 'batch_in_epoch': 5,
                               'batches': 5}}}
  params = {'encoder': {'w': np.ones((2, 3), np.float32)}}
  with orbax.CheckpointManager(str(tmp_path / 'with'), async_save=False) as manager:
    manager.save(5, params, dataset_state=position)
  with orbax.CheckpointManager(str(tmp_path / 'without'), async_save=False) as manager:
    manager.save(5, params)
  assert Restore(str(tmp_path / 'with' / '5'), modes.Continue(),
                 restore_dataset=True).dataset_state() == position
  assert Restore(str(tmp_path / 'with'), modes.Upcycle(),
                 restore_dataset=True).dataset_state() == position
  assert Restore(str(tmp_path / 'with' / '5'), modes.Continue()).dataset_state() is None
  with pytest.raises(ValueError, match=r"restore.Restore.restore_dataset=True: .*without/5 "
                     r"\(orbax\) holds no data position; only the steps of a `python -m "
                     r"upcycle.train` run do. Fix: restore.Restore.restore_dataset = False"):
    Restore(str(tmp_path / 'without'), modes.Continue(), restore_dataset=True).dataset_state()
  with pytest.raises(ValueError, match=r"restore.Restore.restore_dataset=True: .*checkpoint_6 "
                     r"\(t5x\) holds no data position"):
    Restore(t5['dir'], modes.Upcycle(), restore_dataset=True).dataset_state()
  # One flipped bit of the position (5 -> 4) is refused, naming how to read it anyway; a
  # position that is not JSON, naming the other way on.
  metadata = tmp_path / 'with' / '5' / 'dataset' / 'metadata'
  saved = metadata.read_text()
  metadata.write_text(saved.replace('"batches": 5', '"batches": 4'))
  with pytest.raises(checkpoints.CheckpointError, match=(
      r"^[^\n]*/with/5/dataset: the data position differs from the digest recorded when the "
      r"step was saved \(crc32 [0-9a-f]{8}, saved [0-9a-f]{8}\); the data changed on disk. Fix: "
      r"copy the checkpoint again from its source, or pass "
      r"--gin.restore.Restore.verify=False to read it as it is.$")):
    Restore(str(tmp_path / 'with' / '5'), modes.Continue(), restore_dataset=True).dataset_state()
  assert Restore(str(tmp_path / 'with' / '5'), modes.Continue(), restore_dataset=True,
                 verify=False).dataset_state()['shards']['0']['batches'] == 4
  metadata.write_text(saved[:-3])
  with pytest.raises(checkpoints.CheckpointError, match=(
      r"^[^\n]*/with/5/dataset: the data position is unreadable \(.*\); the data changed on "
      r"disk. Fix: copy the checkpoint again from its source, or read the data from its "
      r"beginning: restore.Restore.restore_dataset = False.$")):
    Restore(str(tmp_path / 'with' / '5'), modes.Continue(), restore_dataset=True).dataset_state()


def test_dense_leaves_are_placed_by_the_sharding_they_feed(t5):
  mesh = t5['built'].mesh
  expert = jax.sharding.NamedSharding(mesh, jax.P('expert', None, 'model'))
  assert sharded.fit(expert, (8, 12), drop_leading=True).spec == jax.P(None, 'model')
  assert sharded.fit(expert, (8, 7), drop_leading=True).spec == jax.P(None, None)  # 7 % 2
  reads = []
  data = np.arange(96, dtype=np.float32).reshape(8, 12)

  def read_block(index):
    reads.append(index)
    return data[index]

  leaf = checkpoints.LazyArray(data.shape, data.dtype, lambda: data, 'test', 'w', read_block)
  array = sharded.read(leaf, sharded.fit(expert, data.shape, drop_leading=True))
  np.testing.assert_array_equal(np.asarray(array), data)
  assert len(reads) == 2  # One per 'model' block, shared by the 4 replicas of each.


@pytest.mark.slow
def test_unrolled_checkpoint_upcycled_into_a_scanned_model(tmp_path):
  """T5X checkpoints hold unrolled layers; a scanned MoE (the pod configs scan) is planned
  against its unrolled names and stacked inside the jit: the scanned state is the unrolled
  one stacked (`scan_layout`), placed with the scanned model's shardings, and the two models
  compute the same logits."""
  dense = dataclasses.replace(helpers.CHECKPOINT_T5, num_encoder_layers=4, num_decoder_layers=4)
  directory = t5x_writer.write(str(tmp_path), 6, helpers.random_params(dense))
  unrolled = dataclasses.replace(dense, encoder_moe=ENCODER_MOE, decoder_moe=DECODER_MOE)
  scanned = dataclasses.replace(unrolled, scan_layers=True)
  hook = Restore(directory, modes.Upcycle(), seed=3)
  states = {}
  for config in (unrolled, scanned):
    built, abstract = mesh_run(objectives.Seq2Seq(T5(config)), ADAFACTOR, T5_BATCH)
    with partitioning.activate(built.mesh):
      states[config.scan_layers] = hook(abstract, built.optimizer, config)
    _assert_placed(states[config.scan_layers], abstract)
  _assert_trees_equal(states[True].params,
                      scan_layout.stack(jax.device_get(states[False].params), scanned))
  tokens = np.arange(24, dtype=np.int32).reshape(4, 6) % 7 + 1
  logits = lambda config: jax.jit(T5(config).apply)(
      {'params': states[config.scan_layers].params}, tokens, tokens[:, :4])
  np.testing.assert_allclose(logits(scanned), logits(unrolled), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='reuse_optimizer_state = False, or --gin.SCAN_LAYERS'):
    with partitioning.activate(built.mesh):
      Restore(directory, modes.Upcycle(), reuse_optimizer_state=True)(abstract, built.optimizer,
                                                              scanned)


@pytest.mark.slow
def test_a_scanned_dense_run_upcycles_into_scanned_and_unrolled_moes(tmp_path):
  """The first step of a pod user: a dense run trained with SCAN_LAYERS = True (one sub-block
  per period) upcycled into an MoE every other layer (two sub-blocks), scanned or not. Both
  MoEs (copied experts, capacity = group, normalized combine weights) compute the scanned
  dense model's logits, and their experts are the dense run's MLPs layer for layer."""
  dense = dataclasses.replace(helpers.CHECKPOINT_T5, num_encoder_layers=4, num_decoder_layers=4,
                              scan_layers=True)
  params = helpers.random_params(dense)   # as a scanned dense run holds them
  assert 'layers' in params['encoder'] and 'subblock_1' not in params['encoder']['layers']
  with orbax.CheckpointManager(str(tmp_path), async_save=False) as manager:
    manager.save(6, params, ADAFACTOR.build().init(params))
  tokens = np.arange(24, dtype=np.int32).reshape(4, 6) % 7 + 1
  logits = lambda config, p: jax.jit(T5(config).apply)({'params': p}, tokens, tokens[:, :4])
  want = logits(dense, params)
  unrolled_dense = scan_layout.unstack(params, dense)
  moe = dataclasses.replace(dense, encoder_moe=ENCODER_MOE, decoder_moe=DECODER_MOE)
  for scanned in (True, False):
    config = dataclasses.replace(moe, scan_layers=scanned)
    built, abstract = mesh_run(objectives.Seq2Seq(T5(config)), ADAFACTOR, T5_BATCH)
    with partitioning.activate(built.mesh):
      state = Restore(str(tmp_path), modes.Upcycle())(abstract, built.optimizer, config)
      with pytest.raises(ValueError, match=(
          r"Restore\('.*6'\): the checkpoint holds scanned layers of another "
          r"structure than this model's \(a run trained with SCAN_LAYERS = True\) and the "
          r'model is (scanned|unrolled) .* Fix: Restore.reuse_optimizer_state = False\.$')):
        Restore(str(tmp_path), modes.Upcycle(), reuse_optimizer_state=True)(
            abstract, built.optimizer, config)
    _assert_placed(state, abstract)
    assert int(state.step) == 6
    np.testing.assert_allclose(logits(config, state.params), want, rtol=1e-5, atol=1e-5)
    flat = tree.flatten(scan_layout.unstack(jax.device_get(state.params), config)
                        if scanned else jax.device_get(state.params))
    for i in (1, 3):
      np.testing.assert_array_equal(
          flat[f'decoder/layers_{i}/mlp/expert/wo/kernel'],
          np.broadcast_to(unrolled_dense['decoder'][f'layers_{i}']['mlp']['wo']['kernel'],
                          (4, 12, 8)))


def test_a_source_of_the_wrong_kind_says_what_it_holds(t5, tmp_path):
  """An already-upcycled MoE or a ViT handed to `runs/upcycle.gin` for a T5 MoE: the error
  says what the checkpoint holds and what the config builds, before anything is read."""
  moe_dir = t5x_writer.write(str(tmp_path / 'moe'), 6, helpers.random_params(t5['config']))
  with pytest.raises(ValueError) as raised:
    _run(t5['built'], t5['abstract'], Restore(moe_dir, modes.Upcycle()))
  moe = describe.summary(helpers.random_params(t5['config']))
  assert moe.startswith('a T5 model, ') and moe.endswith(
      ' parameters, an MoE with 4 experts in 2 blocks')
  assert str(raised.value) == (
      f"Restore('{moe_dir}', format 't5x'): the checkpoint holds {moe}; this config "
      f"builds {moe}: already an MoE: upcycling starts from a dense checkpoint. Fix: point "
      f"restore.Restore.source (INITIAL_CHECKPOINT_PATH) at the dense checkpoint, or continue "
      f"this MoE with restore.Restore.mode = @modes.Continue() (runs/continue_dense.gin with "
      f"the MoE model files).")
  vit_dir = t5x_writer.write(str(tmp_path / 'vit'), 6,
                             helpers.random_params(helpers.CHECKPOINT_VIT))
  with pytest.raises(ValueError, match=r"the checkpoint holds a ViT model, .* dense \(no expert "
                                       r"leaves\); this config builds a T5 model, .*: another "
                                       r"model family\."):
    _run(t5['built'], t5['abstract'], Restore(vit_dir, modes.Upcycle()))
