"""The model families, one registration each: the only place that dispatches on a model config.

A family is its config dataclass and flax module (`upcycle.models`), the smallest inputs its
`init` takes (which give its abstract parameters), the objective that trains it and counts
its FLOPs per step (`upcycle.train.objectives`), how it decodes, how its checkpoints
describe it, and its HuggingFace export. Everything else asks `of(config)`:

  family = families.of(config)            # T5Config / ViTConfig / LlamaConfig, or a module
  params = families.abstract_params(config)
  family.objective(model).train_flops(batch)

Adding a family (Qwen-MoE, Gemma) is one module in `upcycle/models/` (a config with
`layer_stacks()`, a module that takes `config`) plus one `Family(...)` in `FAMILIES`; its MLP
leaf names go in `upcycle.upcycling.ffn`'s table if they are new, its HF reader in
`upcycle.checkpoints.hf` by architecture. `tests/test_architecture.py` refuses an `isinstance`
on a model config or module anywhere else.
"""

import dataclasses
import json
import logging
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import tree
from upcycle.checkpoints import hf_llama, hf_qwen2_moe, hf_t5
from upcycle.checkpoints.t5x_export import ExportError
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.models import Llama, LlamaConfig, T5, T5Config, ViT, ViTConfig, llama_hf
from upcycle.train import objectives

log = logging.getLogger(__name__)

# (config.json, {HF tensor name: leaf}, {file name: bytes}) of dense, unrolled params.
HfFiles = Tuple[Dict[str, Any], Dict[str, Any], Dict[str, bytes]]


@dataclasses.dataclass(frozen=True)
class HfExport:
  """How `python -m upcycle.export --format=hf` writes a family.

  check: config -> None; raises ExportError / fields.ConfigError, in one line, for a config
    HuggingFace has no class for (called before any array is read).
  files: (params, config, source checkpoint path) -> HfFiles.
  """
  check: Callable[[Any], None]
  files: Callable[[Mapping[str, Any], Any, str], HfFiles]


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  name: what a checkpoint's description calls it (`Checkpoint.description['model']`).
  config, module: the config dataclass and the flax module built from it (`module(config)`).
  example_inputs: config -> the smallest positional inputs `module.init` takes.
  from_description: a reader's description, 'model' removed -> config.
  objective: the `upcycle.train.objectives` class that trains it (its models/*/architecture.gin
    binds OBJECTIVE to it): inputs from a batch, the loss, `train_flops` per step.
  decodes: what `python -m upcycle.infer` gives it: 'split' (a task split's inputs,
    runs/infer.gin), 'prompts' (continued, runs/llm_infer.gin) or None (not decoded).
  hf_export: its HuggingFace writer, or None.
  upcycle_router: the router initializer of the family's upcycling recipe, `convert`'s
    default (runs/upcycle.gin and vit_upcycle.gin: 'normal', the paper's; runs/llm_upcycle.gin:
    'uniform', Drop-Upcycling's).
  """
  name: str
  config: type
  module: type
  example_inputs: Callable[[Any], Tuple[jax.Array, ...]]
  from_description: Callable[[Dict[str, Any]], Any]
  objective: type
  decodes: Optional[str]
  hf_export: Optional[HfExport]
  upcycle_router: str


def _dtype(params: Mapping[str, Any]) -> str:
  return np.dtype(params['token_embedder']['embedding'].dtype).name


def _t5_hf_check(config: T5Config) -> None:
  if config.encoder_moe or config.decoder_moe:
    raise ExportError('an MoE T5 has no HuggingFace class (T5ForConditionalGeneration is '
                      'dense). Fix: export it with --format=t5x (Flaxformer\'s MoE names).')


def _t5_hf_files(params: Mapping[str, Any], config: T5Config, source: str) -> HfFiles:
  hf_config = hf_t5.hf_config(dataclasses.asdict(config), dtype=_dtype(params))
  return hf_config, hf_t5.to_hf(params, source), {}


def _generation_config(tokenizer: tokenizer_lib.Tokenizer, ids: Mapping[str, Any]) -> bytes:
  """generation_config.json: the source's, kept beside the run's tokenizer, else the ids
  `generate` stops on and pads with (`ids`, config.json's)."""
  kept = tokenizer.files.get('generation_config.json')
  return kept if kept is not None else json.dumps(dict(ids), indent=2).encode('utf-8')


def _weights_source(tokenizer: tokenizer_lib.Tokenizer, config: LlamaConfig) -> Dict[str, Any]:
  """The config.json of the HF checkpoint the tokenizer came from where the weights came from
  it too (its hidden_size and vocab_size the model's), else {}: a model trained from scratch
  with an HF model's tokenizer takes that model's token ids, not its context or dtype."""
  kept = tokenizer_lib.source_config(tokenizer)
  same = (kept.get('hidden_size'), kept.get('vocab_size')) == (config.d_model, config.vocab_size)
  return kept if same else {}


def _llama_hf_files(params: Mapping[str, Any], config: LlamaConfig, source: str) -> HfFiles:
  """config.json with the token ids of the HF checkpoint the run's tokenizer came from
  (`tokenizer.hf_ids`) and the context length and dtype of the one its weights came from
  (`_weights_source`), else the tokenizer's own ids and the stored dtype; the tokenizer's
  files and companions (chat template) and generation_config.json. None of them, with a
  warning, where the source keeps no tokenizer; `tokenizer.TokenizerError` where the
  tokenizer it keeps is not the one its weights were trained with (a replaced tokenizer/)."""
  try:
    tokenizer = tokenizer_lib.load(source)
  except tokenizer_lib.TokenizerError as e:
    log.warning('Exporting %s without a tokenizer (config.json gets no BOS / EOS ids): %s',
                source, e)
    tokenizer = None
  else:
    from upcycle import pretrained  # pylint: disable=g-import-not-at-top  (pretrained imports this)
    pretrained.check_trained(
        tokenizer, source, binding='The HF export',
        fix=f'put the tokenizer {source} was trained with in {tokenizer.source}.')
  ids = {} if tokenizer is None else tokenizer_lib.hf_ids(tokenizer)
  kept = {} if tokenizer is None else _weights_source(tokenizer, config)
  hf_config = llama_hf.hf_config(
      config, dtype=kept.get('dtype') or kept.get('torch_dtype') or _dtype(params),
      token_ids=ids, max_position_embeddings=kept.get('max_position_embeddings'))
  files = {}
  if tokenizer is not None:
    files = {name: data for name, data in tokenizer.files.items()
             if name != tokenizer_lib.SOURCE_CONFIG}
    files['generation_config.json'] = _generation_config(tokenizer, ids)
  if hf_config['model_type'] == 'qwen2_moe':   # its gated shared expert: hf_qwen2_moe
    return hf_config, hf_qwen2_moe.to_hf(params, source), files
  return hf_config, hf_llama.to_hf(params, source, hf_config['architectures'][0]), files


def _tokens(config: Any) -> Tuple[jax.Array, ...]:
  return (jnp.ones((1, 1), jnp.int32),)


FAMILIES = (
    Family(name='t5', config=T5Config, module=T5,
           example_inputs=lambda config: _tokens(config) * 2,
           from_description=lambda fields: T5Config(**fields),
           objective=objectives.Seq2Seq, decodes='split',
           hf_export=HfExport(check=_t5_hf_check, files=_t5_hf_files),
           upcycle_router='normal'),
    Family(name='vit', config=ViTConfig, module=ViT,
           example_inputs=lambda config: (
               jnp.ones((1, *config.image_size, config.num_channels), jnp.float32),),
           from_description=lambda fields: ViTConfig(**fields),
           objective=objectives.Classification, decodes=None, hf_export=None,
           upcycle_router='normal'),
    Family(name='llama', config=LlamaConfig, module=Llama, example_inputs=_tokens,
           from_description=lambda fields: LlamaConfig.from_hf_config(
               fields['hf_config'], source=fields['config_path']),
           objective=objectives.CausalLm, decodes='prompts',
           hf_export=HfExport(check=llama_hf.hf_model_type, files=_llama_hf_files),
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
