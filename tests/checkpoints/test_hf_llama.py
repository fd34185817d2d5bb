"""HuggingFace Llama / Qwen2 / Mistral checkpoints give the logits of transformers' models."""

import copy
import dataclasses
import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

from tests import hf_files
from tests.models.helpers import llama_logits
from upcycle import checkpoints, fields, pretrained, tree
from upcycle.checkpoints import CheckpointError
from upcycle.models import Llama3RopeScaling, LlamaConfig

LENGTH = 16


def _llama_gqa(transformers):
  """6 query heads over 2 key/value heads, head_dim 12 (not 48 / 6), untied head."""
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=263, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
      num_attention_heads=6, num_key_value_heads=2, head_dim=12, rope_theta=500.0,
      rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation='eager'))


def _llama3_tied_bias(transformers):
  """9 heads over 3, head_dim 6 (not 4), biases on q/k/v/o, tied head, llama3 RoPE whose
  original context (200) puts one of the 3 frequencies (wavelengths 6, 135, 2922) in each
  band: kept, interpolated, stretched."""
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=200, hidden_size=36, intermediate_size=56, num_hidden_layers=3,
      num_attention_heads=9, num_key_value_heads=3, head_dim=6, attention_bias=True,
      tie_word_embeddings=True, max_position_embeddings=256,
      rope_parameters={'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
                       'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                       'original_max_position_embeddings': 200},
      attn_implementation='eager'))


def _qwen2(transformers):
  """q/k/v biases without an output bias, one key/value head for 5, tied head."""
  return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=150, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True,
      rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}, attn_implementation='eager'))


def _mistral(transformers):
  """A sliding window as long as the sequences (the same function), head_dim 16 (not 8)."""
  return transformers.MistralForCausalLM(transformers.MistralConfig(
      vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=LENGTH,
      attn_implementation='eager'))


MODELS = {'llama_gqa': _llama_gqa, 'llama3_tied_bias': _llama3_tied_bias, 'qwen2': _qwen2,
          'mistral': _mistral}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """name -> (directory, reference torch model), each built and saved once."""
  import transformers  # pylint: disable=g-import-not-at-top
  cache = {}

  def get(name):
    if name not in cache:
      directory = str(tmp_path_factory.mktemp(name))
      cache[name] = directory, hf_files.save_perturbed(lambda: MODELS[name](transformers),
                                                       directory)
    return cache[name]
  return get


def _batch(vocab):
  """Tokens `[3, LENGTH]` and HF's attention mask: a full row, a right-padded one (11 tokens)
  and a left-padded one (9 tokens)."""
  tokens = np.random.default_rng(0).integers(0, vocab, (3, LENGTH))
  mask = np.ones((3, LENGTH), np.int64)
  mask[1, 11:] = 0
  mask[2, :LENGTH - 9] = 0
  return tokens, mask


def _torch_logits(model, tokens, mask):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.float().numpy()


def _assert_logits_match(ours, theirs, mask, rtol=1e-4):
  """Equal within `rtol` of the largest logit, on the real (unpadded) tokens only."""
  ours, theirs = ours[mask == 1], theirs[mask == 1]
  scale = np.abs(theirs).max()
  assert scale > 1   # The comparison is not between near-zero numbers.
  assert np.abs(ours - theirs).max() <= rtol * scale


@pytest.mark.parametrize('name', sorted(MODELS))
def test_logits_match_transformers_with_padding(saved, name):
  """HF's attention mask is our segment ids (1 real, 0 padding); HF's forward numbers
  positions 0..length-1 along the row whatever the padding, as our default does."""
  directory, reference = saved(name)
  params, config = pretrained.load_hf(directory)
  tokens, mask = _batch(config.vocab_size)
  ours = llama_logits(params, config, tokens, mask.astype(np.int32))
  _assert_logits_match(ours, _torch_logits(reference, tokens, mask), mask)


def test_configs_read_from_config_json(saved):
  expected = {
      'llama_gqa': dict(num_heads=6, num_kv_heads=2, head_dim=12, qkv_bias=False,
                        out_bias=False, logits_via_embedding=False, rope_theta=500.0,
                        layer_norm_epsilon=1e-5),
      'llama3_tied_bias': dict(num_heads=9, num_kv_heads=3, head_dim=6, qkv_bias=True,
                               out_bias=True, logits_via_embedding=True,
                               rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 200)),
      'qwen2': dict(num_kv_heads=1, head_dim=8, qkv_bias=True, out_bias=False,
                    logits_via_embedding=True, rope_theta=1e6),
      'mistral': dict(head_dim=16, qkv_bias=False, sliding_window=LENGTH),
  }
  for name, want in expected.items():
    ckpt = pretrained.load(saved(name)[0])
    config = ckpt.model_config
    assert isinstance(config, LlamaConfig)
    assert {k: getattr(config, k) for k in want} == want, name
    assert ('logits_dense' in ckpt.params['decoder']) == (not config.logits_via_embedding)
    assert ckpt.params['decoder']['layers_0']['self_attention']['query']['kernel'].shape == (
        config.d_model, config.num_heads * config.head_dim)


def test_sharded_safetensors_read_the_same(saved, tmp_path):
  directory, reference = saved('llama_gqa')
  sharded = str(tmp_path / 'sharded')
  reference.save_pretrained(sharded, max_shard_size='20KB')
  assert os.path.exists(os.path.join(sharded, 'model.safetensors.index.json'))
  want = tree.flatten(pretrained.load_hf(directory)[0])
  got = tree.flatten(checkpoints.load(sharded).params)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_a_tensor_in_two_shards_is_refused_naming_both(saved, tmp_path):
  """A stray copy of a tensor written (by the safetensors library) into a shard other than
  the one "weight_map" names, before and after it in the shards' order."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  _, reference = saved('llama_gqa')
  sharded = str(tmp_path / 'sharded')
  reference.save_pretrained(sharded, max_shard_size='20KB')
  index = os.path.join(sharded, 'model.safetensors.index.json')
  with open(index) as f:
    weight_map = json.load(f)['weight_map']
  name = 'model.layers.0.input_layernorm.weight'
  listed, shards = weight_map[name], sorted(set(weight_map.values()))
  assert listed not in (shards[0], shards[-1])
  for stray in (shards[0], shards[-1]):
    tensors = load_file(os.path.join(sharded, stray))
    tensors[name] = np.full((48,), 7.0, np.float32)
    save_file(tensors, os.path.join(sharded, stray), metadata={'format': 'pt'})
    both = ' and '.join(sorted([listed, stray]))
    with pytest.raises(CheckpointError, match='^' + re.escape(
        f"{index}: tensor '{name}' is in 2 shards, {both} (\"weight_map\" names {listed}): "
        'readers disagree on which copy is the weight. Remove the stray copy, or re-save the '
        'model with save_pretrained.') + '$'):
      pretrained.load(sharded, lazy=True)
    del tensors[name]
    save_file(tensors, os.path.join(sharded, stray), metadata={'format': 'pt'})


def _upload(gcs_emulator, directory: str, prefix: str) -> str:
  """Every file of `directory` put into the emulator's bucket under `prefix` by its JSON
  upload API (not through the code under test); -> the gs:// URL of the copy."""
  import urllib.parse  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), 'rb') as f:
      urllib.request.urlopen(urllib.request.Request(
          f"{gcs_emulator['STORAGE_EMULATOR_HOST']}/upload/storage/v1/b/bucket/o?uploadType=media"
          f"&name={urllib.parse.quote(f'{prefix}/{name}', safe='')}", data=f.read(),
          headers={'Content-Type': 'application/octet-stream'}))
  return f'gs://bucket/{prefix}'


def test_a_sharded_directory_on_gcs_reads_lazily_as_on_disk(saved, tmp_path, on_gcs):
  directory, reference = saved('llama_gqa')
  sharded = str(tmp_path / 'sharded')
  reference.save_pretrained(sharded, max_shard_size='20KB')
  url = _upload(on_gcs, sharded, 'llama_gqa')
  ckpt = pretrained.load(url, lazy=True)
  assert ckpt.format == 'hf' and ckpt.model_config == pretrained.load_hf(directory)[1]
  want = tree.flatten(pretrained.load_hf(directory)[0])
  got = tree.flatten(ckpt.params)
  assert got.keys() == want.keys()
  for path in want:
    assert not isinstance(got[path], np.ndarray)   # read when asked for
    np.testing.assert_array_equal(np.asarray(got[path]), want[path], err_msg=path)


def test_bfloat16_checkpoint(saved, tmp_path):
  """bf16 leaves are read exactly; in float32 they give the logits of the bf16 weights, and a
  bfloat16 model comes close to them."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  _, reference = saved('llama_gqa')
  bf16 = copy.deepcopy(reference).to(torch.bfloat16)
  directory = str(tmp_path / 'bf16')
  bf16.save_pretrained(directory)
  # Re-read in float32 (`bf16.float()` would keep the RoPE frequencies rounded to bf16).
  as_read = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  params, config = pretrained.load_hf(directory)
  kernel = params['decoder']['layers_1']['mlp']['wi_0']['kernel']
  assert kernel.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(
      kernel, bf16.model.layers[1].mlp.gate_proj.weight.detach().float().numpy().T.astype(
          ml_dtypes.bfloat16))
  as_float32 = tree.unflatten({p: np.asarray(v, np.float32)
                               for p, v in tree.flatten(params).items()})
  tokens, mask = _batch(config.vocab_size)
  theirs = _torch_logits(as_read, tokens, mask)
  _assert_logits_match(llama_logits(as_float32, config, tokens, mask.astype(np.int32)),
                       theirs, mask)
  bf16_config = dataclasses.replace(config, dtype='bfloat16')
  _assert_logits_match(llama_logits(as_float32, bf16_config, tokens, mask.astype(np.int32)),
                       theirs, mask, rtol=0.05)


def _copy_with_config(directory, tmp_path, **changes):
  target = str(tmp_path / 'copy')
  shutil.copytree(directory, target)
  path = os.path.join(target, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  with open(path, 'w') as f:
    json.dump(config, f)
  return target


def test_unsupported_rope_is_refused_naming_the_file_and_field(saved, tmp_path):
  directory = _copy_with_config(saved('llama_gqa')[0], tmp_path, rope_parameters={
      'rope_type': 'yarn', 'rope_theta': 500.0, 'factor': 4.0})
  with pytest.raises(fields.ConfigError) as e:
    pretrained.load_hf(directory)
  message = str(e.value)
  assert message.startswith(os.path.join(directory, 'config.json') + ': field '
                            '"rope_parameters.rope_type" = "yarn"')
  assert 'Fix:' in message and '\n' not in message


def test_tied_head_that_differs_from_the_embedding_is_refused(saved, tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = _copy_with_config(saved('qwen2')[0], tmp_path)
  weights = os.path.join(directory, 'model.safetensors')
  tensors = load_file(weights)
  tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'] + 1
  save_file(tensors, weights)
  with pytest.raises(CheckpointError, match=r'config.json: "tie_word_embeddings": true, but '
                     r'lm_head.weight differs from model.embed_tokens.weight'):
    pretrained.load_hf(directory)


def test_other_heads_are_refused(saved, tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = _copy_with_config(saved('llama_gqa')[0], tmp_path)
  weights = os.path.join(directory, 'model.safetensors')
  tensors = load_file(weights)
  tensors['score.weight'] = tensors.pop('lm_head.weight')[:2]
  save_file(tensors, weights)
  with pytest.raises(CheckpointError, match=r'model.safetensors: tensors that a Llama / Mistral '
                     r"/ Qwen2 / Mixtral causal LM does not have.*'score.weight'"):
    pretrained.load_hf(directory)


def test_inspect_names_a_llama_from_its_parameters_alone(saved):
  """Heads and head_dim are not told apart by names and shapes: the widths are (6 x 12 query,
  2 x 12 key/value), and the tree is a Llama, not a T5 without encoder."""
  from upcycle.checkpoints import describe  # pylint: disable=g-import-not-at-top
  params, _ = pretrained.load_hf(saved('llama_gqa')[0])
  assert describe.describe(params) == (
      'Llama: 2 layers, d_model 48, query width 72, key/value width 24, d_ff 72, vocab 263, '
      'dense')
  assert describe.model_kind(params) == 'llama'


@pytest.mark.parametrize('name, ours, index, value', [
    ('model.layers.1.mlp.gate_proj.weight', 'decoder/layers_1/mlp/wi_0/kernel', (3, 5), np.nan),
    ('model.embed_tokens.weight', 'token_embedder/embedding', (7, 0), np.inf),
])
def test_non_finite_weights_are_refused_where_read_naming_tensor_and_file(
    saved, tmp_path, capsys, name, ours, index, value):
  """A NaN or Inf written into a tensor (by the safetensors library): the metadata still
  reads; reading the tensor whole (convert, train, describe --verify) or the block holding
  the value (a device's block, as infer places it) is refused in one line; other blocks and
  tensors read."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  from upcycle import describe as describe_main  # pylint: disable=g-import-not-at-top
  directory = _copy_with_config(saved('llama_gqa')[0], tmp_path)
  weights = os.path.join(directory, 'model.safetensors')
  tensors = load_file(weights)
  tensors[name][index] = value
  save_file(tensors, weights, metadata={'format': 'pt'})
  refusal = (re.escape(f"{weights}: parameter '{name}': the tensor holds values that are not "
                       'finite. Expected finite values, found ') +
             ('1 NaN and 0 Inf' if np.isnan(value) else '0 NaN and 1 Inf') +
             re.escape(' among those read. The file is damaged: re-download or re-export it.'))
  with pytest.raises(CheckpointError, match='^' + refusal + '$'):
    pretrained.load_hf(directory)
  leaf = tree.flatten(pretrained.load(directory, lazy=True).params)[ours]
  block = (slice(index[0] // 4 * 4, index[0] // 4 * 4 + 4), slice(None))
  held = block[::-1] if ours.endswith('kernel') else block   # kernels are transposed
  with pytest.raises(CheckpointError, match='^' + refusal + '$'):
    leaf.read(held)
  if not ours.endswith('kernel'):
    other = (slice(index[0] // 4 * 4 + 4, None), slice(None))
    np.testing.assert_array_equal(leaf.read(other), tensors[name][other])
  assert describe_main.main([directory, '--verify']) == 1
  assert re.fullmatch('error: ' + refusal, capsys.readouterr().err.strip().splitlines()[-1])
