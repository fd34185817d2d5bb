"""HuggingFace Mixtral checkpoints (per-expert tensors, as `save_pretrained` writes them) read
into the Llama MoE give transformers' `MixtralForCausalLM` logits and auxiliary loss, and
greedy decoding gives its `generate` tokens."""

import json
import os

import jax
import numpy as np
import pytest

from tests import hf_files
from upcycle import fields, pretrained
from upcycle.checkpoints import CheckpointError
from upcycle.decoding import DecodeConfig
from upcycle.decoding import llama as llama_decoding
from upcycle.models import Llama
from upcycle.moe import MOE_COLLECTIONS, aux_losses, balance, routers

LENGTH = 12


def _mixtral(transformers):
  """4 experts of d_ff 40, top 2; 6 query heads over 2 key/value heads of 10 (not 36 / 6)."""
  return transformers.MixtralForCausalLM(transformers.MixtralConfig(
      vocab_size=97, hidden_size=36, intermediate_size=40, num_hidden_layers=2,
      num_attention_heads=6, num_key_value_heads=2, head_dim=10, num_local_experts=4,
      num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True,
      sliding_window=None, rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0},
      attn_implementation='eager'))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  import transformers  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path_factory.mktemp('mixtral'))
  return directory, hf_files.save_perturbed(lambda: _mixtral(transformers), directory)


def _batch():
  """Tokens `[3, LENGTH]` and HF's attention mask: full, right-padded (8), left-padded (5)."""
  tokens = np.random.default_rng(0).integers(0, 97, (3, LENGTH))
  mask = np.ones((3, LENGTH), np.int64)
  mask[1, 8:] = 0
  mask[2, :LENGTH - 5] = 0
  return tokens, mask


def test_the_file_holds_one_tensor_per_expert(saved):
  """What the reader is written against: transformers 5 fuses Mixtral's experts in memory
  and `save_pretrained` writes them per expert."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with safe_open(os.path.join(saved[0], 'model.safetensors'), 'np') as f:
    names = list(f.keys())
  assert 'model.layers.1.block_sparse_moe.experts.3.w2.weight' in names
  assert 'model.layers.0.block_sparse_moe.gate.weight' in names


def test_logits_and_load_balancing_loss_match_transformers(saved):
  import torch  # pylint: disable=g-import-not-at-top
  directory, reference = saved
  params, config = pretrained.load_hf(directory)
  moe = config.moe
  assert (moe.num_experts, moe.router, moe.normalize_combine_weights, moe.balance,
          moe.router_z_loss_weight) == (
              4, routers.TopK(k=2), True, balance.PooledSwitch(weight=0.02, scope='batch'), 0.0)
  assert params['decoder']['layers_1']['mlp']['expert']['wi_0']['kernel'].shape == (4, 36, 40)
  tokens, mask = _batch()
  with torch.no_grad():
    out = reference(torch.tensor(tokens), attention_mask=torch.tensor(mask))
  logits, state = jax.jit(lambda p, t, s: Llama(config).apply(
      {'params': p}, t, decoder_segment_ids=s, mutable=MOE_COLLECTIONS))(
          params, tokens, mask.astype(np.int32))
  ours, theirs = np.asarray(logits)[mask == 1], out.logits.float().numpy()[mask == 1]
  scale = np.abs(theirs).max()
  assert scale > 1 and np.abs(ours - theirs).max() <= 1e-4 * scale
  # transformers' load_balancing_loss_func over both layers' router logits, padding masked.
  np.testing.assert_allclose(aux_losses(state)['load_balancing_loss'], out.aux_loss.item(),
                             rtol=1e-5)
  # What the training loss adds: router_aux_loss_coef x that loss, as MixtralForCausalLM's
  # loss with labels (no z-loss).
  np.testing.assert_allclose(aux_losses(state)['total'], 0.02 * out.aux_loss.item(), rtol=1e-5)


def test_greedy_decoding_matches_generate(saved):
  """Left-padded prompts of 12, 5 and 1 tokens, 8 new tokens each; the experts dropless
  ('ragged'), each decode step's token routed on its own, as HF routes it."""
  import torch  # pylint: disable=g-import-not-at-top
  directory, reference = saved
  params, config = pretrained.load_hf(directory)
  assert config.moe.dispatch == 'ragged'
  tokens, mask = _batch()
  tokens, mask = np.where(mask[[0, 2, 2]] == 1, tokens, 0), mask[[0, 2, 2]]
  mask[2, :LENGTH - 1] = 0
  tokens = np.where(mask == 1, tokens, 0)
  reference.generation_config.eos_token_id = None
  with torch.no_grad():   # (no router logits: HF's aux loss does not take a growing mask)
    theirs = reference.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                                max_new_tokens=8, do_sample=False, num_beams=1, pad_token_id=0,
                                output_router_logits=False)
  decode = llama_decoding.make_decode_fn(Llama(config), DecodeConfig(method='greedy'), 8)
  ours, _ = decode(params, tokens.astype(np.int32), mask.astype(np.int32), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(np.asarray(ours), theirs[:, LENGTH:].numpy())


def test_a_missing_expert_is_named(saved, tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path / 'gap')
  os.makedirs(directory)
  for name in os.listdir(saved[0]):
    if name.endswith('.json'):
      with open(os.path.join(saved[0], name)) as src, \
           open(os.path.join(directory, name), 'w') as dst:
        dst.write(src.read())
  tensors = load_file(os.path.join(saved[0], 'model.safetensors'))
  del tensors['model.layers.0.block_sparse_moe.experts.1.w1.weight']
  save_file(tensors, os.path.join(directory, 'model.safetensors'))
  with pytest.raises(CheckpointError, match=r'model.layers.0.block_sparse_moe.experts.\{j\}.w1.'
                     r"weight: parameter 'decoder/layers_0/mlp/expert/wi_0/kernel': expert "
                     r'tensors are missing. Expected experts 0..3, found no \[1\]'):
    pretrained.load_hf(directory)


def test_router_jitter_is_refused_by_name(saved, tmp_path):
  directory = str(tmp_path / 'jitter')
  os.makedirs(directory)
  hf = json.load(open(os.path.join(saved[0], 'config.json')))
  hf['router_jitter_noise'] = 0.1
  json.dump(hf, open(os.path.join(directory, 'config.json'), 'w'))
  os.symlink(os.path.join(saved[0], 'model.safetensors'),
             os.path.join(directory, 'model.safetensors'))
  with pytest.raises(fields.ConfigError, match=r'config.json: field "router_jitter_noise" = 0.1'):
    pretrained.load_hf(directory)
