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
