"""HuggingFace checkpoints: `config.json` + safetensors (single or sharded) or `pytorch_model.bin`.

`load_checkpoint(path)` returns the parameters in this project's names (docs/checkpoints.md,
"Parameter names") and, as `Checkpoint.description`, the T5Config / ViTConfig fields that reproduce
the HuggingFace model's logits (`upcycle.pretrained.load_hf` makes the config and checks the
shapes). Supported:
`T5ForConditionalGeneration` with `feed_forward_proj='gated-gelu'` (T5 v1.1, Flan-T5),
`ViTForImageClassification`, and the causal LMs of `model_type` 'llama', 'mistral', 'qwen2',
'mixtral' and 'qwen2_moe' (the last only as `upcycle.export` writes it: `hf_qwen2_moe`; their
description is config.json itself, which `LlamaConfig.from_hf_config` reads). Leaves are
numpy arrays, or with `lazy=True` memory-mapped LazyArrays. A directory on gs:// reads the same
way (config.json and safetensors headers first, each tensor by a ranged read when read).
"""

import json
import os
from typing import Dict, Optional, Tuple

import ml_dtypes
import numpy as np

from etils import epath

from upcycle.checkpoints import (hf_llama, hf_qwen2_moe, hf_t5, hf_vit, paths, safetensors_file,
                                 validate)
from upcycle.checkpoints.checkpoint import Checkpoint, ExpectedFn
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

SAFETENSORS = 'model.safetensors'
SAFETENSORS_INDEX = 'model.safetensors.index.json'
TORCH_BIN = 'pytorch_model.bin'
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN)
ARCHITECTURES = {
    'T5ForConditionalGeneration': hf_t5.convert,
    'ViTForImageClassification': hf_vit.convert,
}
# Read by `model_type`: one converter for the family's causal LMs (it refuses other heads).
MODEL_TYPES = {**{model_type: hf_llama.convert for model_type in hf_llama.MODEL_TYPES},
               'qwen2_moe': hf_qwen2_moe.convert}


def is_hf_dir(path: str) -> bool:
  return (paths.isfile(os.path.join(path, 'config.json'))
          and any(paths.isfile(os.path.join(path, f)) for f in WEIGHT_FILES))


def _json(path: str):
  return json.loads(epath.Path(path).read_text())


def load_checkpoint(path: str, expected: Optional[ExpectedFn] = None,
                    lazy: bool = False) -> Checkpoint:
  """HuggingFace checkpoint directory -> Checkpoint (params in contract names, description).

  Args:
    path: the directory holding config.json and the weights.
    expected: `description -> tree of shapes` to check the params against (e.g. the
      model's `abstract_params`); a mismatch names the HF tensor and config.json.
    lazy: LazyArray (memory-mapped) leaves instead of numpy arrays.
  """
  path = os.fspath(path)
  config_path = os.path.join(path, 'config.json')
  if not paths.isfile(config_path):
    raise checkpoint_error(path, 'not a HuggingFace checkpoint directory: no config.json',
                           fix='Pass the directory that holds config.json and the weights')
  config = _json(config_path)
  architectures = config.get('architectures') or []
  supported = [ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES]
  if config.get('model_type') in MODEL_TYPES:
    supported.append(MODEL_TYPES[config['model_type']])
  if not supported:
    raise checkpoint_error(
        config_path, 'unsupported architecture in field "architectures" and "model_type"',
        expected=f'one of {sorted(ARCHITECTURES)}, or a model_type of {sorted(MODEL_TYPES)}',
        found=f'{architectures or None} and {config.get("model_type")!r}',
        fix='Only T5 v1.1 (gated-GELU) encoder-decoders, ViT classifiers and Llama / Mistral / '
        'Qwen2 / Mixtral / Qwen2-MoE causal LMs convert')
  tensors, weights_path = read_tensors(path)
  params, description, notes, names = supported[0](tensors, config, config_path, weights_path)
  shapes = expected(description) if expected else None
  if shapes is not None:
    validate.check_params(params, shapes, weights_path, names=names,
                          fix='Check that config.json matches the weights')
  ckpt = Checkpoint(params=params, step=None, optimizer_state=None, format='hf', path=path,
                    description=description, notes=tuple(notes))
  return ckpt if lazy else ckpt.read()


def read_tensors(path: str) -> Tuple[Dict[str, LazyArray], str]:
  """-> (HuggingFace name -> LazyArray, the weights file or index read); reading a tensor
  that holds NaN or Inf raises a CheckpointError naming it and its file (`LazyArray.finite`):
  a model trained on them learns nothing, and a decode of them scores NaN."""
  tensors, weights_path = _read_weights(path)
  return {name: leaf.finite() for name, leaf in tensors.items()}, weights_path


def _read_weights(path: str) -> Tuple[Dict[str, LazyArray], str]:
  single = os.path.join(path, SAFETENSORS)
  index = os.path.join(path, SAFETENSORS_INDEX)
  torch_bin = os.path.join(path, TORCH_BIN)
  if paths.isfile(single):
    return safetensors_file.load(single), single
  if paths.isfile(index):
    return _read_sharded(path, index), index
  if paths.isfile(torch_bin):
    if paths.is_url(torch_bin):
      raise checkpoint_error(torch_bin, 'pytorch_model.bin is read from local disk only',
                             fix='Copy the directory locally, or save it as safetensors '
                             '(save_pretrained(..., safe_serialization=True))')
    return _read_torch(torch_bin), torch_bin
  raise checkpoint_error(path, 'no weights file', expected=f'one of {list(WEIGHT_FILES)}',
                         found=paths.listdir(path),
                         fix='Save the model with save_pretrained()')


def _read_sharded(path: str, index: str) -> Dict[str, LazyArray]:
  """The tensors of the shards `index` names. A tensor in more than one shard is refused:
  readers disagree on which copy is the weight ("weight_map" names one; transformers 5.24
  takes the copy of the shard it reads last), so neither is taken on trust."""
  weight_map = _json(index).get('weight_map')
  if not isinstance(weight_map, dict):
    raise checkpoint_error(index, 'no "weight_map" object', fix='Re-save the model')
  tensors, holders = {}, {}
  for shard in sorted(set(weight_map.values())):
    shard_path = os.path.join(path, shard)
    if not paths.isfile(shard_path):
      raise checkpoint_error(index, 'a shard listed in "weight_map" is missing',
                             expected=shard_path, found='no such file',
                             fix='Download every shard next to the index')
    for name, leaf in safetensors_file.load(shard_path).items():
      tensors[name] = leaf
      holders.setdefault(name, []).append(shard)
  for name, shards in holders.items():
    if len(shards) > 1:
      raise checkpoint_error(
          index, f'tensor {name!r} is in {len(shards)} shards, {" and ".join(shards)} '
          f'("weight_map" names {weight_map.get(name)}): readers disagree on which copy is the '
          'weight', fix='Remove the stray copy, or re-save the model with save_pretrained')
  missing = sorted(set(weight_map) - set(tensors))
  if missing:
    raise checkpoint_error(index, 'tensors listed in "weight_map" are absent from their shards',
                           expected=missing[:5], found='absent', fix='Re-download the shards')
  return tensors


def _read_torch(path: str) -> Dict[str, LazyArray]:
  """pytorch_model.bin via torch (imported here only), memory-mapped when the file allows."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise checkpoint_error(path, 'reading pytorch_model.bin needs PyTorch, which is not installed',
                           fix='Install the CPU build of torch, or convert the checkpoint to '
                           'safetensors') from e
  try:
    state = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
  except RuntimeError:  # Legacy (non-zip) files cannot be memory-mapped.
    state = torch.load(path, map_location='cpu', weights_only=True)
  dtypes = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16,
            torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
            torch.int32: np.int32, torch.bool: np.bool_}

  def to_numpy(t):
    if t.dtype == torch.bfloat16:
      return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()

  tensors = {}
  for name, t in state.items():
    if t.dtype not in dtypes:
      raise checkpoint_error(path, 'unsupported torch dtype', param=name,
                             expected=[str(d) for d in dtypes], found=str(t.dtype))
    tensors[name] = LazyArray(tuple(t.shape), dtypes[t.dtype], lambda t=t: to_numpy(t), path, name)
  return tensors
