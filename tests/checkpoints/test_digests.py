"""The CRC-32 per array shard (and of the data position) a step records at save, and the checks
on what is read back."""

import json
import zlib

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from upcycle.checkpoints import CheckpointError, digests, orbax, orbax_tree, verify

KERNEL = 'encoder/layers_0/mlp/wi_0/kernel'


def _state():
  """(params, optimizer state): a kernel split 4 ways over a 4 x 2 mesh (each block held
  twice), a replicated bfloat16 embedding, a host count."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('data', 'model'))
  rng = np.random.default_rng(0)
  kernel = jax.device_put(rng.normal(size=(8, 6)).astype(np.float32),
                          NamedSharding(mesh, PartitionSpec('data', None)))
  embedding = jax.device_put(rng.normal(size=(5, 4)).astype(ml_dtypes.bfloat16),
                             NamedSharding(mesh, PartitionSpec()))
  params = {'encoder': {'layers_0': {'mlp': {'wi_0': {'kernel': kernel}}}},
            'token_embedder': {'embedding': embedding}}
  return params, {'count': np.int32(7)}


def test_each_shard_is_recorded_once_with_the_crc_of_its_bytes():
  params, opt = _state()
  record = digests.record({'params': params, 'optimizer_state': opt})
  assert record['format'] == 1 and record['process_count'] == 1
  kernel = np.asarray(params['encoder']['layers_0']['mlp']['wi_0']['kernel'])
  assert record['items']['params'][KERNEL] == {'dtype': 'float32', 'shards': {
      f'{i}:{i + 2},0:6': zlib.crc32(kernel[i:i + 2].tobytes()) for i in (0, 2, 4, 6)}}
  embedding = record['items']['params']['token_embedder/embedding']
  assert embedding['dtype'] == 'bfloat16' and list(embedding['shards']) == ['0:5,0:4']
  assert record['items']['optimizer_state'] == {
      'count': {'dtype': 'int32', 'shards': {'': zlib.crc32(np.int32(7).tobytes())}}}


def test_a_saved_step_checks_back_and_a_changed_value_is_named(tmp_path):
  params, opt = _state()
  with orbax.CheckpointManager(str(tmp_path), async_save=False) as manager:
    manager.save(3, params, opt)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            params)
    restored = manager.restore(3, params=abstract)
  step_dir = str(tmp_path / '3')
  assert orbax.saved_items(step_dir) == ['digests', 'optimizer_state', 'params']
  recorded = digests.read(step_dir)
  assert recorded['params'][KERNEL]['shards'].keys() == {'0:2,0:6', '2:4,0:6', '4:6,0:6',
                                                          '6:8,0:6'}
  assert digests.check_tree(recorded['params'], restored.params, 'src') is None
  assert digests.check_tree(recorded['optimizer_state'], restored.optimizer_state, 'src') is None
  changed = np.asarray(restored.params['encoder']['layers_0']['mlp']['wi_0']['kernel']).copy()
  changed[5, 1] += 1
  assert digests.check_array(recorded['params'][KERNEL], changed, 'src', KERNEL).startswith(
      f"src: parameter '{KERNEL}' (shard 4:6,0:6): its bytes differ from the digest recorded "
      f'when the step was saved (crc32 ')
  # Read as another dtype (a cast on restore), the bytes cannot be compared: not damage.
  assert digests.check_array(recorded['params'][KERNEL], changed.astype(np.float64), 'src',
                             KERNEL) is None


def test_a_step_without_digests_reads_as_none(tmp_path):
  assert digests.read(str(tmp_path)) is None


def test_the_data_position_is_recorded_by_process_0_and_a_changed_one_is_named(tmp_path):
  """Its digest is the CRC-32 of its canonical JSON (json.dumps, sorted keys, no spaces)."""
  params, opt = _state()
  position = {'shards': {'0': {'epoch': 0, 'batch_in_epoch': 20, 'batches': 20}}}
  with orbax.CheckpointManager(str(tmp_path), async_save=False) as manager:
    manager.save(3, params, opt, dataset_state=position)
  step_dir = str(tmp_path / '3')
  recorded = digests.read(step_dir)
  canonical = '{"shards":{"0":{"batch_in_epoch":20,"batches":20,"epoch":0}}}'
  assert recorded['dataset'] == {
      'metadata': {'dtype': 'json', 'shards': {'': zlib.crc32(canonical.encode())}}}
  assert verify.dataset_damage(step_dir, recorded) is None
  metadata = tmp_path / '3' / 'dataset' / 'metadata'
  metadata.write_text(metadata.read_text().replace('"batch_in_epoch": 20', '"batch_in_epoch": 21'))
  assert verify.dataset_damage(step_dir, recorded).startswith(
      f'{step_dir}/dataset: the data position differs from the digest recorded when the step was '
      f'saved (crc32 ')


def test_a_damaged_tree_metadata_is_named_as_damaged_not_missing(tmp_path):
  ocp.PyTreeCheckpointer().save(tmp_path / 'item', {'a': np.ones((3, 4), np.float32)})
  metadata = tmp_path / 'item' / '_METADATA'
  metadata.write_bytes(metadata.read_bytes()[:40])
  with pytest.raises(json.JSONDecodeError) as cause:
    json.loads(metadata.read_text())
  with pytest.raises(CheckpointError) as raised:
    orbax_tree.read(str(tmp_path / 'item'))
  assert str(raised.value) == (
      f'{metadata}: the tree metadata is unreadable (JSONDecodeError: {cause.value}). The '
      f'checkpoint copy is corrupt; copy it again from its source.')
