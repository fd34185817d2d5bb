"""The model families, one registration each: the only place that dispatches on a model config.

A family is its config dataclass and flax module (this package's `t5`, `vit`, `llama`), the
smallest inputs its `init` takes (which give its abstract parameters), its config from a
checkpoint's description (the HuggingFace facts its config reads: `T5Config(**fields)`,
`LlamaConfig.from_hf_config`), the objective that trains it (named; `upcycle.train.objectives`
holds the classes), how it decodes, whether its checkpoints carry their tokenizer, and its
upcycling recipe's router. Its FLOPs per step are its config's (`forward_flops`). Everything
else asks `of(config)`:

  family = families.of(config)            # T5Config / ViTConfig / LlamaConfig, or a module
  params = families.abstract_params(config)
  objectives.of(model).train_flops(batch)

The registry sits beside the models, below the trainer and the wiring, and imports nothing
above `models`: what a family needs from above is keyed by its `name` there and checked by
`tests/test_families.py` for every family (its objective in `objectives.OBJECTIVES`, its
parameter names in `upcycle.checkpoints.describe.DESCRIBERS`, its HuggingFace writer in
`upcycle.hf_export.WRITERS` or stated absent). `tests/test_architecture.py` refuses an
`isinstance` on a model config or module anywhere else.
"""

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from upcycle import tree
from upcycle.models.llama import Llama, LlamaConfig
from upcycle.models.t5 import T5, T5Config
from upcycle.models.vit import ViT, ViTConfig


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  name: what a checkpoint's description calls it (`Checkpoint.description['model']`), and the
    key of its entries in the registries above the models (`objectives`, `describe`,
    `hf_export`).
  config, module: the config dataclass and the flax module built from it (`module(config)`).
  example_inputs: config -> the smallest positional inputs `module.init` takes.
  from_description: a reader's description, 'model' removed -> config.
  objective: the name of the `upcycle.train.objectives` class that trains it (its
    models/*/architecture.gin binds OBJECTIVE to it): inputs from a batch, the loss,
    `train_flops` per step.
  decodes: what `python -m upcycle.infer` gives it: 'split' (a task split's inputs,
    runs/infer.gin), 'prompts' (continued, runs/llm_infer.gin) or None (not decoded).
  carries_tokenizer: its checkpoints carry the tokenizer their weights were trained with (an
    HF directory's files, a run's `tokenizer/`), which `convert` and the HF export keep.
  upcycle_router: the router initializer of the family's upcycling recipe, `convert`'s
    default (runs/upcycle.gin and vit_upcycle.gin: 'normal', the paper's; runs/llm_upcycle.gin:
    'uniform', Drop-Upcycling's).
  """
  name: str
  config: type
  module: type
  example_inputs: Callable[[Any], Tuple[jax.Array, ...]]
  from_description: Callable[[Dict[str, Any]], Any]
  objective: str
  decodes: Optional[str]
  carries_tokenizer: bool
  upcycle_router: str


def _tokens(config: Any) -> Tuple[jax.Array, ...]:
  return (jnp.ones((1, 1), jnp.int32),)


FAMILIES = (
    Family(name='t5', config=T5Config, module=T5,
           example_inputs=lambda config: _tokens(config) * 2,
           from_description=lambda fields: T5Config(**fields),
           objective='Seq2Seq', decodes='split', carries_tokenizer=False,
           upcycle_router='normal'),
    Family(name='vit', config=ViTConfig, module=ViT,
           example_inputs=lambda config: (
               jnp.ones((1, *config.image_size, config.num_channels), jnp.float32),),
           from_description=lambda fields: ViTConfig(**fields),
           objective='Classification', decodes=None, carries_tokenizer=False,
           upcycle_router='normal'),
    Family(name='llama', config=LlamaConfig, module=Llama, example_inputs=_tokens,
           from_description=lambda fields: LlamaConfig.from_hf_config(
               fields['hf_config'], source=fields['config_path']),
           objective='CausalLm', decodes='prompts', carries_tokenizer=True,
           upcycle_router='uniform'),
)


def of(model_or_config: Any) -> Family:
  """The family of a config (T5Config, ...) or of a module built from one (`.config`)."""
  config = getattr(model_or_config, 'config', model_or_config)
  for family in FAMILIES:
    if isinstance(config, family.config):
      return family
  names = ', '.join(f.config.__name__ for f in FAMILIES)
  raise TypeError(f'expected a model config ({names}) or a module built from one, got '
                  f'{type(model_or_config).__name__}.')


def named(name: Optional[str]) -> Family:
  """The family a checkpoint description names ('t5', 'vit', 'llama')."""
  for family in FAMILIES:
    if family.name == name:
      return family
  raise ValueError(f"a checkpoint description's 'model' is {name!r}; expected one of "
                   f'{[f.name for f in FAMILIES]}.')


def logical_params(config: Any) -> Dict[str, Any]:
  """A model config -> its parameters as `jax.ShapeDtypeStruct`s in their logical-axis boxes
  (`nn.LogicallyPartitioned`, what `partitioning.logical_sharding` reads); nothing computed.

  Safe under an active mesh with logical axis rules (no sharding constraint is applied to
  the abstract values).
  """
  family = of(config)
  init = lambda: family.module(config).init({'params': jax.random.key(0)},
                                            *family.example_inputs(config))
  return jax.eval_shape(init)['params']


def abstract_params(config: Any) -> Dict[str, Any]:
  """A model config -> nested dict of `jax.ShapeDtypeStruct`, boxes opened."""
  return tree.unbox(logical_params(config))


def config_from_description(description: Mapping[str, Any]) -> Any:
  """A checkpoint's description -> its model config: {'model': 't5' | 'vit', <config field>:
  value, ...}, or {'model': 'llama', 'hf_config': config.json's dict, 'config_path': its path}
  (`LlamaConfig.from_hf_config` translates config.json and refuses what it cannot compute)."""
  fields = dict(description)
  return named(fields.pop('model', None)).from_description(fields)
