"""Expected parameter shapes of a model config, and configs from checkpoint descriptions.

The one place that turns a T5Config / ViTConfig / LlamaConfig into its parameter tree without
computing anything, and a reader's plain description of a model (`Checkpoint.description`,
e.g. from a HuggingFace config.json) into the config.
"""

from typing import Any, Dict, Mapping, Union

import jax
import jax.numpy as jnp

from upcycle import tree
from upcycle.models.llama import Llama, LlamaConfig
from upcycle.models.t5 import T5, T5Config
from upcycle.models.vit import ViT, ViTConfig

Config = Union[T5Config, ViTConfig, LlamaConfig]
CONFIGS = {'t5': T5Config, 'vit': ViTConfig}


def abstract_params(config: Config) -> Dict[str, Any]:
  """T5Config / ViTConfig / LlamaConfig -> nested dict of `jax.ShapeDtypeStruct`, boxes opened.

  Safe under an active mesh with logical axis rules (no sharding constraint is
  applied to the abstract values).
  """
  rngs = {'params': jax.random.key(0)}
  if isinstance(config, T5Config):
    tokens = jnp.ones((1, 1), jnp.int32)
    init = lambda: T5(config).init(rngs, tokens, tokens)
  elif isinstance(config, LlamaConfig):
    init = lambda: Llama(config).init(rngs, jnp.ones((1, 1), jnp.int32))
  elif isinstance(config, ViTConfig):
    images = jnp.ones((1, *config.image_size, config.num_channels), jnp.float32)
    init = lambda: ViT(config).init(rngs, images)
  else:
    raise TypeError(f'abstract_params: expected a T5Config, ViTConfig or LlamaConfig, got '
                    f'{type(config).__name__}.')
  return tree.unbox(jax.eval_shape(init))['params']


def config_from_description(description: Mapping[str, Any]) -> Config:
  """{'model': 't5' | 'vit', <config field>: value, ...} -> T5Config / ViTConfig;
  {'model': 'llama', 'hf_config': config.json's dict, 'config_path': its path} -> LlamaConfig
  (the Llama-family reader passes config.json as it is: `LlamaConfig.from_hf_config` translates
  it and refuses what the model cannot compute)."""
  fields = dict(description)
  kind = fields.pop('model', None)
  if kind == 'llama':
    return LlamaConfig.from_hf_config(fields['hf_config'], source=fields['config_path'])
  if kind not in CONFIGS:
    raise ValueError(f"config_from_description: 'model' is {kind!r}; expected one of "
                     f"{sorted(CONFIGS) + ['llama']}.")
  return CONFIGS[kind](**fields)
