"""HuggingFace checkpoints give the logits of the PyTorch reference models."""

import copy
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.checkpoints import helpers
from upcycle import checkpoints, pretrained, tree
from upcycle.checkpoints import CheckpointError, lazy
from upcycle.models import T5Config, ViTConfig


def _copy(directory, tmp_path, name='copy'):
  target = tmp_path / name
  shutil.copytree(directory, target)
  return str(target)


def _edit_config(directory, **fields):
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(fields)
  with open(path, 'w') as f:
    json.dump(config, f)


@pytest.mark.slow
def test_t5_matches_transformers(hf_t5):
  directory, reference = hf_t5
  params, config = pretrained.load_hf(directory)
  assert isinstance(config, T5Config)
  assert (config.d_model, config.d_ff, config.num_heads, config.d_kv) == (8, 12, 2, 4)
  assert not config.logits_via_embedding and 'logits_dense' in params['decoder']
  ours = helpers.t5_logits(lazy.materialize(params), config)
  theirs = helpers.torch_t5_logits(reference, helpers.ENCODER_TOKENS, helpers.DECODER_TOKENS)
  assert ours.shape == theirs.shape == (2, 4, 32)
  assert np.abs(ours - theirs).max() <= 1e-4
  assert np.abs(theirs).max() > 1  # The comparison is not between near-zero numbers.


@pytest.mark.slow
@pytest.mark.parametrize('fixture', ['hf_t5', 'hf_vit'])
def test_documented_loaders_feed_the_model_as_returned(fixture, request):
  """`pretrained.load_hf`, `pretrained.load(...).params` and `checkpoints.load(...).params`
  return numpy leaves that go straight into `T5.apply` / `ViT.apply`; `lazy=True` returns
  LazyArrays for streaming."""
  directory, reference = request.getfixturevalue(fixture)
  params, config = pretrained.load_hf(directory)
  assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params))
  if fixture == 'hf_t5':
    theirs = helpers.torch_t5_logits(reference, helpers.ENCODER_TOKENS, helpers.DECODER_TOKENS)
  else:
    theirs = helpers.torch_vit_logits(reference, helpers.IMAGES)
  for loaded in (params, pretrained.load(directory).params, checkpoints.load(directory).params):
    assert np.abs(helpers.apply_as_documented(loaded, config) - theirs).max() <= 1e-4
  lazy_params, _ = pretrained.load_hf(directory, lazy=True)
  assert all(isinstance(leaf, lazy.LazyArray) for leaf in jax.tree.leaves(lazy_params))


def test_t5_untied_head_and_relpos_layout(hf_t5):
  directory, reference = hf_t5
  params, _ = pretrained.load_hf(directory)
  np.testing.assert_array_equal(np.asarray(params['decoder']['logits_dense']['kernel']),
                                reference.lm_head.weight.detach().numpy().T)
  bias = reference.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
  np.testing.assert_array_equal(np.asarray(params['encoder']['relpos_bias']['rel_embedding']),
                                bias.detach().numpy().T)


def test_t5_without_lm_head_ties_to_shared(hf_t5, tmp_path):
  """A transformers-5 save (no lm_head, no rescale): the head is shared.weight transposed."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = _copy(hf_t5[0], tmp_path)
  weights = os.path.join(directory, 'model.safetensors')
  tensors = load_file(weights)
  del tensors['lm_head.weight']
  save_file(tensors, weights)
  _edit_config(directory, tie_word_embeddings=True, scale_decoder_outputs=False)
  ckpt = pretrained.load(directory)
  np.testing.assert_array_equal(np.asarray(ckpt.params['decoder']['logits_dense']['kernel']),
                                tensors['shared.weight'].T)
  assert any('shared.weight transposed' in note for note in ckpt.notes)


def test_t5_rescaled_tied_head_uses_embedding(hf_t5, tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = _copy(hf_t5[0], tmp_path)
  weights = os.path.join(directory, 'model.safetensors')
  tensors = load_file(weights)
  del tensors['lm_head.weight']
  save_file(tensors, weights)
  _edit_config(directory, tie_word_embeddings=True)
  params, config = pretrained.load_hf(directory)
  assert config.logits_via_embedding and 'logits_dense' not in params['decoder']


def test_vit_matches_transformers(hf_vit):
  directory, reference = hf_vit
  params, config = pretrained.load_hf(directory)
  assert isinstance(config, ViTConfig)
  assert config.pool_type == 'token' and not config.approximate_gelu
  assert config.layer_norm_epsilon == 1e-12 and config.num_classes == 5
  params = lazy.materialize(params)
  assert params['pos_embedding'].shape == (1, 4, 8) and params['cls'].shape == (1, 1, 8)
  assert params['embedding']['kernel'].shape == (4, 4, 3, 8)
  assert params['Transformer']['encoderblock_0']['MultiHeadDotProductAttention_0']['out'][
      'kernel'].shape == (2, 4, 8)
  ours = helpers.vit_logits(params, config)
  theirs = helpers.torch_vit_logits(reference, helpers.IMAGES)
  assert np.abs(ours - theirs).max() <= 1e-4
  assert np.abs(theirs).max() > 0.1


def test_bfloat16_safetensors(hf_vit, tmp_path):
  _, reference = hf_vit
  import torch  # pylint: disable=g-import-not-at-top
  bf16_dir = str(tmp_path / 'bf16')
  copy.deepcopy(reference).to(dtype=torch.bfloat16).save_pretrained(bf16_dir)
  params, _ = pretrained.load_hf(bf16_dir)
  kernel = params['head']['kernel']
  assert kernel.dtype == ml_dtypes.bfloat16
  expected = reference.classifier.weight.detach().numpy().T.astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(kernel), expected)


def test_sharded_and_torch_bin_read_the_same(hf_vit, tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  directory, reference = hf_vit
  sharded = str(tmp_path / 'sharded')
  reference.save_pretrained(sharded, max_shard_size='1KB')
  assert os.path.exists(os.path.join(sharded, 'model.safetensors.index.json'))
  torch_dir = str(tmp_path / 'torch')
  os.makedirs(torch_dir)
  shutil.copy(os.path.join(directory, 'config.json'), torch_dir)
  # A pytorch_model.bin holds the on-disk names (transformers 5 renames modules in memory).
  torch.save(load_file(os.path.join(directory, 'model.safetensors')),
             os.path.join(torch_dir, 'pytorch_model.bin'))
  want = tree.flatten(lazy.materialize(pretrained.load_hf(directory)[0]))
  for other in (sharded, torch_dir):
    got = tree.flatten(lazy.materialize(pretrained.load_hf(other)[0]))
    assert got.keys() == want.keys()
    for path in want:
      np.testing.assert_array_equal(got[path], want[path], err_msg=f'{other}: {path}')


def test_only_gated_gelu_t5(hf_t5, tmp_path):
  directory = _copy(hf_t5[0], tmp_path)
  _edit_config(directory, feed_forward_proj='relu')
  with pytest.raises(CheckpointError, match=r"config.json: field \"feed_forward_proj\".*"
                     r"'gated-gelu'.*'relu'.*T5 v1.1"):
    pretrained.load_hf(directory)


def test_unsupported_architecture(hf_vit, tmp_path):
  directory = _copy(hf_vit[0], tmp_path)
  _edit_config(directory, architectures=['BertModel'])
  with pytest.raises(CheckpointError, match=r'config.json: unsupported architecture in field '
                     r'"architectures".*BertModel'):
    pretrained.load_hf(directory)


def test_vit_weights_under_a_t5_config(hf_t5, hf_vit, tmp_path):
  directory = _copy(hf_t5[0], tmp_path)
  shutil.copy(os.path.join(hf_vit[0], 'model.safetensors'), directory)
  before = helpers.snapshot(directory)
  with pytest.raises(CheckpointError, match=r'model.safetensors: tensors that a T5 v1.1 model '
                     r'does not have.*vit\.'):
    pretrained.load_hf(directory)
  assert helpers.snapshot(directory) == before


def test_config_shape_mismatch_names_parameter(hf_t5, tmp_path):
  directory = _copy(hf_t5[0], tmp_path)
  _edit_config(directory, d_ff=24)
  before = helpers.snapshot(directory)
  with pytest.raises(CheckpointError) as e:
    pretrained.load_hf(directory)
  message = str(e.value)
  assert 'model.safetensors' in message
  assert "parameter 'decoder/layers_0/mlp/wi_0/kernel'" in message
  assert 'Expected (8, 24), found (8, 12)' in message and 'config.json' in message
  assert helpers.snapshot(directory) == before


def test_truncated_safetensors(hf_vit, tmp_path):
  directory = _copy(hf_vit[0], tmp_path)
  path = os.path.join(directory, 'model.safetensors')
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[:len(data) - 100])
  with pytest.raises(CheckpointError, match=r'model.safetensors: parameter .*does not fit the '
                     r'file.*Re-download'):
    pretrained.load_hf(directory)


def test_t5_rescaled_head_with_distinct_lm_head_is_refused(hf_t5, tmp_path):
  directory = _copy(hf_t5[0], tmp_path)
  _edit_config(directory, tie_word_embeddings=True)
  with pytest.raises(CheckpointError, match=r'config.json: .*lm_head.weight differs from '
                     r'shared.weight.*"tie_word_embeddings": false'):
    pretrained.load_hf(directory)
