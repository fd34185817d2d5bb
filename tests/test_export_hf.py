"""`python -m upcycle.export --format=hf`: runs of ours written as HuggingFace directories that
transformers loads with our logits and our reader reads back to the same parameters."""

import dataclasses
import json
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.checkpoints import helpers
from tests.models.helpers import llama_logits
from upcycle import export, fields, hf_export, pretrained, tree
from upcycle.checkpoints import CheckpointError
from upcycle.checkpoints.orbax import CheckpointManager
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.decoding import DecodeConfig
from upcycle.decoding import llama as llama_decoding
from upcycle import upcycling
from upcycle.upcycling.experts import Granular
from upcycle.models.families import abstract_params
from upcycle.models import Llama, Llama3RopeScaling, LlamaConfig, llama_hf, scan_layout
from upcycle.moe import MOE_COLLECTIONS, aux_losses, capacity, routers

LENGTH = 12
# configs/models/llama/tiny.gin, with a llama3 RoPE whose original context (64) puts the 8
# frequencies' wavelengths (6 ... 19869) in all three bands: kept, interpolated, stretched.
TINY_LLAMA = LlamaConfig(vocab_size=4096, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         d_ff=256, num_layers=4, layer_norm_epsilon=1e-5,
                         rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64))
LLAMA3_GIN = '''from __gin__ import dynamic_registration
from upcycle import models
include 'models/llama/tiny.gin'
models.LlamaConfig.rope_scaling = @models.Llama3RopeScaling()
models.Llama3RopeScaling.original_max_position_embeddings = 64
'''
# head_dim 12, not d_model / heads = 8; 5 query heads over one key/value head.
SMALL = dict(vocab_size=150, d_model=40, num_heads=5, num_kv_heads=1, head_dim=12, d_ff=64,
             num_layers=2)
FAMILIES = {
    'Qwen2ForCausalLM': LlamaConfig(**SMALL, qkv_bias=True, logits_via_embedding=True,
                                    rope_theta=1e6),
    'LlamaForCausalLM': LlamaConfig(**SMALL, qkv_bias=True, out_bias=True),
    'MistralForCausalLM': LlamaConfig(**SMALL, sliding_window=LENGTH),
}


def _random(config, seed):
  """Parameters whose logits are not near zero (norm scales around 1)."""
  return helpers.random_params(config, seed=seed, scale=0.2)


def _save_run(model_dir, params, step=2):
  """A run's MODEL_DIR as the trainer leaves it: checkpoints/<step>/ (parameters only)."""
  with CheckpointManager(str(model_dir / 'checkpoints'), async_save=False) as manager:
    manager.save(step, params)
  return str(model_dir)


def _tokens(vocab):
  return np.random.default_rng(0).integers(0, vocab, (2, LENGTH))


def _assert_close(ours, theirs, rtol=1e-4):
  scale = np.abs(theirs).max()
  assert scale > 1   # The comparison is not between near-zero numbers.
  assert np.abs(ours - theirs).max() <= rtol * scale


def _assert_reads_back(directory, want, config):
  """Our HF reader finds exactly the exported parameters and the model's config (with the
  context the export writes)."""
  params, read_config = pretrained.load_hf(directory)
  if hasattr(config, 'max_position_embeddings'):
    config = dataclasses.replace(config, max_position_embeddings=json.loads(open(os.path.join(
        directory, 'config.json')).read()).get('max_position_embeddings'))
  assert read_config == config
  got, want = tree.flatten(params), tree.flatten(want)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def _torch_logits(model, tokens):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def test_llama_run_loads_in_transformers_sharded_with_its_tokenizer(tmp_path, capsys):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  params = _random(TINY_LLAMA, seed=0)
  run = _save_run(tmp_path / 'run', params)
  tokenizer = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  tokenizer.save(os.path.join(run, tokenizer_lib.RUN_SUBDIR))
  out = tmp_path / 'hf'
  (tmp_path / 'llama3.gin').write_text(LLAMA3_GIN)
  assert export.main(['--format=hf', f'--model_dir={run}', f'--output_dir={out}',
                      '--max_shard_size=1MB', f'--gin_file={tmp_path / "llama3.gin"}']) == 0
  assert f'Wrote {out} (LlamaForCausalLM, 39 tensors, with its tokenizer).' in (
      capsys.readouterr().out)
  files = sorted(os.listdir(out))
  shards = [f for f in files if f.startswith('model-')]
  assert len(shards) >= 2 and 'model.safetensors.index.json' in files
  assert all(os.path.getsize(out / f) <= 1_100_000 for f in shards)   # header included
  assert {'tokenizer.json', 'tokenizer_config.json', 'config.json'} <= set(files)
  assert sorted(os.listdir(tmp_path)) == ['hf', 'llama3.gin', 'run']   # nothing left beside
  config = json.loads((out / 'config.json').read_text())
  assert (config['bos_token_id'], config['eos_token_id'], config['pad_token_id']) == (1, 2, 0)
  assert config['rope_parameters']['rope_type'] == 'llama3'
  # A run from scratch: its own tokenizer's ids (the offline BPE's <s>, </s>, <pad>).
  assert json.loads((out / 'generation_config.json').read_text()) == {
      'bos_token_id': 1, 'eos_token_id': 2, 'pad_token_id': 0}

  theirs = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  tokens = _tokens(TINY_LLAMA.vocab_size)
  _assert_close(llama_logits(params, TINY_LLAMA, tokens), _torch_logits(theirs, tokens))
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  text = 'def main(argv):\n  return sorted(argv)[0]  # ünïcode\n'
  assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text)
  _assert_reads_back(str(out), params, TINY_LLAMA)

  # --dtype=bfloat16: each tensor is the float32 one rounded by numpy's bfloat16 cast.
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  half = tmp_path / 'bf16'
  assert export.main(['--format=hf', f'--model_dir={run}', f'--output_dir={half}',
                      '--dtype=bfloat16', f'--gin_file={tmp_path / "llama3.gin"}']) == 0
  assert json.loads((half / 'config.json').read_text())['dtype'] == 'bfloat16'
  got = load_file(str(half / 'model.safetensors'))
  embedding = params['token_embedder']['embedding']
  np.testing.assert_array_equal(got['model.embed_tokens.weight'],
                                embedding.astype(ml_dtypes.bfloat16))


def test_a_run_whose_tokenizer_was_replaced_is_refused_and_one_without_says_so(tmp_path,
                                                                                capsys):
  """The step's data position records the digest of the tokenizer it was trained with (the
  offline BPE): the run's tokenizer/ replaced by another (two ids swapped) is refused in one
  line, nothing written; without tokenizer/ the export says it has none; the right one
  passes."""
  from tests.helpers import save_swapped_tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data.lm import LmPipeline  # pylint: disable=g-import-not-at-top
  from upcycle.train import host_data, host_states  # pylint: disable=g-import-not-at-top
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  run = tmp_path / 'run'
  position = host_states.gather(host_data.HostData(
      LmPipeline('offline_stdlib_text', 'train', {'targets': 16}), global_batch_size=2,
      seed=0).get_state())
  with CheckpointManager(str(run / 'checkpoints'), async_save=False) as manager:
    manager.save(2, _random(TINY_LLAMA, seed=0), dataset_state=position)
  kept = save_swapped_tokenizer(offline, str(run / tokenizer_lib.RUN_SUBDIR))
  (tmp_path / 'llama3.gin').write_text(LLAMA3_GIN)
  out, step = tmp_path / 'hf', run / 'checkpoints' / '2'
  flags = [f'--model_dir={run}', f'--gin_file={tmp_path / "llama3.gin"}']
  assert _refusal(capsys, *flags, f'--output_dir={out}') == (
      f'error: The HF export reads {kept} (tokenizer digest '
      f'{tokenizer_lib.load(kept).short_digest}), but the weights of {step} were trained with '
      f'tokenizer {offline.short_digest} (the data position saved in {step}/dataset): they '
      f"would read another tokenizer's ids. Fix: put the tokenizer {step} was trained with in "
      f'{kept}.\n')
  assert not out.exists()
  for name in os.listdir(kept):
    os.remove(os.path.join(kept, name))
  assert export.main(['--format=hf', *flags, f'--output_dir={out}']) == 0
  assert (f'Wrote {out} (LlamaForCausalLM, 39 tensors, without a tokenizer: copy the one its '
          f'weights were trained with into it).') in capsys.readouterr().out
  offline.save(kept)
  assert export.main(['--format=hf', *flags, f'--output_dir={tmp_path / "hf2"}']) == 0
  assert 'with its tokenizer' in capsys.readouterr().out


@pytest.mark.parametrize('architecture', sorted(FAMILIES))
def test_each_family_loads_as_its_class_from_scanned_layers(architecture, tmp_path):
  """A scanned run is unrolled; q/k/v biases alone are Qwen2's, all four Llama's
  (attention_bias), a sliding window Mistral's."""
  import transformers  # pylint: disable=g-import-not-at-top
  config = FAMILIES[architecture]
  params = _random(config, seed=1)
  scanned = scan_layout.stack(params, dataclasses.replace(config, scan_layers=True))
  run = _save_run(tmp_path / 'run', scanned)
  out = hf_export.export(run, str(tmp_path / 'hf'), model_config=config)
  assert sorted(os.listdir(out)) == ['README.md', 'config.json', 'digests', 'model.safetensors']
  theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(theirs).__name__ == architecture
  tokens = _tokens(config.vocab_size)
  _assert_close(llama_logits(params, config, tokens), _torch_logits(theirs, tokens))
  _assert_reads_back(out, params, config)


def test_t5_loads_with_its_own_lm_head(tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=2)
  run = _save_run(tmp_path / 'run', params, step=7)
  out = hf_export.export(run, str(tmp_path / 'hf'), model_config=helpers.CHECKPOINT_T5)
  theirs = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
  assert not torch.equal(theirs.lm_head.weight, theirs.shared.weight)
  np.testing.assert_array_equal(theirs.lm_head.weight.detach().numpy(),
                                params['decoder']['logits_dense']['kernel'].T)
  _assert_close(helpers.t5_logits(params),
                helpers.torch_t5_logits(theirs, helpers.ENCODER_TOKENS, helpers.DECODER_TOKENS))
  _assert_reads_back(out, params, helpers.CHECKPOINT_T5)


def test_an_hf_checkpoint_exports_to_the_same_tensors(hf_t5, tmp_path):
  """Any checkpoint the project reads is a source; an HF one names its own model."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  out = hf_export.export(hf_t5[0], str(tmp_path / 'hf'))
  want, got = load_file(os.path.join(hf_t5[0], 'model.safetensors')), load_file(
      os.path.join(out, 'model.safetensors'))
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _refusal(capsys, *flags):
  assert export.main(['--format=hf', *flags]) == 1
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and err.startswith('error: ')
  return err


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
  run = _save_run(tmp_path / 'run', _random(FAMILIES['Qwen2ForCausalLM'], seed=3))
  out = tmp_path / 'hf'
  flags = [f'--model_dir={run}', f'--output_dir={out}']
  assert '--format=t5x' in _refusal(capsys, *flags, '--gin_file=models/t5_1_1/tiny.gin',
                                    '--gin_file=moe/paper_t5.gin')
  assert 'ViT is not written' in _refusal(capsys, *flags, '--gin_file=models/vit/tiny.gin')
  assert 'does not say which model' in _refusal(capsys, *flags)
  assert "'5XB' is not a size" in _refusal(capsys, *flags, '--max_shard_size=5XB')
  with pytest.raises(hf_export.ExportError,
                     match=r"^--dtype='float16': expected one of \['bfloat16', 'float32'\]\.$"):
    hf_export.export(run, str(out), model_config=FAMILIES['Qwen2ForCausalLM'], dtype='float16')
  llama = '--gin_file=models/llama/tiny.gin'
  assert 'the HuggingFace export writes local directories' in _refusal(
      capsys, f'--model_dir={run}', '--output_dir=gs://bucket/hf', llama)
  inside = _refusal(capsys, f'--model_dir={run}', f'--output_dir={run}/checkpoints/hf', llama)
  assert f'lies inside the checkpoint {run}/checkpoints, which an export only reads' in inside
  moe = llama_hf.mixtral_moe(num_experts=2, k=1, aux_loss_coef=0.01)
  neither = 'so neither MixtralForCausalLM nor Qwen2MoeForCausalLM computes this MoE'
  for config, binding, fix in (
      (dataclasses.replace(FAMILIES['LlamaForCausalLM'], moe=moe),
       'models.LlamaConfig.out_bias = True', 'out_bias = False'),
      (dataclasses.replace(FAMILIES['MistralForCausalLM'], moe=dataclasses.replace(
          moe, eval_capacity_factor=1.0, dispatch='indices')),
       'moe.MoeConfig.eval_capacity_factor', "dispatch = 'ragged'"),
      (dataclasses.replace(FAMILIES['Qwen2ForCausalLM'], moe=dataclasses.replace(
          moe, capacity_convention=capacity.T5X(), train_capacity_factor=1.5, dispatch='masked',
          shared_expert=True)), 'moe.MoeConfig.eval_capacity_factor', "dispatch = 'ragged'")):
    with pytest.raises(fields.ConfigError, match=f'^{re.escape(binding)}.*{neither}. Fix: '
                       f'train it with {re.escape(fix)}'):
      hf_export.export(run, str(out), model_config=config)
  # Expert Choice reads the future in a decoder: no Llama holds it, in either format.
  assert 'models.LlamaConfig.moe.router = ExpertsChoose()' in _refusal(
      capsys, *flags, llama, '--gin_file=moe/mixtral.gin',
      '--gin.moe.MoeConfig.router=@routers.ExpertsChoose()',
      "--gin.moe.MoeConfig.dispatch='indices'")
  (tmp_path / 'run' / 'config.gin').write_text(
      'from __gin__ import dynamic_registration\nfrom upcycle import models\n'
      'MODEL = @models.NoSuchModel()\n')
  assert _refusal(capsys, *flags).startswith(
      f"error: {run}/config.gin: the run's model cannot be read from its saved gin config (")
  # A config written before the load-balancing fields became one object: the fix, not gin's.
  (tmp_path / 'run' / 'config.gin').write_text(
      'from __gin__ import dynamic_registration\nfrom upcycle.moe import config as moe\n'
      'moe.MoeConfig.load_balancing_loss_weight = 0.01\n')
  assert _refusal(capsys, *flags).strip() == (
      f'error: {run}/config.gin: moe.MoeConfig.load_balancing_loss_weight is no field any '
      f'more: the load-balancing loss is one object, moe.MoeConfig.balance. Fix: bind '
      f'moe.MoeConfig.balance = @balance.Switch() (each MoE layer its own loss) or '
      f'@balance.PooledSwitch() (f and p averaged over the stack\'s layers, one loss), from '
      f'upcycle.moe import balance; bind its weight as balance.Switch.weight (or '
      f'balance.PooledSwitch.weight).')
  os.remove(tmp_path / 'run' / 'config.gin')
  out.mkdir()
  (out / 'kept').write_text('')
  assert 'already exists and is not empty' in _refusal(
      capsys, *flags, '--gin_file=models/llama/tiny.gin')
  assert os.listdir(out) == ['kept'] and sorted(os.listdir(tmp_path)) == ['hf', 'run']


@pytest.mark.parametrize('experts, expert_d_ff', [('copy', 64), (Granular(2), 32)],
                         ids=['copy', 'granular'])
def test_an_upcycled_llama_is_a_mixtral_with_the_dense_logits_in_transformers(
    tmp_path, experts, expert_d_ff):
  """Step-0 equality where users check it: a dense Llama upcycled into 4 experts, top 2,
  renormalized weights, exported, and loaded by MixtralForCausalLM gives the dense model's
  logits; and the export reads back to the same parameters. Copied experts; or fine-grained
  ones (each expert half the dense d_ff units, its down projection times 2, the two halves'
  router rows tied, so top 2 takes a whole dense MLP)."""
  import transformers  # pylint: disable=g-import-not-at-top
  dense_config = FAMILIES['MistralForCausalLM']
  dense = _random(dense_config, seed=5)
  config = dataclasses.replace(dense_config, d_ff=expert_d_ff,
                               moe=llama_hf.mixtral_moe(4, 2, 0.02))
  params, _ = upcycling.upcycle(dense, abstract_params(config), experts=experts,
                                router='normal', rng=0)
  run = _save_run(tmp_path / 'run', params)
  dense_run = _save_run(tmp_path / 'dense', dense)
  hf_export.export(run, str(tmp_path / 'mixtral'), model_config=config)
  hf_export.export(dense_run, str(tmp_path / 'mistral'), model_config=dense_config)
  hf = json.loads((tmp_path / 'mixtral' / 'config.json').read_text())
  assert (hf['architectures'], hf['num_local_experts'], hf['num_experts_per_tok'],
          hf['router_aux_loss_coef']) == (['MixtralForCausalLM'], 4, 2, 0.02)
  mixtral = transformers.MixtralForCausalLM.from_pretrained(tmp_path / 'mixtral').eval()
  mistral = transformers.MistralForCausalLM.from_pretrained(tmp_path / 'mistral').eval()
  tokens = _tokens(dense_config.vocab_size)
  _assert_close(_torch_logits(mixtral, tokens), _torch_logits(mistral, tokens))
  _assert_close(llama_logits(params, config, tokens), _torch_logits(mixtral, tokens))
  _assert_reads_back(tmp_path / 'mixtral', params, config)


def _moe(**change):
  return dataclasses.replace(llama_hf.mixtral_moe(4, 2, 0.02), **change)


# MoE Llamas Mixtral cannot express, each written as Qwen2MoeForCausalLM.
QWEN2_MOE = {
    # MoE in layers 0 and 2 only, q/k/v biases, a shared expert of its own d_ff.
    'some_layers_shared_expert_qkv_bias': LlamaConfig(
        **{**SMALL, 'num_layers': 3}, qkv_bias=True, rope_theta=1e6, moe_layers=(0, 2),
        moe=_moe(shared_expert=True, shared_expert_d_ff=24)),
    # Raw top-2 weights, no shared expert (written as one of 0 units), full capacity, tied head.
    'raw_weights_no_shared_expert': LlamaConfig(
        **SMALL, logits_via_embedding=True,
        moe=_moe(normalize_combine_weights=False, dispatch='indices')),
    # A shared expert of the dense d_ff under a sliding window, which every layer then has.
    'window_shared_expert': LlamaConfig(**SMALL, sliding_window=LENGTH,
                                        moe=_moe(shared_expert=True)),
}


@pytest.fixture(scope='module', params=sorted(QWEN2_MOE))
def qwen2_moe(request, tmp_path_factory):
  """(config, params, the exported directory, transformers' model loaded from it)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config = QWEN2_MOE[request.param]
  params = _random(config, seed=6)
  tmp = tmp_path_factory.mktemp(request.param)
  out = hf_export.export(_save_run(tmp / 'run', params), str(tmp / 'hf'), model_config=config)
  theirs = transformers.Qwen2MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  return config, params, out, theirs


def _masked_batch(vocab):
  """Tokens `[3, LENGTH]` and HF's attention mask: full, right-padded (8), left-padded (5)."""
  mask = np.ones((3, LENGTH), np.int64)
  mask[1, 8:] = 0
  mask[2, :LENGTH - 5] = 0
  return np.random.default_rng(0).integers(0, vocab, (3, LENGTH)), mask


def test_qwen2_moe_export_is_what_save_pretrained_writes_and_reads_back(qwen2_moe, tmp_path):
  """config.json's Qwen2-MoE fields, and the file holds what `save_pretrained` writes for the
  model it loads as (names, shapes, values: per-expert tensors, which transformers fuses on
  load and splits on save). Our ungated shared expert is theirs with a gate of zeros and the
  down projection doubled; no shared expert is one of 0 units."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  config, params, out, theirs = qwen2_moe
  with open(os.path.join(out, 'config.json')) as f:
    hf = json.load(f)
  shared_d_ff = config.moe.shared_d_ff(config.d_ff) or 0
  dense = [i for i in range(config.num_layers) if i not in config.sparse_layers()]
  assert (hf['architectures'], hf['mlp_only_layers'], hf['decoder_sparse_step'],
          hf['moe_intermediate_size'], hf['shared_expert_intermediate_size'],
          hf['norm_topk_prob'], hf['qkv_bias'], hf['router_aux_loss_coef']) == (
              ['Qwen2MoeForCausalLM'], dense, 1, config.d_ff, shared_d_ff,
              config.moe.normalize_combine_weights, config.qkv_bias, 0.02)
  windowed = config.sliding_window is not None
  assert theirs.config.layer_types == [
      'sliding_attention' if windowed else 'full_attention'] * config.num_layers
  theirs.save_pretrained(tmp_path / 'resaved')
  ours = load_file(os.path.join(out, 'model.safetensors'))
  resaved = load_file(str(tmp_path / 'resaved' / 'model.safetensors'))
  assert sorted(ours) == sorted(resaved)
  for name in ours:
    np.testing.assert_array_equal(ours[name], resaved[name], err_msg=name)
  i = config.sparse_layers()[-1]
  mlp = params['decoder'][f'layers_{i}']['mlp']
  np.testing.assert_array_equal(ours[f'model.layers.{i}.mlp.shared_expert_gate.weight'],
                                np.zeros((1, config.d_model), np.float32))
  down = ours[f'model.layers.{i}.mlp.shared_expert.down_proj.weight']
  assert down.shape == (config.d_model, shared_d_ff)
  if shared_d_ff:
    np.testing.assert_array_equal(down, 2 * mlp['shared_expert']['wo']['kernel'].T)
  # Read back: the same parameters, and the config up to the dispatch (a dropless one reads
  # as 'ragged', the one that needs no capacity).
  _assert_reads_back(out, params, dataclasses.replace(
      config, moe=dataclasses.replace(config.moe, dispatch='ragged')))


def test_qwen2_moe_logits_and_load_balancing_loss_are_ours(qwen2_moe):
  """Within 1e-4 relative (padding masked) on rows full, right- and left-padded; the loss is
  the pooled one (`mixtral_moe`'s), over the MoE layers' real tokens, as transformers'."""
  import torch  # pylint: disable=g-import-not-at-top
  config, params, _, theirs = qwen2_moe
  tokens, mask = _masked_batch(config.vocab_size)
  with torch.no_grad():
    reference = theirs(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                       output_router_logits=True)
  logits, state = jax.jit(lambda p, t, s: Llama(config).apply(
      {'params': p}, t, decoder_segment_ids=s, mutable=MOE_COLLECTIONS))(
          params, tokens, mask.astype(np.int32))
  _assert_close(np.asarray(logits)[mask == 1], reference.logits.numpy()[mask == 1])
  np.testing.assert_allclose(aux_losses(state)['load_balancing_loss'],
                             reference.aux_loss.item(), rtol=1e-5)


def test_qwen2_moe_greedy_decoding_is_generate(qwen2_moe):
  """Left-padded prompts of 6 and 5 tokens, 6 new tokens each (12 in all: the window)."""
  import torch  # pylint: disable=g-import-not-at-top
  config, params, _, theirs = qwen2_moe
  tokens, mask = (x[[0, 2], LENGTH // 2:] for x in _masked_batch(config.vocab_size))
  tokens = np.where(mask == 1, tokens, 0)
  theirs.generation_config.eos_token_id = None
  with torch.no_grad():
    want = theirs.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                           max_new_tokens=6, do_sample=False, num_beams=1, pad_token_id=0,
                           output_router_logits=False)
  decode = llama_decoding.make_decode_fn(Llama(config), DecodeConfig(method='greedy'), 6)
  got, _ = decode(params, tokens.astype(np.int32), mask.astype(np.int32), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(np.asarray(got), want[:, LENGTH // 2:].numpy())


def test_a_qwen2_moe_we_did_not_write_is_refused_on_read(tmp_path):
  """A learned shared-expert gate (Qwen1.5-MoE's) is no ungated shared expert, and experts of
  another size than the dense MLPs are no Llama MoE: each refused in one line."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  config = QWEN2_MOE['some_layers_shared_expert_qkv_bias']
  out = hf_export.export(_save_run(tmp_path / 'run', _random(config, seed=7)),
                         str(tmp_path / 'hf'), model_config=config)
  weights = os.path.join(out, 'model.safetensors')
  tensors = load_file(weights)
  tensors['model.layers.2.mlp.shared_expert_gate.weight'][0, 3] = 0.5
  save_file(tensors, weights, metadata={'format': 'pt'})
  with pytest.raises(CheckpointError, match=r"^model.layers.2.mlp.shared_expert_gate.weight: "
                     r"parameter 'decoder/layers_2/mlp/shared_expert_gate/kernel': a shared "
                     r"expert gated by its input.*Expected a shared_expert_gate.weight of zeros"):
    pretrained.load_hf(out)
  tensors['model.layers.2.mlp.shared_expert_gate.weight'][0, 3] = 0.0
  save_file(tensors, weights, metadata={'format': 'pt'})
  with open(os.path.join(out, 'config.json')) as f:
    hf = json.load(f)
  with open(os.path.join(out, 'config.json'), 'w') as f:
    json.dump(dict(hf, moe_intermediate_size=32), f)
  with pytest.raises(fields.ConfigError, match=r'config.json: field "moe_intermediate_size" = '
                     r'32: this model\'s experts have the dense MLP\'s d_ff \("intermediate_size'
                     r'" = 64\)\. Fix: '):
    pretrained.load_hf(out)


def test_a_run_exports_with_the_model_its_config_gin_keeps(tmp_path, entry_points):
  """No gin files repeated: the model is the one the run's MODEL_DIR/config.gin (as the
  trainer writes it, `import __main__ as train_script` included) binds, its command-line
  overrides too (2 layers, d_ff 96: the parameters of any other model are refused). In a
  process of its own (no `__main__.train`): tests/train/test_llm_training.py."""
  import gin  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle import gin_utils  # pylint: disable=g-import-not-at-top
  run = tmp_path / 'run'
  gin.clear_config()
  del entry_points   # `__main__.train` is the trainer's, as under `python -m upcycle.train`
  gin_utils.parse_files_and_bindings(
      ['models/llama/tiny.gin', 'runs/llm_pretrain.gin', 'data/offline_stdlib_lm.gin'],
      [f"MODEL_DIR = '{run}'", 'TRAIN_STEPS = 2', 'models.LlamaConfig.num_layers = 2',
       'models.LlamaConfig.d_ff = 96'])
  gin_utils.write_config(str(run))   # what the trainer writes at its start
  assert 'optimizer = @optimizers.AdamW()' in (run / 'config.gin').read_text()   # the trainer's
  gin.clear_config()
  config = dataclasses.replace(TINY_LLAMA, num_layers=2, d_ff=96, rope_scaling=None)
  params = _random(config, seed=9)
  _save_run(run, params)
  out = tmp_path / 'hf'
  assert export.main(['--format=hf', f'--model_dir={run}', f'--output_dir={out}']) == 0
  theirs = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
  tokens = _tokens(config.vocab_size)
  _assert_close(llama_logits(params, config, tokens), _torch_logits(theirs, tokens))
  # The card's tokens: step 2 of data/offline_stdlib_lm.gin's 16 rows of 128 positions.
  assert '2 steps of 16 x 128 token positions: 4,096 tokens' in (
      out / 'README.md').read_text()


@pytest.mark.parametrize('name, context', [('llama3_1_8b', 131072), ('llama3_2_1b', 131072),
                                           ('mistral_7b', 32768)])
def test_the_shipped_model_files_export_their_published_context(name, context):
  """config.json's max_position_embeddings for a model file's run with no HF source: the
  published config.json's value (meta-llama/Llama-3.1-8B, Llama-3.2-1B, Mistral-7B-v0.3), not
  a llama3 RoPE's original context times its factor (65536, 262144)."""
  import gin  # pylint: disable=g-import-not-at-top
  from upcycle import gin_utils  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  gin_utils.parse_files_and_bindings([f'models/llama/{name}.gin'], [])
  config = export._model_from_gin().config   # pylint: disable=protected-access
  gin.clear_config()
  hf = llama_hf.hf_config(config, dtype='bfloat16', token_ids={})
  assert hf['max_position_embeddings'] == context


def test_the_source_context_and_dtype_apply_to_its_own_weights_only(tmp_path):
  """A run's tokenizer kept from an HF checkpoint gives the export that checkpoint's eos list
  and pad id; its context and dtype only where the weights are that checkpoint's (its
  hidden_size and vocab_size): a model trained from scratch with its tokenizer keeps its own."""
  config = dataclasses.replace(TINY_LLAMA, num_layers=1, rope_scaling=None)
  run = _save_run(tmp_path / 'run', _random(config, seed=10))
  kept = os.path.join(run, tokenizer_lib.RUN_SUBDIR)
  tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).save(kept)
  source = {'bos_token_id': 1, 'eos_token_id': [2, 7], 'pad_token_id': 0, 'dtype': 'bfloat16',
            'max_position_embeddings': 384, 'vocab_size': 4096}
  for hidden_size, dtype, context in ((32, 'float32', None), (64, 'bfloat16', 384)):
    with open(os.path.join(kept, tokenizer_lib.SOURCE_CONFIG), 'w') as f:
      json.dump(dict(source, hidden_size=hidden_size), f)
    out = hf_export.export(run, str(tmp_path / f'hf{hidden_size}'), model_config=config)
    hf = json.loads(open(os.path.join(out, 'config.json')).read())
    assert (hf['eos_token_id'], hf['pad_token_id'], hf['dtype'],
            hf.get('max_position_embeddings')) == ([2, 7], 0, dtype, context)
