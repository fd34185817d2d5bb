"""HuggingFace `ViTForImageClassification` -> big_vision names.

Names are those in the safetensors file (transformers 5 renames modules in memory,
not on disk). Shapes: torch Linear `[out, in]` -> kernel `[in, out]`; the patch
conv `[out, in, kh, kw]` -> `[kh, kw, in, out]`; q/k/v `[H*Dh, D]` -> `[D, H, Dh]`;
the attention output `[D, H*Dh]` -> `[H, Dh, D]`.

HuggingFace adds `position_embeddings [1, 1+N, D]` after prepending the class
token; big_vision adds `pos_embedding [1, N, D]` first and prepends `cls` after.
So `cls = cls_token + position_embeddings[:, :1]` and `pos_embedding =
position_embeddings[:, 1:]`: the same function, exactly.
"""

import re
from typing import Any, Dict, List, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints import vit_adapt
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

_BLOCK = re.compile(r'vit\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)')
_BLOCK_MODULES = {
    'layernorm_before': 'LayerNorm_0',
    'layernorm_after': 'LayerNorm_1',
    'attention.attention.query': 'MultiHeadDotProductAttention_0/query',
    'attention.attention.key': 'MultiHeadDotProductAttention_0/key',
    'attention.attention.value': 'MultiHeadDotProductAttention_0/value',
    'attention.output.dense': 'MultiHeadDotProductAttention_0/out',
    'intermediate.dense': 'MlpBlock_0/Dense_0',
    'output.dense': 'MlpBlock_0/Dense_1',
}
_TOP = {
    'vit.embeddings.patch_embeddings.projection.weight': 'embedding/kernel',
    'vit.embeddings.patch_embeddings.projection.bias': 'embedding/bias',
    'vit.layernorm.weight': 'Transformer/encoder_norm/scale',
    'vit.layernorm.bias': 'Transformer/encoder_norm/bias',
    'classifier.weight': 'head/kernel',
    'classifier.bias': 'head/bias',
}
_GELUS = {'gelu': False, 'gelu_new': True, 'gelu_pytorch_tanh': True, 'gelu_fast': True}


def _pair(x) -> Tuple[int, int]:
  return (x, x) if isinstance(x, int) else tuple(x)


def _hf_rank(module: str, kind: str) -> int:
  if kind == 'bias' or module.split('/')[-1].startswith(('LayerNorm', 'encoder_norm')):
    return 1
  return 4 if module == 'embedding' else 2


def _leaf(t: LazyArray, module: str, kind: str, heads: int) -> LazyArray:
  """Reshapes one HF tensor into its big_vision layout."""
  if len(t.shape) != _hf_rank(module, kind):
    raise checkpoint_error(t.source, 'tensor has the wrong number of dimensions', param=t.param,
                           expected=f'{_hf_rank(module, kind)} dimensions', found=t.shape,
                           fix='Check that config.json belongs to these weights')
  if kind == 'weight' and module.endswith(('query', 'key', 'value')):
    out, width = t.shape
    return t.map(lambda a: a.T.reshape(width, heads, out // heads), (width, heads, out // heads))
  if kind == 'bias' and module.endswith(('query', 'key', 'value')):
    return t.map(lambda a: a.reshape(heads, -1), (heads, t.shape[0] // heads))
  if kind == 'weight' and module.endswith('/out'):
    width, inner = t.shape
    return t.map(lambda a: a.T.reshape(heads, inner // heads, width),
                 (heads, inner // heads, width))
  if kind == 'weight' and module == 'embedding':
    return t.map(lambda a: a.transpose(2, 3, 1, 0), (*t.shape[2:], t.shape[1], t.shape[0]))
  if kind == 'weight' and _hf_rank(module, kind) == 2:
    return t.map(np.transpose, t.shape[::-1])
  return t


def _description(hf: Dict[str, Any], config_path: str) -> Dict[str, Any]:
  """config.json -> the ViTConfig fields it implies
  (`upcycle.models.families.config_from_description`)."""
  act = hf.get('hidden_act', 'gelu')
  if act not in _GELUS:
    raise checkpoint_error(config_path, 'field "hidden_act" is not supported',
                           expected=f'one of {sorted(_GELUS)}', found=repr(act))
  if not hf.get('qkv_bias', True):
    raise checkpoint_error(config_path, 'field "qkv_bias" is false; big_vision attention has '
                           'biases', expected='true', found='false')
  labels = hf.get('id2label')
  return dict(
      model='vit', num_classes=len(labels) if labels else hf.get('num_labels', 2),
      image_size=_pair(hf.get('image_size', 224)), patch_size=_pair(hf.get('patch_size', 16)),
      num_channels=hf.get('num_channels', 3), width=hf['hidden_size'],
      depth=hf['num_hidden_layers'], mlp_dim=hf['intermediate_size'],
      num_heads=hf['num_attention_heads'], pool_type='token',
      dropout_rate=hf.get('hidden_dropout_prob', 0.0),
      layer_norm_epsilon=hf.get('layer_norm_eps', 1e-12), approximate_gelu=_GELUS[act])


def convert(tensors: Dict[str, LazyArray], hf: Dict[str, Any], config_path: str,
            weights_path: str) -> Tuple[Dict[str, Any], Dict[str, Any], List[str], Dict[str, str]]:
  """HF tensors + config.json -> (nested big_vision params, ViTConfig description, notes, names).

  `names`: contract path -> HF tensor name, for errors.
  """
  description = _description(hf, config_path)
  heads = description['num_heads']
  params, hf_names, unknown = {}, {}, []
  for name, t in tensors.items():
    m = _BLOCK.fullmatch(name)
    if name in _TOP:
      path = _TOP[name]
      leaf = _leaf(t, path.rsplit('/', 1)[0], name.rsplit('.', 1)[1], heads)
    elif m and m.group(2) in _BLOCK_MODULES:
      module = _BLOCK_MODULES[m.group(2)]
      kind = m.group(3)
      path = f'Transformer/encoderblock_{m.group(1)}/{module}/' + (
          'scale' if module.startswith('LayerNorm') and kind == 'weight' else
          'kernel' if kind == 'weight' else 'bias')
      leaf = _leaf(t, module, kind, heads)
    elif name in ('vit.embeddings.cls_token', 'vit.embeddings.position_embeddings'):
      continue
    else:
      unknown.append(name)
      continue
    params[path], hf_names[path] = leaf, name
  if unknown:
    raise checkpoint_error(
        weights_path, 'tensors that a ViTForImageClassification does not have',
        expected='vit.embeddings.*, vit.encoder.layer.*, vit.layernorm.*, classifier.*',
        found=sorted(unknown)[:8], fix='Check that config.json belongs to these weights')
  cls, pos = (tensors.get('vit.embeddings.cls_token'),
              tensors.get('vit.embeddings.position_embeddings'))
  if cls is not None and pos is not None:
    params['cls'], params['pos_embedding'] = vit_adapt.fold_cls(cls, pos)
    hf_names['cls'], hf_names['pos_embedding'] = (
        'vit.embeddings.cls_token', 'vit.embeddings.position_embeddings')
  return tree.unflatten(params), description, [], hf_names
