"""The model-family registry: every family is found from its config or its module, has each
of its facts, and has its entry in every registry above the models that is keyed by its name;
a checkpoint's description or a stray type gets a one-line answer."""

import dataclasses

import pytest

from upcycle import hf_export
from upcycle.checkpoints import describe
from upcycle.models import Llama, LlamaConfig, T5, T5Config, ViT, ViTConfig, families, llama_hf
from upcycle.train import objectives
from upcycle.upcycling import router_init

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


# The families HuggingFace has no writer of ours for, stated (`hf_export.WRITERS` has the rest).
NO_HF_WRITER = {'vit'}
FLOPS_INPUTS = {'t5': (2, 6, 4), 'vit': (3,), 'llama': (2, 8)}   # `forward_flops`' shapes


def _description(name):
  """What a checkpoint reader describes the tiny config of `name` as (an HF Llama: its
  config.json, as `export` writes it)."""
  config = TINY[name]
  if name == 'llama':
    return {'hf_config': llama_hf.hf_config(config, dtype='float32', token_ids={}),
            'config_path': 'config.json'}
  return dataclasses.asdict(config)


def test_every_family_is_registered_in_every_registry_keyed_by_its_name():
  names = {f.name for f in families.FAMILIES}
  assert names == set(TINY)   # a new family gets its tiny config here
  assert {d.name for d in describe.DESCRIBERS} == names
  assert set(hf_export.WRITERS) | NO_HF_WRITER == names
  assert not set(hf_export.WRITERS) & NO_HF_WRITER
  assert {f.objective for f in families.FAMILIES} <= set(objectives.OBJECTIVES)


@pytest.mark.parametrize('name', sorted(TINY))
def test_every_family_has_each_fact(name):
  """Its objective trains its module, its checkpoints' names are told its own, its
  description reads back into its config, it counts its FLOPs, it decodes one way or not."""
  family, config = families.named(name), TINY[name]
  model = family.module(config)
  objective = objectives.of(model)
  assert type(objective) is objectives.OBJECTIVES[family.objective] and objective.model is model
  assert {f.name: f.type for f in dataclasses.fields(objective)}['model'] is family.module
  assert describe.model_kind(families.abstract_params(config)) == name
  assert families.config_from_description({'model': name, **_description(name)}) == config
  assert config.forward_flops(*FLOPS_INPUTS[name]) > 0
  assert family.decodes in ('split', 'prompts', None)
  assert family.upcycle_router in router_init.ROUTER_INITS
  assert isinstance(family.carries_tokenizer, bool)


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
