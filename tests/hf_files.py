"""HuggingFace checkpoints in the exact public format, written by transformers itself."""

import json
import os


def save_untied_t5(model, directory: str, seed: int = 2):
  """Saves `model` (a T5ForConditionalGeneration) as a real T5 v1.1 file: with its own
  `lm_head.weight` (random, from `seed`) and `tie_word_embeddings: false`; returns the model
  re-read with `from_pretrained`, the reference.

  transformers 5 ties lm_head to shared in memory and saves no lm_head; a real v1.1 file
  carries one, and `from_pretrained` then unties it.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  model.save_pretrained(directory)
  state = {k: v.contiguous() for k, v in model.state_dict().items()
           if k not in ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')}
  vocab, d_model = model.shared.weight.shape
  state['lm_head.weight'] = torch.randn(vocab, d_model,
                                        generator=torch.Generator().manual_seed(seed))
  save_file(state, os.path.join(directory, 'model.safetensors'), metadata={'format': 'pt'})
  config_path = os.path.join(directory, 'config.json')
  with open(config_path) as f:
    hf_config = json.load(f)
  hf_config['tie_word_embeddings'] = False
  hf_config.pop('scale_decoder_outputs', None)
  with open(config_path, 'w') as f:
    json.dump(hf_config, f)
  reference = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
  assert not torch.equal(reference.lm_head.weight, reference.shared.weight)
  return reference


def save_perturbed(build, directory: str, seed: int = 1, **save_args):
  """`build()`, a transformers model made under torch seed 0, with its weights perturbed from
  `seed` (`perturb`) and saved to `directory` by `save_pretrained(**save_args)`; returns it
  (eval mode), the reference."""
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = build().eval()
  perturb(model, seed)
  model.save_pretrained(directory, **save_args)
  return model


def perturb(model, seed: int):
  """Adds noise to every weight so that norms' scales and biases are not trivially 1 and 0."""
  import torch  # pylint: disable=g-import-not-at-top
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn(p.shape, generator=generator))


# An HF Llama of settings the model tests do not use: bf16 weights, 6 query heads over 2
# key/value heads, llama3 RoPE, a context of 384 (not the class's 2048), a chat template, an
# eos list and a pad token.
CHAT_LLAMA = dict(vocab_size=4096, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=384, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={'rope_type': 'llama3', 'rope_theta': 50000.0, 'factor': 4.0,
                                   'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                   'original_max_position_embeddings': 32})
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
CHAT_MESSAGES = [{'role': 'user', 'content': 'def f(x):'}]


def save_chat_llama(directory: str):
  """The offline BPE as an HF tokenizer with `CHAT_TEMPLATE`, and a bf16 `CHAT_LLAMA` whose eos
  list [2, E] holds E, a token its greedy continuation of the chat prompt reaches at its 4th
  step or later (so that `generate` has one to stop on), both saved by transformers; -> (the
  tokenizer, the chat prompt's ids, E)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  bpe = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizers.Tokenizer.from_str(bpe.files['tokenizer.json'].decode()),
      bos_token='<s>', eos_token='</s>', pad_token='<pad>')
  tokenizer.chat_template = CHAT_TEMPLATE
  tokenizer.save_pretrained(directory)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      **CHAT_LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
  perturb(model, seed=8)
  model.to(torch.bfloat16).to(torch.float32)   # the values bf16 keeps
  prompt = tokenizer.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True,
                                         return_dict=False)
  with torch.no_grad():
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
  end = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i] and t > 2)
  for config in (model.config, model.generation_config):
    config.eos_token_id = [2, end]
  model.to(torch.bfloat16).save_pretrained(directory)
  return tokenizer, prompt, end
