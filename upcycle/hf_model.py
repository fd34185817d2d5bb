"""A HuggingFace directory as the model: its config.json is the model config, its tokenizer
files the tokenizer (`configs/models/hf.gin`, `--gin.HF_MODEL=<directory or gs://...>`).

  config = hf_model.model_config('/ckpt/llama', base=LlamaConfig(dtype='bfloat16'))
  print(hf_model.gin_file('/ckpt/llama'))   # the model file of the same model, to edit

config.json decides every field it describes (`llama_hf.config_fields`: sizes, RoPE and its
scaling, epsilon, tied embeddings, biases, sliding window, context length, a Mixtral's or
Qwen2-MoE's MoE block); the run's gin decides the rest (activation dtype, scanned layers,
remat, the attention kernel, dropout, and the MoE a dense source is upcycled into). A gin
binding of a field config.json decides, to another value, is refused in one line: two
descriptions of one model would disagree.
"""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence

from etils import epath

from upcycle import fields
from upcycle.models import LlamaConfig, llama_hf

MACRO = 'HF_MODEL'
MODEL_FILE = 'models/hf.gin'
# What the run decides (config.json does not describe them).
_RUN_FIELDS = ('dtype', 'dropout_rate', 'attention', 'scan_layers', 'remat_policy')


def _named(path: str, named: Optional[str]) -> str:
  return named or f'{MACRO} = {path!r}'


def read_config_json(path: str, named: Optional[str] = None) -> Dict[str, Any]:
  """`<path>/config.json` as a dict; one-line ConfigError starting with `named` (default:
  the HF_MODEL binding) where it is missing or unreadable."""
  config_path = os.path.join(os.fspath(path), 'config.json')
  try:
    return json.loads(epath.Path(config_path).read_text())
  except FileNotFoundError:
    raise fields.ConfigError(
        f'{_named(path, named)}: no config.json there. Fix: give the HuggingFace directory '
        f'that holds config.json, the weights and the tokenizer files.') from None
  except (OSError, ValueError) as e:
    raise fields.ConfigError(
        f'{_named(path, named)}: cannot read {config_path} ({e}). Fix: give a directory '
        f'transformers\' save_pretrained wrote.') from None


def described_fields(path: str, named: Optional[str] = None) -> Dict[str, Any]:
  """{LlamaConfig field: value} that `path`'s config.json decides; the MoE fields only for an
  MoE checkpoint. One-line ConfigError (starting with `named`, default the HF_MODEL binding)
  for a model_type this model does not compute."""
  hf = read_config_json(path, named)
  source = os.path.join(os.fspath(path), 'config.json')
  if hf.get('model_type') not in llama_hf.MODEL_TYPES:
    raise fields.ConfigError(
        f'{_named(path, named)}: {source} has "model_type": {hf.get("model_type")!r}; '
        f'{MODEL_FILE} reads the decoder-only ones ({", ".join(llama_hf.MODEL_TYPES)}). Fix: '
        f'give that family\'s model file (configs/models/) instead.')
  described = llama_hf.config_fields(hf, source=source)
  if described['moe'] is None:
    del described['moe'], described['moe_layers']   # a dense source: the run's MoE
  return described


def model_config(path: str, base: LlamaConfig, bound: Sequence[str] = ()) -> LlamaConfig:
  """`base` (the run's config: the gin bindings of `models.LlamaConfig`) with every field
  `path`'s config.json decides taken from it (`described_fields`).

  A field the run set (named in `bound`, the fields its gin binds: `models/hf.gin` passes
  `gin_utils.bound_parameters`; or set to other than the class default) to a value other than
  config.json's is refused in one line naming its binding (a size file beside HF_MODEL, even
  one whose values are the class defaults); an MoE checkpoint's MoE comes from its
  config.json, so a bound `moe` that is not that block is refused there too. A gin that binds
  every field, as a run's operative_config.gin does, is told to give the run's config.gin.
  """
  described = described_fields(path)
  default = type(base)()
  # A run's operative_config.gin binds every field (gin records the class as it was called:
  # the base, not the model); a size file binds a few.
  operative = {f.name for f in dataclasses.fields(base) if f.init} <= set(bound)
  for name, theirs in described.items():
    ours = getattr(base, name)
    if ours != theirs and (name in bound or ours != getattr(default, name)):
      shown = 'an MoE block' if name == 'moe' else repr(ours)
      fix = (f'every field of {fields.binding(base, name).rsplit(".", 1)[0]} is bound, as a '
             f"run's operative_config.gin binds them (the base {MODEL_FILE} started from, not "
             "the model). Fix: give that run's config.gin instead" if operative else
             f'Fix: drop that binding (a models/ size or moe/ file given beside {MODEL_FILE}), '
             f'or drop {MODEL_FILE} and write the model file yourself')
      raise fields.ConfigError(
          f'{fields.binding(base, name)} = {shown}, but {MACRO}\'s config.json '
          f'({os.path.join(os.fspath(path), "config.json")}) gives the model, and says '
          f'{theirs!r}{"; " if operative else ". "}{fix}.')
  return dataclasses.replace(base, **described)


def operative_config_note(path: str) -> str:
  """The comment above the operative_config.gin of a run whose model is `path`'s config.json
  (`models/hf.gin`): gin records `models.LlamaConfig` as it was called, the base the run
  started from (the class defaults where it bound nothing), not the model."""
  return (f'# The model is {MACRO} = {path!r}: its config.json gave every field it describes\n'
          f'# ({MODEL_FILE}). The models.LlamaConfig parameters below are the base the run\n'
          f'# started from (the class defaults where it bound nothing), not the model: given\n'
          f"# again this file is refused. The run's config.gin holds what it bound (eval, infer\n"
          f'# and export read it); `python -m upcycle.describe {path} --gin` prints the model\n'
          f'# as a gin file.\n\n')


def gin_file(path: str, named: Optional[str] = None) -> str:
  """The model file (gin) of `path`'s config.json: architecture.gin with every field config.json
  decides bound, and its tokenizer; an MoE checkpoint's block as `moe/mixtral.gin` with its
  sizes (a Qwen2-MoE block has no file: use `models/hf.gin`). `named`: as `described_fields`'s."""
  described = described_fields(path, named)
  moe = described.pop('moe', None)
  described.pop('moe_layers', None)
  lines: List[str] = [
      f'# The model of {os.path.join(os.fspath(path), "config.json")} '
      f'(python -m upcycle.describe {path} --gin).',
      'from __gin__ import dynamic_registration', 'from upcycle import models', '',
      "include 'models/llama/architecture.gin'"]
  if moe is not None:
    if moe != llama_hf.mixtral_moe(moe.num_experts, moe.router.k, moe.balance.weight):
      raise fields.ConfigError(
          f'{_named(path, named)}: its MoE block (Qwen2-MoE\'s) has no model file here. Fix: use '
          f'--gin_file={MODEL_FILE} --gin.{MACRO}="\'{path}\'" instead of a written file.')
    lines += ["include 'moe/mixtral.gin'", '', f'NUM_EXPERTS = {moe.num_experts}',
              f'EXPERTS_PER_TOKEN = {moe.router.k}',
              f'ROUTER_AUX_LOSS_COEF = {moe.balance.weight!r}']
  lines += ['', f'TOKENIZER = {os.fspath(path)!r}', '', 'models.LlamaConfig:']
  scaling = described.pop('rope_scaling')
  lines += [f'  {name} = {value!r}' for name, value in described.items()]
  if scaling is not None:
    lines += ['  rope_scaling = @models.Llama3RopeScaling()', 'models.Llama3RopeScaling:']
    lines += [f'  {f.name} = {getattr(scaling, f.name)!r}'
              for f in dataclasses.fields(scaling)]
  return '\n'.join(lines) + '\n'
