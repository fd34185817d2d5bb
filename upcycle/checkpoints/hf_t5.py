"""HuggingFace `T5ForConditionalGeneration` (v1.1, gated-GELU) <-> T5X `t5_1_1` names.

HuggingFace stores torch Linear weights `[out, in]`; T5X kernels are `[in, out]`,
so every projection is transposed. The relative position bias lives in block 0
as `[buckets, heads]`; T5X keeps one `[heads, buckets]` table per stack. `TABLE` holds every
name once and serves both directions: `convert` (reading) and `to_hf` / `hf_config` (writing,
`upcycle.hf_export`).
"""

from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.name_table import NameTable, transposed

_ATTENTION = {'q': 'query', 'k': 'key', 'v': 'value', 'o': 'out'}
# (stack, sub-layer index) -> (HF attention module, ours, its layer norm); the MLP comes last.
_SUBLAYERS = {
    ('encoder', 0): ('SelfAttention', 'attention', 'pre_attention_layer_norm'),
    ('decoder', 0): ('SelfAttention', 'self_attention', 'pre_self_attention_layer_norm'),
    ('decoder', 1): ('EncDecAttention', 'encoder_decoder_attention',
                     'pre_cross_attention_layer_norm'),
}
_MLP_SUBLAYER = {'encoder': 1, 'decoder': 2}
# Aliases of shared.weight that older transformers versions also wrote.
_ALIASES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')
HEAD = 'decoder/logits_dense/kernel'


def _rows():
  """(HF name, contract path, transposed) of every tensor; `{i}` is the layer index."""
  yield 'shared.weight', 'token_embedder/embedding', False
  yield 'lm_head.weight', HEAD, True
  for stack, sub in _MLP_SUBLAYER.items():
    yield f'{stack}.final_layer_norm.weight', f'{stack}/{stack}_norm/scale', False
    yield (f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
           f'{stack}/relpos_bias/rel_embedding', True)
    mlp = f'{stack}.block.{{i}}.layer.{sub}'
    yield f'{mlp}.layer_norm.weight', f'{stack}/layers_{{i}}/pre_mlp_layer_norm/scale', False
    for w in ('wi_0', 'wi_1', 'wo'):
      yield f'{mlp}.DenseReluDense.{w}.weight', f'{stack}/layers_{{i}}/mlp/{w}/kernel', True
  for (stack, sub), (hf_module, attention, norm) in _SUBLAYERS.items():
    block = f'{stack}.block.{{i}}.layer.{sub}'
    yield f'{block}.layer_norm.weight', f'{stack}/layers_{{i}}/{norm}/scale', False
    for hf, ours in _ATTENTION.items():
      yield (f'{block}.{hf_module}.{hf}.weight',
             f'{stack}/layers_{{i}}/{attention}/{ours}/kernel', True)


TABLE = NameTable(_rows())


def _description(hf: Dict[str, Any], config_path: str,
                 logits_via_embedding: bool) -> Dict[str, Any]:
  """config.json -> the T5Config fields it implies
  (`upcycle.models.families.config_from_description`)."""
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


def hf_config(fields: Mapping[str, Any], dtype: str) -> Dict[str, Any]:
  """T5Config fields (as `_description` gives them) -> the config.json of the same logits,
  the inverse of `_description`; `dtype`: the weights' ('float32', 'bfloat16').

  T5 v1.1 has its own head: `tie_word_embeddings` false, which transformers (4 and 5) read as
  "no rescaled output" and, with an `lm_head.weight` in the file, as an untied head. A tied
  head (`logits_via_embedding`, T5 v1.0's) is written as tied, which both rescale.
  """
  return {
      'architectures': ['T5ForConditionalGeneration'], 'model_type': 't5',
      'vocab_size': fields['vocab_size'], 'd_model': fields['d_model'],
      'd_kv': fields['d_kv'], 'd_ff': fields['d_ff'], 'num_heads': fields['num_heads'],
      'num_layers': fields['num_encoder_layers'],
      'num_decoder_layers': fields['num_decoder_layers'],
      'relative_attention_num_buckets': fields['relative_attention_num_buckets'],
      'relative_attention_max_distance': fields['relative_attention_max_distance'],
      'layer_norm_epsilon': fields['layer_norm_epsilon'],
      'dropout_rate': fields['dropout_rate'],
      'feed_forward_proj': 'gated-gelu', 'is_gated_act': True, 'dense_act_fn': 'gelu_new',
      'tie_word_embeddings': bool(fields['logits_via_embedding']),
      'is_encoder_decoder': True, 'decoder_start_token_id': 0, 'pad_token_id': 0,
      'eos_token_id': 1, 'dtype': dtype, 'torch_dtype': dtype,
  }


def _rescales_logits(hf: Dict[str, Any]) -> bool:
  """Whether HuggingFace multiplies decoder outputs by d_model**-0.5 (T5 v1.0 tied head).

  transformers < 5 used `tie_word_embeddings`; transformers 5 always ties in memory
  and records the rescale as `scale_decoder_outputs`.
  """
  if 'scale_decoder_outputs' in hf:
    return bool(hf['scale_decoder_outputs'])
  return hf.get('tie_word_embeddings', True) is not False


def to_hf(params: Mapping[str, Any], source: str) -> Dict[str, Any]:
  """Contract params (dense T5, unrolled layers) -> {HF tensor name: leaf}, kernels
  transposed (lazily for LazyArrays). A head tied to the embedding writes no lm_head."""
  return TABLE.to_theirs(params, source, 'T5ForConditionalGeneration')


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
  params, hf_names, unknown = TABLE.to_ours(tensors, skip=lambda name: name in _ALIASES)
  notes = []
  if unknown:
    raise checkpoint_error(
        weights_path, 'tensors that a T5 v1.1 model does not have',
        expected='T5ForConditionalGeneration names (shared, encoder.block.*, decoder.block.*, '
        'lm_head)', found=sorted(unknown)[:8],
        fix='Check that config.json belongs to these weights')
  if via_embedding and HEAD in params and 'shared.weight' in tensors:
    shared = tensors['shared.weight']
    if not np.array_equal(np.asarray(tensors['lm_head.weight']), np.asarray(shared)):
      raise checkpoint_error(
          config_path, 'tie_word_embeddings/scale_decoder_outputs ask for the T5 v1.0 rescaled '
          'tied head, but lm_head.weight differs from shared.weight', fix='For T5 v1.1 set '
          '"tie_word_embeddings": false in config.json')
    del params[HEAD]
  elif not via_embedding and HEAD not in params and 'shared.weight' in tensors:
    params[HEAD] = transposed(tensors['shared.weight'])
    hf_names[HEAD] = 'shared.weight (tied lm_head)'
    notes.append('no lm_head.weight and no output rescaling: decoder/logits_dense/kernel is '
                 'shared.weight transposed (transformers ties them in memory)')
  return tree.unflatten(params), description, notes, hf_names
