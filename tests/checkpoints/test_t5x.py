"""T5X checkpoints: T5X's own fixture, and checkpoints written independently of the reader."""

import os
import shutil

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.checkpoints import helpers, t5x_writer
from upcycle import checkpoints, tree
from upcycle.checkpoints import CheckpointError, lazy, t5x, zarr_leaf


def test_fixture_written_by_t5x():
  ckpt = t5x.load(helpers.T5X_FIXTURE)
  assert ckpt.format == 't5x' and ckpt.step == 1 and ckpt.params == {}
  states = ckpt.optimizer_state['param_states']
  bias, kernel = np.asarray(states['bias']), np.asarray(states['kernel'])
  np.testing.assert_array_equal(bias, np.ones(5, np.float32))
  assert bias.dtype == np.float32 and kernel.shape == (10, 5) and kernel.dtype == np.float64
  assert np.all((kernel >= 0) & (kernel < 1)) and len(np.unique(kernel)) == 50
  step = np.asarray(states['step'])
  assert step.dtype == np.int32 and step == 1
  assert int(ckpt.optimizer_state['step']) == 1


def test_fixture_from_model_dir_and_checkpoint_file():
  model_dir = os.path.dirname(helpers.T5X_FIXTURE)
  assert t5x.load(model_dir).path == helpers.T5X_FIXTURE
  assert t5x.load(os.path.join(helpers.T5X_FIXTURE, 'checkpoint')).step == 1


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  """A T5X checkpoint with bf16, gzip, zstd, gfile, chunked and Adafactor leaves."""
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=3)
  flat = tree.flatten(params)
  bf16 = ('token_embedder/embedding', 'encoder/layers_1/mlp/wo/kernel',
          'decoder/layers_0/self_attention/query/kernel')
  for path in bf16:
    flat[path] = flat[path].astype(ml_dtypes.bfloat16)
  params = tree.unflatten(flat)
  layout = t5x_writer.Layout(
      zarr={'target/token_embedder/embedding': 'gzip',
            'target/encoder/layers_0/mlp/wi_0/kernel': 'zstd',
            'target/encoder/layers_1/mlp/wo/kernel': 'zstd',
            'target/decoder/relpos_bias/rel_embedding': 'gzip',
            'state/param_states/decoder/logits_dense/kernel/v_row': 'gzip'},
      driver='gfile',
      chunked={'target/decoder/logits_dense/kernel': 50,
               'target/encoder/layers_0/attention/out/kernel': 7})
  states = t5x_writer.adafactor_states(params)
  model_dir = str(tmp_path_factory.mktemp('t5x'))
  t5x_writer.write(model_dir, 10, params, states, layout)
  return model_dir, params, states


def test_written_checkpoint_loads_to_same_logits(written):
  model_dir, params, _ = written
  ckpt = t5x.load(model_dir)
  assert ckpt.format == 't5x' and ckpt.step == 10
  loaded = lazy.materialize(ckpt.params)
  for path, value in tree.flatten(params).items():
    got = tree.flatten(loaded)[path]
    assert got.dtype == value.dtype and got.shape == value.shape, path
    np.testing.assert_array_equal(got, value, err_msg=path)
  np.testing.assert_array_equal(helpers.t5_logits(loaded), helpers.t5_logits(params))


def test_load_returns_params_the_model_takes_as_they_are(written):
  model_dir, params, _ = written
  loaded = checkpoints.load(model_dir).params
  np.testing.assert_allclose(helpers.apply_as_documented(loaded, helpers.CHECKPOINT_T5),
                             helpers.t5_logits(params), rtol=1e-5, atol=1e-5)


def test_leaves_are_lazy_and_typed(written):
  ckpt = t5x.load(written[0])
  embedding = ckpt.params['token_embedder']['embedding']
  assert isinstance(embedding, lazy.LazyArray)
  assert embedding.shape == (32, 8) and embedding.dtype == ml_dtypes.bfloat16


def test_adafactor_state_as_stored(written):
  _, _, states = written
  ckpt = t5x.load(written[0])
  got = tree.flatten(lazy.materialize(ckpt.optimizer_state['param_states']))
  want = tree.flatten(states)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=path)
  assert 'v_row' in ckpt.optimizer_state['param_states']['decoder']['logits_dense']['kernel']


def test_missing_zarray_uses_spec_metadata(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=4)
  layout = t5x_writer.Layout(zarr={'target/encoder/layers_0/mlp/wi_1/kernel': 'zstd'},
                             drop_zarray=True)
  t5x_writer.write(str(tmp_path), 1, params, layout=layout)
  assert not any('.zarray' in files for _, _, files in os.walk(tmp_path))
  got = t5x.load(str(tmp_path)).params['encoder']['layers_0']['mlp']['wi_1']['kernel']
  np.testing.assert_array_equal(np.asarray(got), params['encoder']['layers_0']['mlp']['wi_1']
                                ['kernel'])


def test_latest_checkpoint_of_model_dir(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_T5)
  for step in (2, 12):
    t5x_writer.write(str(tmp_path), step, params)
  os.makedirs(tmp_path / 'checkpoint_30.tmp-1700000000')  # Unfinished save: ignored.
  assert t5x.load(str(tmp_path)).step == 12


def test_orbax_era_layout(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=5)
  state = {'target': params, 'state': {'step': np.int32(7), 'param_states':
                                        t5x_writer.adafactor_states(params)}}
  ocp.PyTreeCheckpointer().save(tmp_path / 'checkpoint_7' / 'state', state)
  before = helpers.snapshot(str(tmp_path))
  ckpt = t5x.load(str(tmp_path))
  assert ckpt.format == 't5x_orbax' and ckpt.step == 7
  loaded = lazy.materialize(ckpt.params)
  np.testing.assert_array_equal(helpers.t5_logits(loaded), helpers.t5_logits(params))
  np.testing.assert_array_equal(
      np.asarray(ckpt.optimizer_state['param_states']['encoder']['encoder_norm']['scale']['v']),
      state['state']['param_states']['encoder']['encoder_norm']['scale']['v'])
  assert helpers.snapshot(str(tmp_path)) == before


def test_truncated_msgpack_is_named(tmp_path):
  shutil.copytree(helpers.T5X_FIXTURE, tmp_path / 'checkpoint_1')
  path = tmp_path / 'checkpoint_1' / 'checkpoint'
  os.chmod(path, 0o644)
  path.write_bytes(path.read_bytes()[:200])
  before = helpers.snapshot(str(tmp_path))
  with pytest.raises(CheckpointError, match=r'checkpoint_1/checkpoint: not a readable msgpack.*'
                     r'truncated'):
    t5x.load(str(tmp_path))
  assert helpers.snapshot(str(tmp_path)) == before


def test_missing_zarr_chunk_is_named(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_T5)
  layout = t5x_writer.Layout(zarr={'target/token_embedder/embedding': 'gzip'})
  directory = t5x_writer.write(str(tmp_path), 1, params, layout=layout)
  os.remove(os.path.join(directory, 'target.token_embedder.embedding', '1.0'))
  before = helpers.snapshot(str(tmp_path))
  leaf = t5x.load(directory).params['token_embedder']['embedding']
  with pytest.raises(CheckpointError) as e:
    np.asarray(leaf)
  message = str(e.value)
  assert "parameter 'token_embedder/embedding'" in message
  assert 'missing' in message and 'target.token_embedder.embedding' in message
  assert 'Expected (32, 8) float32' in message
  assert helpers.snapshot(str(tmp_path)) == before


def test_not_a_checkpoint_lists_what_was_looked_for(tmp_path):
  (tmp_path / 'notes.txt').write_text('hi')
  with pytest.raises(CheckpointError, match=r"not a T5X checkpoint.*'checkpoint'.*notes.txt"):
    t5x.load(str(tmp_path))


def test_gcs_paths_map_to_the_gcs_driver():
  assert zarr_leaf.kvstore_for('gs://bucket/runs/base/checkpoint_5', 'target.x/') == {
      'driver': 'gcs', 'bucket': 'bucket', 'path': 'runs/base/checkpoint_5/target.x/'}
  assert zarr_leaf.kvstore_for('/ckpt/checkpoint_5', 'target.x') == {
      'driver': 'file', 'path': '/ckpt/checkpoint_5/target.x/'}
  spec = {'driver': 'zarr', 'dtype': 'bfloat16', 'path': 'target.x',
          'kvstore': {'driver': 'gcs', 'bucket': 't5x-dummy-bucket'},
          'metadata': {'shape': [4, 2], 'chunks': [4, 2], 'compressor': {'id': 'gzip'}}}
  leaf = zarr_leaf.from_t5x_spec(spec, 'gs://real/ckpt', 'x', 'gs://real/ckpt/checkpoint')
  assert leaf.shape == (4, 2) and leaf.dtype == ml_dtypes.bfloat16


def test_block_reads_build_a_sharded_array(written):
  """Each device reads only its block of a zarr leaf: streaming restore, no full host copy."""
  leaf = t5x.load(written[0]).params['encoder']['layers_0']['mlp']['wi_0']['kernel']
  want = written[1]['encoder']['layers_0']['mlp']['wi_0']['kernel']
  np.testing.assert_array_equal(leaf.read((slice(2, 6), slice(0, 3))), want[2:6, :3])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('model',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'model'))
  array = jax.make_array_from_callback(leaf.shape, sharding, leaf.read)
  assert [s.data.shape for s in array.addressable_shards] == [(8, 6), (8, 6)]
  np.testing.assert_array_equal(np.asarray(array), want)
