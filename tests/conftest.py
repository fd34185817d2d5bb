"""Test session setup: 8 simulated CPU devices, so sharding tests can build real meshes, and
session fixtures: tiny HuggingFace T5 v1.1 and ViT checkpoints, built and saved once."""

import json
import os

import pytest

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_flags = os.environ.get('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in _flags:
  _flags += ' --xla_force_host_platform_device_count=8'
if '--xla_backend_optimization_level' not in _flags:
  # Tests compile hundreds of tiny programs: skipping LLVM's optimizations roughly halves
  # compile time and leaves results within the tests' tolerances.
  _flags += ' --xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = _flags.strip()


def _perturb(model, seed: int):
  """Adds noise to every weight so that norms' scales and biases are not trivially 1 and 0."""
  import torch  # pylint: disable=g-import-not-at-top
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope='session')
def hf_t5(tmp_path_factory):
  """(directory, reference torch model) of an untied T5 v1.1 with its own lm_head.weight.

  transformers 5 ties lm_head to shared in memory and saves no lm_head; a real v1.1
  file carries one, so the test file is written with a distinct random lm_head.weight
  and `tie_word_embeddings: false`, and the reference is re-read with from_pretrained.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.T5Config(
      vocab_size=32, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_decoder_layers=2,
      num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
      feed_forward_proj='gated-gelu', tie_word_embeddings=False, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(config)
  _perturb(model, 1)
  directory = str(tmp_path_factory.mktemp('hf_t5'))
  model.save_pretrained(directory)
  state = {k: v.contiguous() for k, v in model.state_dict().items()
           if k not in ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')}
  state['lm_head.weight'] = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
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
  return directory, reference


@pytest.fixture(scope='session')
def hf_vit(tmp_path_factory):
  """(directory, reference torch model) of a tiny ViTForImageClassification."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.ViTConfig(
      hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
      image_size=8, patch_size=4, num_channels=3, num_labels=5, initializer_range=0.2)
  model = transformers.ViTForImageClassification(config).eval()
  _perturb(model, 3)
  directory = str(tmp_path_factory.mktemp('hf_vit'))
  model.save_pretrained(directory)
  return directory, model

