"""The model-family registry: every family is found from its config or its module, and a
checkpoint's description or a stray type gets a one-line answer."""

import pytest

from upcycle import families
from upcycle.models import Llama, LlamaConfig, T5, T5Config, ViT, ViTConfig

TINY = {'t5': T5Config(vocab_size=8, d_model=4, d_ff=8, num_heads=1, d_kv=4,
                       num_encoder_layers=1, num_decoder_layers=1),
        'vit': ViTConfig(num_classes=3, image_size=(4, 4), patch_size=(2, 2), width=4,
                         mlp_dim=8, num_heads=1, depth=1),
        'llama': LlamaConfig(vocab_size=8, d_model=4, d_ff=8, num_heads=1, num_kv_heads=1,
                             head_dim=4, num_layers=1)}
MODULES = {'t5': T5, 'vit': ViT, 'llama': Llama}


@pytest.mark.parametrize('name', sorted(TINY))
def test_a_family_is_found_from_its_config_its_module_and_its_name(name):
  config = TINY[name]
  family = families.of(config)
  assert family.name == name and family.module is MODULES[name]
  assert families.of(MODULES[name](config)) is family is families.named(name)


def test_the_abstract_parameters_are_those_init_makes():
  """Closed form for the tiny T5: embedding 8x4, one encoder and decoder layer, own lm_head."""
  shapes = {'/'.join(k): v.shape for k, v in _flat(families.abstract_params(TINY['t5'])).items()}
  assert shapes['token_embedder/embedding'] == (8, 4)
  assert shapes['encoder/layers_0/mlp/wi_0/kernel'] == (4, 8)
  assert shapes['decoder/logits_dense/kernel'] == (4, 8)


def _flat(tree, prefix=()):
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


def test_anything_else_is_named():
  with pytest.raises(TypeError, match=r'expected a model config \(T5Config, ViTConfig, '
                     r'LlamaConfig\) or a module built from one, got dict'):
    families.of({'d_model': 4})
  with pytest.raises(ValueError, match=r"'model' is 'gpt2'; expected one of \['t5', 'vit', "
                     r"'llama'\]"):
    families.config_from_description({'model': 'gpt2'})
