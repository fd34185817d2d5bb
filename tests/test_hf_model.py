"""A HuggingFace directory as the model (`models/hf.gin`, `--gin.HF_MODEL`): its config.json
is the model and its files the tokenizer, from the directory to a trained MoE and back to
transformers with no gin file written by hand. References: the literal settings the directory
was saved with (`hf_files.CHAT_LLAMA`), transformers' logits, `generate` and chat template."""

import json
import os

import gin
import jax
import numpy as np
import pytest

from tests import hf_files
from tests.helpers import refusal
from tests.models.helpers import llama_logits
from upcycle import convert, describe, export, gin_utils, pretrained
from upcycle import infer as infer_main
from upcycle.models import Llama3RopeScaling
from upcycle.train import __main__ as train_main

MAX_NEW = 12


@pytest.fixture(scope='module')
def chat_llama(tmp_path_factory):
  """(directory, transformers' tokenizer, the chat prompt's ids, the eos list's second id)."""
  directory = str(tmp_path_factory.mktemp('chat_llama'))
  return (directory, *hf_files.save_chat_llama(directory))


def _model_config(files, bindings):
  gin.clear_config()
  try:
    gin_utils.parse_files_and_bindings(files, bindings)
    return convert.target_from_gin()
  finally:
    gin.clear_config()


def test_config_json_gives_the_model_and_the_run_the_rest(chat_llama):
  config = _model_config(['models/hf.gin', 'moe/mixtral.gin'], [
      f"HF_MODEL = '{chat_llama[0]}'", "ACTIVATION_DTYPE = 'bfloat16'", 'SCAN_LAYERS = True',
      'NUM_EXPERTS = 4'])
  # CHAT_LLAMA's settings, as transformers saved them.
  assert (config.vocab_size, config.d_model, config.num_heads, config.num_kv_heads,
          config.head_dim, config.d_ff, config.num_layers) == (4096, 48, 6, 2, 8, 96, 2)
  assert (config.rope_theta, config.rope_scaling) == (50000.0, Llama3RopeScaling(4.0, 1.0, 4.0,
                                                                                 32))
  assert (config.layer_norm_epsilon, config.logits_via_embedding,
          config.max_position_embeddings) == (1e-5, False, 384)
  # The run's: activations, scanning, the MoE the dense source becomes.
  assert (config.dtype, config.scan_layers, config.moe.num_experts, config.moe.router.k,
          config.moe_layers) == ('bfloat16', True, 4, 2, 'all')


def test_describe_prints_a_model_file_of_transformers_logits(chat_llama, tmp_path, capsys):
  """`describe DIR --gin`'s file, parsed alone, is a model whose logits on the directory's
  weights are LlamaForCausalLM's."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  directory = chat_llama[0]
  capsys.readouterr()
  assert describe.main([directory, '--gin']) == 0
  (tmp_path / 'model.gin').write_text(capsys.readouterr().out)
  config = _model_config([str(tmp_path / 'model.gin')], [])
  params = jax.tree.map(lambda x: np.asarray(x, np.float32),
                        pretrained.load(directory, model_config=config).params)
  tokens = np.random.default_rng(0).integers(0, 4096, (2, 40))
  theirs = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(llama_logits(params, config, tokens), want, atol=1e-4, rtol=1e-4)


def test_what_disagrees_with_the_directory_is_refused_in_one_line(chat_llama, tmp_path, capsys,
                                                                  entry_points):
  del entry_points
  directory = chat_llama[0]
  run = ['--gin_file=runs/llm_pretrain.gin', '--gin_file=data/offline_stdlib_lm.gin',
         f"--gin.MODEL_DIR='{tmp_path / 'run'}'", '--gin.TRAIN_STEPS=1']
  # A size file beside models/hf.gin: its d_model is not the directory's.
  assert refusal(train_main.main, ['--gin_file=models/llama/tiny.gin',
                                    '--gin_file=models/hf.gin', *run,
                                    f"--gin.HF_MODEL='{directory}'"], capsys) == (
      f"error: models.LlamaConfig.d_model = 64, but HF_MODEL's config.json "
      f"({directory}/config.json) gives the model, and says 48. Fix: drop that binding (a "
      f"models/ size or moe/ file given beside models/hf.gin), or drop models/hf.gin and write "
      f"the model file yourself.")
  # Llama-2-7B's sizes, which are models.LlamaConfig's defaults: bound, so refused as well.
  assert refusal(train_main.main, ['--gin_file=models/hf.gin', *run,
                                    f"--gin.HF_MODEL='{directory}'",
                                    '--gin.models.LlamaConfig.num_layers=32'], capsys) == (
      f"error: models.LlamaConfig.num_layers = 32, but HF_MODEL's config.json "
      f"({directory}/config.json) gives the model, and says 2. Fix: drop that binding (a "
      f"models/ size or moe/ file given beside models/hf.gin), or drop models/hf.gin and write "
      f"the model file yourself.")
  assert refusal(train_main.main, ['--gin_file=models/hf.gin', *run,
                                    f"--gin.HF_MODEL='{tmp_path}'"], capsys) == (
      f"error: HF_MODEL = '{tmp_path}': no config.json there. Fix: give the HuggingFace "
      f"directory that holds config.json, the weights and the tokenizer files.")
  t5 = tmp_path / 't5'
  t5.mkdir()
  (t5 / 'config.json').write_text(json.dumps({'model_type': 't5'}))
  assert refusal(train_main.main, ['--gin_file=models/hf.gin', *run,
                                    f"--gin.HF_MODEL='{t5}'"], capsys) == (
      f"error: HF_MODEL = '{t5}': {t5}/config.json has \"model_type\": 't5'; models/hf.gin "
      f"reads the decoder-only ones (llama, mistral, qwen2, mixtral, qwen2_moe). Fix: give "
      f"that family's model file (configs/models/) instead.")


def test_a_mixtral_directory_gives_its_moe_block(tmp_path):
  """A MixtralForCausalLM config.json's block (4 experts, top 2, aux 0.01) is the model's; a
  moe/ file beside it is refused unless it is that block."""
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle import fields  # pylint: disable=g-import-not-at-top
  from upcycle.models import llama_hf  # pylint: disable=g-import-not-at-top
  transformers.MixtralConfig(
      vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
      num_experts_per_tok=2, router_aux_loss_coef=0.01).save_pretrained(tmp_path)
  model = ["HF_MODEL = '%s'" % tmp_path]
  assert _model_config(['models/hf.gin'], model).moe == llama_hf.mixtral_moe(4, 2, 0.01)
  assert _model_config(['models/hf.gin', 'moe/mixtral.gin'], model + [
      'NUM_EXPERTS = 4', 'ROUTER_AUX_LOSS_COEF = 0.01']).moe == llama_hf.mixtral_moe(4, 2, 0.01)
  with pytest.raises(fields.ConfigError, match=(
      r"^models.LlamaConfig.moe = an MoE block, but HF_MODEL's config.json \(.*/config.json\) "
      r"gives the model, and says MoeConfig\(num_experts=4, .*\. Fix: drop that binding")):
    _model_config(['models/hf.gin', 'moe/mixtral.gin'], model)


def _infer(checkpoint, output_dir, prompt_text, *model_flags):
  """`python -m upcycle.infer`'s greedy record of one prompt, in process."""
  prompts = os.path.join(output_dir, 'prompts.jsonl')
  os.makedirs(output_dir, exist_ok=True)
  with open(prompts, 'w') as f:
    f.write(json.dumps({'prompt': prompt_text}) + '\n')
  gin.clear_config(clear_constants=True)   # what an earlier entry point in process left
  try:
    path = infer_main.main([
        *model_flags, '--gin_file=runs/llm_infer.gin', f"--gin.CHECKPOINT_PATH='{checkpoint}'",
        f"--gin.MODEL_DIR='{output_dir}'", f"--gin.PROMPTS_FILE='{prompts}'",
        '--gin.BATCH_SIZE=1', f'--gin.MAX_DECODE_LENGTH={MAX_NEW}'])
  finally:
    gin.clear_config(clear_constants=True)
  with open(path) as f:
    (record,) = [json.loads(line) for line in f]
  return record


def _generate(directory, prompt):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                            dtype=torch.float32).eval()
  assert type(model).__name__ == 'MixtralForCausalLM'
  with torch.no_grad():
    return model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                          do_sample=False)[0, len(prompt):].tolist()


def _assert_carries_the_source(out, source):
  """config.json and generation_config.json carry the source's values; the chat template
  renders as the source's."""
  import transformers  # pylint: disable=g-import-not-at-top
  hf = json.loads(open(os.path.join(out, 'config.json')).read())
  want = json.loads(open(os.path.join(source, 'config.json')).read())
  for key in ('bos_token_id', 'eos_token_id', 'pad_token_id', 'max_position_embeddings',
              'rope_parameters'):
    assert hf[key] == want[key], key
  assert (hf['pad_token_id'], hf['max_position_embeddings'], hf['output_router_logits'],
          hf['num_local_experts']) == (0, 384, True, 4)
  assert json.loads(open(os.path.join(out, 'generation_config.json')).read()) == json.loads(
      open(os.path.join(source, 'generation_config.json')).read())
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  source_tokenizer = transformers.AutoTokenizer.from_pretrained(source)
  assert tokenizer.apply_chat_template(hf_files.CHAT_MESSAGES, add_generation_prompt=True,
                                       tokenize=False) == (
      source_tokenizer.apply_chat_template(hf_files.CHAT_MESSAGES, add_generation_prompt=True,
                                           tokenize=False))
  return hf


HF_MOE = ('--gin_file=models/hf.gin', '--gin_file=moe/mixtral.gin', '--gin.NUM_EXPERTS=4')


@pytest.mark.slow   # 40 s: convert, export, generate and an MoE decode compiled
def test_a_chat_llama_converted_and_exported_keeps_what_chat_users_rely_on(chat_llama,
                                                                           tmp_path,
                                                                           entry_points):
  """HF Llama (bf16, GQA, llama3 RoPE, chat template, eos list, pad, context 384) -> convert
  with models/hf.gin (4 copied experts, the bf16 values cast exactly) -> export (its model
  the one convert's config.gin keeps): transformers loads it with AutoTokenizer and
  AutoModelForCausalLM, the chat template renders as the source's, config.json and
  generation_config.json carry the source's values, the weights are bf16 (the source's
  dtype), and `generate` stops on the eos list's second id after the tokens
  `python -m upcycle.infer` gives for the same chat prompt."""
  del entry_points
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  source, source_tokenizer, prompt, end = chat_llama
  moe, out = str(tmp_path / 'moe'), str(tmp_path / 'hf')
  assert convert.main([f'--source={source}', f'--output_dir={moe}', *HF_MOE,
                       f"--gin.HF_MODEL='{source}'"]) == 0
  assert export.main(['--format=hf', f'--model_dir={moe}', f'--output_dir={out}']) == 0
  hf = _assert_carries_the_source(out, source)
  assert (hf['eos_token_id'], hf['dtype']) == ([2, end], 'bfloat16')
  with safe_open(os.path.join(out, 'model.safetensors'), 'np') as f:
    assert {f.get_slice(name).get_dtype() for name in f.keys()} == {'BF16'}
  card = open(os.path.join(out, 'README.md')).read()
  assert 'library_name: transformers' in card and '4 experts, top 2 per token' in card
  report = open(os.path.join(moe, 'upcycling_report.txt')).read()
  assert report.split('\n\n')[0] in card   # convert's summary: method, source, experts
  assert 'cast bfloat16 -> float32 (exact)' in report

  theirs = _generate(out, prompt)
  assert theirs[-1] == end and len(theirs) < MAX_NEW   # stopped on the list's second id
  # The chat prompt as text: infer frames it with BOS, as the template's leading '<s>'.
  text = source_tokenizer.apply_chat_template(hf_files.CHAT_MESSAGES, add_generation_prompt=True,
                                              tokenize=False)
  ours = _infer(moe, str(tmp_path / 'infer'), text[len('<s>'):], *HF_MOE,
                f"--gin.HF_MODEL='{source}'")
  assert ours['prompt_tokens'] == prompt
  assert ours['prediction_tokens'] == theirs


@pytest.mark.slow   # 50 s: an upcycle, two steps, an export and a decode
def test_a_drop_upcycled_mixtral_trained_from_the_directory_goes_back_to_transformers(
    chat_llama, tmp_path, capsys, entry_points):
  """The restore hook: models/hf.gin + moe/mixtral.gin + runs/llm_upcycle.gin +
  upcycling/drop.gin with HF_MODEL the directory trains 2 steps (the directory's tokenizer,
  its bf16 weights cast exactly, Drop-Upcycling's redrawn units); `export --model_dir` of the
  run (float32) loads in transformers with the source's settings, and `generate`'s greedy
  tokens are `python -m upcycle.infer`'s on the run. Its operative_config.gin, which gin
  writes with every `models.LlamaConfig` parameter at the class default (the base, not the
  model), says so at its top, and given again is refused naming the run's config.gin."""
  del entry_points
  source = chat_llama[0]
  run, out = str(tmp_path / 'run'), str(tmp_path / 'hf')
  model = (*HF_MOE, f"--gin.HF_MODEL='{source}'")
  train_main.main([*model, '--gin_file=runs/llm_upcycle.gin', '--gin_file=upcycling/drop.gin',
                   '--gin_file=data/offline_stdlib_lm.gin',
                   '--gin.INITIAL_CHECKPOINT_PATH=%HF_MODEL',
                   f"--gin.MODEL_DIR='{run}'", '--gin.TRAIN_STEPS=2', '--gin.BATCH_SIZE=8',
                   "--gin.TASK_FEATURE_LENGTHS={'targets': 64}", '--gin.EVAL_STEPS=1'])
  gin.clear_config(clear_constants=True)
  operative = os.path.join(run, 'operative_config.gin')
  assert open(operative).readline() == (f"# The model is HF_MODEL = '{source}': its config.json "
                                        'gave every field it describes\n')
  assert refusal(train_main.main, [f'--gin_file={operative}',
                                    f"--gin.MODEL_DIR='{tmp_path / 'again'}'"], capsys) == (
      f"error: models.LlamaConfig.vocab_size = 32000, but HF_MODEL's config.json "
      f"({source}/config.json) gives the model, and says 4096; every field of "
      f"models.LlamaConfig is bound, as a run's operative_config.gin binds them (the base "
      f"models/hf.gin started from, not the model). Fix: give that run's config.gin instead.")
  report = open(os.path.join(run, 'upcycling_report.txt')).read()
  assert 'Drop(' in report and 'cast bfloat16 -> float32 (exact)' in report
  assert export.main(['--format=hf', f'--model_dir={run}', f'--output_dir={out}',
                      '--dtype=float32']) == 0
  assert _assert_carries_the_source(out, source)['dtype'] == 'float32'
  ours = _infer(os.path.join(run, 'checkpoints'), str(tmp_path / 'infer'),
                hf_files.CHAT_MESSAGES[0]['content'], *model)
  theirs = _generate(out, ours['prompt_tokens'])
  assert ours['prediction_tokens'] == theirs
