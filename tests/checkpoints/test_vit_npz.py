"""vit_jax and big_vision .npz files load to the ViT that wrote them, adapted only when asked."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from tests.checkpoints import helpers
from upcycle import tree
from upcycle.checkpoints import CheckpointError, lazy, vit_adapt, vit_npz

_VIT_JAX_BLOCK = {'MultiHeadDotProductAttention_0': 'MultiHeadDotProductAttention_1',
                  'LayerNorm_1': 'LayerNorm_2', 'MlpBlock_0': 'MlpBlock_3'}


def _exact_params(seed=0):
  """Random ViT params on a 1/256 grid, so cls + pos slot sums are exact in float32."""
  params = helpers.random_params(helpers.CHECKPOINT_VIT, seed=seed)
  return tree.unflatten({p: np.round(v * 256) / 256 for p, v in tree.flatten(params).items()})


def _vit_jax_arrays(params, slot, prefix=''):
  """Our params -> vit_jax names, with a position-embedding cls slot `slot` [1, 1, D]."""
  out = {}
  for path, value in tree.flatten(params).items():
    parts = path.split('/')
    if len(parts) > 2 and parts[0] == 'Transformer' and parts[2] in _VIT_JAX_BLOCK:
      parts[2] = _VIT_JAX_BLOCK[parts[2]]
    out['/'.join(parts)] = value
  out['cls'] = params['cls'] - slot
  out['Transformer/posembed_input/pos_embedding'] = np.concatenate(
      [slot, out.pop('pos_embedding')], axis=1)
  return {prefix + k: v for k, v in out.items()}


def test_vit_jax_npz_same_logits(tmp_path):
  params = _exact_params()
  slot = np.round(np.random.default_rng(1).normal(size=(1, 1, 8)) * 256) / 256
  path = str(tmp_path / 'vit_jax.npz')
  np.savez(path, **_vit_jax_arrays(params, slot.astype(np.float32)))
  ckpt = vit_npz.load(path)
  assert ckpt.format == 'vit_jax' and ckpt.notes == ()
  np.testing.assert_allclose(helpers.apply_as_documented(ckpt.params, helpers.CHECKPOINT_VIT),
                             helpers.vit_logits(params), rtol=1e-5, atol=1e-5)
  assert isinstance(vit_npz.load(path, lazy=True).params['cls'], lazy.LazyArray)
  loaded = lazy.materialize(ckpt.params)
  np.testing.assert_array_equal(loaded['cls'], params['cls'])
  np.testing.assert_array_equal(loaded['pos_embedding'], params['pos_embedding'])
  np.testing.assert_array_equal(helpers.vit_logits(loaded), helpers.vit_logits(params))


def test_vit_jax_opt_target_prefix_and_bfloat16(tmp_path):
  params = _exact_params(seed=2)
  arrays = _vit_jax_arrays(params, np.zeros((1, 1, 8), np.float32), prefix='opt/target/')
  key = 'opt/target/Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel'
  arrays[key] = arrays[key].astype(ml_dtypes.bfloat16)
  path = str(tmp_path / 'vit_jax_opt.npz')
  np.savez(path, **arrays)
  assert np.load(path)[key].dtype == np.dtype('V2')  # How numpy stores bfloat16.
  ckpt = vit_npz.load(path)
  kernel = ckpt.params['Transformer']['encoderblock_1']['MlpBlock_0']['Dense_0']['kernel']
  assert kernel.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(np.asarray(kernel), arrays[key])
  np.testing.assert_array_equal(helpers.vit_logits(ckpt.params),
                                helpers.vit_logits(lazy.materialize(ckpt.params)))


def test_big_vision_npz_same_logits(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_VIT, seed=3)
  path = str(tmp_path / 'big_vision.npz')
  np.savez(path, **{'params/' + k: v for k, v in tree.flatten(params).items()})
  ckpt = vit_npz.load(path)
  assert ckpt.format == 'big_vision'
  np.testing.assert_allclose(helpers.apply_as_documented(ckpt.params, helpers.CHECKPOINT_VIT),
                             helpers.vit_logits(params), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(helpers.vit_logits(ckpt.params), helpers.vit_logits(params))


def test_big_vision_scanned_encoder_is_unstacked(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_VIT, seed=4)
  flat = tree.flatten(params)
  arrays = {k: v for k, v in flat.items() if not k.startswith('Transformer/encoderblock_')}
  for key in [k for k in flat if k.startswith('Transformer/encoderblock_0/')]:
    rest = key[len('Transformer/encoderblock_0/'):]
    arrays[f'Transformer/encoderblock/{rest}'] = np.stack(
        [flat[f'Transformer/encoderblock_{i}/{rest}'] for i in range(2)])
  path = str(tmp_path / 'scanned.npz')
  np.savez(path, **arrays)
  np.testing.assert_array_equal(helpers.vit_logits(vit_npz.load(path).params),
                                helpers.vit_logits(params))


def test_resize_position_embedding_only_when_asked(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_VIT, seed=5)
  params['pos_embedding'] = np.full((1, 4, 8), 0.25, np.float32)
  path = str(tmp_path / 'bv.npz')
  np.savez(path, **tree.flatten(params))
  same = vit_npz.load(path, grid=(2, 2))
  assert same.notes == () and same.params['pos_embedding'].shape == (1, 4, 8)
  ckpt = vit_npz.load(path, grid=(4, 4))
  pos = np.asarray(ckpt.params['pos_embedding'])
  assert pos.shape == (1, 16, 8) and np.allclose(pos, 0.25)
  np.testing.assert_array_equal(np.asarray(ckpt.params['cls']), params['cls'])
  assert len(ckpt.notes) == 1 and '2x2 to a 4x4 grid' in ckpt.notes[0]
  config = dataclasses.replace(helpers.CHECKPOINT_VIT, image_size=(16, 16))
  images = np.zeros((1, 16, 16, 3), np.float32)
  assert helpers.vit_logits(ckpt.params, config, images).shape == (1, 5)


def test_resize_interpolates_bilinearly():
  ramp = np.arange(4, dtype=np.float32).reshape(1, 4, 1)  # 2x2 grid [[0, 1], [2, 3]].
  out = vit_adapt.resize_pos_embedding(ramp, (3, 3), (2, 2)).reshape(3, 3)
  np.testing.assert_allclose(out, [[0, 0.5, 1], [1, 1.5, 2], [2, 2.5, 3]], atol=1e-6)


def test_head_for_other_classes(tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_VIT, seed=6)
  path = str(tmp_path / 'bv.npz')
  np.savez(path, **tree.flatten(params))
  with pytest.raises(CheckpointError, match=r"parameter 'head/kernel'.*Expected 7 classes, found "
                     r"5 classes.*head='drop'"):
    vit_npz.load(path, num_classes=7)
  dropped = vit_npz.load(path, num_classes=7, head='drop')
  assert 'head' not in dropped.params and 'head dropped' in dropped.notes[0]
  reinit = vit_npz.load(path, num_classes=7, head='reinit')
  np.testing.assert_array_equal(reinit.params['head']['kernel'], np.zeros((8, 7), np.float32))
  assert 're-initialized' in reinit.notes[0]
  assert vit_npz.load(path, num_classes=5, head='drop').notes == ()


def test_unknown_npz(tmp_path):
  path = str(tmp_path / 'other.npz')
  np.savez(path, weights=np.zeros(3))
  before = helpers.snapshot(str(tmp_path))
  with pytest.raises(CheckpointError, match=r"other.npz: not a ViT checkpoint.*'weights'"):
    vit_npz.load(path)
  assert helpers.snapshot(str(tmp_path)) == before
