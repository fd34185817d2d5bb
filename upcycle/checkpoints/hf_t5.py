"""HuggingFace `T5ForConditionalGeneration` (v1.1, gated-GELU) -> T5X `t5_1_1` names.

HuggingFace stores torch Linear weights `[out, in]`; T5X kernels are `[in, out]`,
so every projection is transposed. The relative position bias lives in block 0
as `[buckets, heads]`; T5X keeps one `[heads, buckets]` table per stack.
"""

import re
from typing import Any, Dict, List, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

_ATTENTION = {'q': 'query', 'k': 'key', 'v': 'value', 'o': 'out'}
# (stack, sub-layer index) -> (attention module, its layer norm); the MLP comes last.
_SUBLAYERS = {
    ('encoder', 0): ('attention', 'pre_attention_layer_norm'),
    ('decoder', 0): ('self_attention', 'pre_self_attention_layer_norm'),
    ('decoder', 1): ('encoder_decoder_attention', 'pre_cross_attention_layer_norm'),
}
_MLP_SUBLAYER = {'encoder': 1, 'decoder': 2}
_BLOCK = re.compile(r'(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)')
# Aliases of shared.weight that older transformers versions also wrote.
_ALIASES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')


def _transposed(t: LazyArray) -> LazyArray:
  return t.map(np.transpose, t.shape[::-1])


def _block_name(stack: str, layer: int, sub: int, rest: str) -> Tuple[str, bool]:
  """HF tail inside `{stack}.block.{layer}.layer.{sub}` -> (contract path, transpose?)."""
  prefix = f'{stack}/layers_{layer}'
  if sub == _MLP_SUBLAYER[stack]:
    if rest == 'layer_norm.weight':
      return f'{prefix}/pre_mlp_layer_norm/scale', False
    m = re.fullmatch(r'DenseReluDense\.(wi_0|wi_1|wo)\.weight', rest)
    if m:
      return f'{prefix}/mlp/{m.group(1)}/kernel', True
    return '', False
  if (stack, sub) not in _SUBLAYERS:
    return '', False
  attention, norm = _SUBLAYERS[(stack, sub)]
  if rest == 'layer_norm.weight':
    return f'{prefix}/{norm}/scale', False
  if rest == 'SelfAttention.relative_attention_bias.weight' and layer == 0 and sub == 0:
    return f'{stack}/relpos_bias/rel_embedding', True
  m = re.fullmatch(r'(?:SelfAttention|EncDecAttention)\.([qkvo])\.weight', rest)
  if m:
    return f'{prefix}/{attention}/{_ATTENTION[m.group(1)]}/kernel', True
  return '', False


def _contract_name(name: str) -> Tuple[str, bool]:
  """HF tensor name -> (contract path or '' when unknown, transpose?)."""
  if name == 'shared.weight':
    return 'token_embedder/embedding', False
  if name == 'lm_head.weight':
    return 'decoder/logits_dense/kernel', True
  m = re.fullmatch(r'(encoder|decoder)\.final_layer_norm\.weight', name)
  if m:
    return f'{m.group(1)}/{m.group(1)}_norm/scale', False
  m = _BLOCK.fullmatch(name)
  if m:
    return _block_name(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4))
  return '', False


def _description(hf: Dict[str, Any], config_path: str,
                 logits_via_embedding: bool) -> Dict[str, Any]:
  """config.json -> the T5Config fields it implies (`upcycle.models.config_from_description`)."""
  proj = hf.get('feed_forward_proj', 'relu')
  if proj != 'gated-gelu':
    raise checkpoint_error(
        config_path, 'field "feed_forward_proj" is not supported', expected="'gated-gelu'",
        found=repr(proj), fix='Only T5 v1.1 gated-GELU models (t5-v1_1-*, flan-t5-*) convert; '
        'the original T5 (relu) has a different MLP')
  num_layers = hf['num_layers']
  return dict(
      model='t5', vocab_size=hf['vocab_size'], d_model=hf['d_model'], num_heads=hf['num_heads'],
      d_kv=hf['d_kv'], d_ff=hf['d_ff'], num_encoder_layers=num_layers,
      num_decoder_layers=hf.get('num_decoder_layers') or num_layers,
      dropout_rate=hf.get('dropout_rate', 0.0),
      relative_attention_num_buckets=hf.get('relative_attention_num_buckets', 32),
      relative_attention_max_distance=hf.get('relative_attention_max_distance', 128),
      layer_norm_epsilon=hf.get('layer_norm_epsilon', 1e-6),
      logits_via_embedding=logits_via_embedding)


def _rescales_logits(hf: Dict[str, Any]) -> bool:
  """Whether HuggingFace multiplies decoder outputs by d_model**-0.5 (T5 v1.0 tied head).

  transformers < 5 used `tie_word_embeddings`; transformers 5 always ties in memory
  and records the rescale as `scale_decoder_outputs`.
  """
  if 'scale_decoder_outputs' in hf:
    return bool(hf['scale_decoder_outputs'])
  return hf.get('tie_word_embeddings', True) is not False


def convert(tensors: Dict[str, LazyArray], hf: Dict[str, Any], config_path: str,
            weights_path: str) -> Tuple[Dict[str, Any], Dict[str, Any], List[str], Dict[str, str]]:
  """HF tensors + config.json -> (nested contract params, T5Config description, notes, names).

  `names`: contract path -> HF tensor name, for errors.

  Output head: with the rescale (see `_rescales_logits`) the logits come from the
  embedding (`logits_via_embedding=True`, no `logits_dense`). Without it the
  head is `lm_head.weight` transposed, or, when the file has none (transformers 5
  ties it in memory), `shared.weight` transposed into `decoder/logits_dense/kernel`.
  """
  via_embedding = _rescales_logits(hf)
  description = _description(hf, config_path, via_embedding)
  params, hf_names, notes = {}, {}, []
  unknown = []
  for name, tensor in tensors.items():
    if name in _ALIASES:
      continue
    path, transpose = _contract_name(name)
    if not path:
      unknown.append(name)
      continue
    params[path] = _transposed(tensor) if transpose else tensor
    hf_names[path] = name
  if unknown:
    raise checkpoint_error(
        weights_path, 'tensors that a T5 v1.1 model does not have',
        expected='T5ForConditionalGeneration names (shared, encoder.block.*, decoder.block.*, '
        'lm_head)', found=sorted(unknown)[:8],
        fix='Check that config.json belongs to these weights')
  head = 'decoder/logits_dense/kernel'
  if via_embedding and head in params and 'shared.weight' in tensors:
    shared = tensors['shared.weight']
    if not np.array_equal(np.asarray(tensors['lm_head.weight']), np.asarray(shared)):
      raise checkpoint_error(
          config_path, 'tie_word_embeddings/scale_decoder_outputs ask for the T5 v1.0 rescaled '
          'tied head, but lm_head.weight differs from shared.weight', fix='For T5 v1.1 set '
          '"tie_word_embeddings": false in config.json')
    del params[head]
  elif not via_embedding and head not in params and 'shared.weight' in tensors:
    params[head] = _transposed(tensors['shared.weight'])
    hf_names[head] = 'shared.weight (tied lm_head)'
    notes.append('no lm_head.weight and no output rescaling: decoder/logits_dense/kernel is '
                 'shared.weight transposed (transformers ties them in memory)')
  return tree.unflatten(params), description, notes, hf_names
