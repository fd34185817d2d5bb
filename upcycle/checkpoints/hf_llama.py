"""HuggingFace `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` /
`MixtralForCausalLM` <-> Llama names.

The names are T5's decoder names (`upcycle/models/llama.py`): `model.layers.{i}` ->
`decoder/layers_{i}`, `self_attn.{q,k,v,o}_proj` -> `self_attention/{query,key,value,out}`,
`mlp.{gate,up,down}_proj` -> `mlp/{wi_0,wi_1,wo}`, `input_layernorm` /
`post_attention_layernorm` -> `pre_self_attention_layer_norm` / `pre_mlp_layer_norm`,
`model.norm` -> `decoder/decoder_norm`, `lm_head` -> `decoder/logits_dense`; Mixtral's
`block_sparse_moe.gate` -> `mlp/router/router_weights/w`, its per-expert
`block_sparse_moe.experts.{j}.{w1,w3,w2}` -> the stacked `mlp/expert/{wi_0,wi_1,wo}` (expert
j at index j of the first axis; the layout `save_pretrained` writes and transformers fuses on
load). torch Linear weights `[out, in]` become kernels `[in, out]`; biases and norm scales
keep their shape.
`TABLE` holds every name once and serves both directions: `convert` (reading) and `to_hf`
(writing, `upcycle.hf_export`); `name_table` gives another MoE block's (`hf_qwen2_moe`).

The description is config.json itself (`{'model': 'llama', 'hf_config', 'config_path'}`):
`LlamaConfig.from_hf_config` reads it and refuses what the model does not compute.
"""

import re
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from upcycle import tree
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.name_table import NameTable

MODEL_TYPES = ('llama', 'mistral', 'qwen2', 'mixtral')
EMBEDDING = 'token_embedder/embedding'
HEAD = 'decoder/logits_dense/kernel'
_TOP = {
    'model.embed_tokens.weight': EMBEDDING,
    'model.norm.weight': 'decoder/decoder_norm/scale',
    'lm_head.weight': HEAD,
}
_LAYER_TENSORS = {
    'input_layernorm.weight': 'pre_self_attention_layer_norm/scale',
    'post_attention_layernorm.weight': 'pre_mlp_layer_norm/scale',
    'mlp.gate_proj.weight': 'mlp/wi_0/kernel',
    'mlp.up_proj.weight': 'mlp/wi_1/kernel',
    'mlp.down_proj.weight': 'mlp/wo/kernel',
    **{f'self_attn.{hf}_proj.{kind}': f'self_attention/{ours}/{leaf}'
       for hf, ours in (('q', 'query'), ('k', 'key'), ('v', 'value'), ('o', 'out'))
       for kind, leaf in (('weight', 'kernel'), ('bias', 'bias'))},
}
MIXTRAL_MOE = {
    'block_sparse_moe.gate.weight': 'mlp/router/router_weights/w/kernel',
    'block_sparse_moe.experts.{j}.w1.weight': 'mlp/expert/wi_0/kernel',
    'block_sparse_moe.experts.{j}.w3.weight': 'mlp/expert/wi_1/kernel',
    'block_sparse_moe.experts.{j}.w2.weight': 'mlp/expert/wo/kernel',
}


def name_table(moe_tensors: Mapping[str, str]) -> NameTable:
  """The table of a causal LM of this family whose MoE blocks' tensors are `moe_tensors`
  ({their name within `model.layers.{i}`: our path within `decoder/layers_{i}`})."""
  layer = {**_LAYER_TENSORS, **moe_tensors}
  return NameTable(
      [(hf, ours, ours.endswith('/kernel')) for hf, ours in _TOP.items()] +
      [(f'model.layers.{{i}}.{hf}', f'decoder/layers_{{i}}/{ours}', ours.endswith('/kernel'))
       for hf, ours in layer.items()])


TABLE = name_table(MIXTRAL_MOE)
# Buffers older transformers saved with the weights; the model computes them from config.json.
_DERIVED = re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq')


def to_hf(params: Mapping[str, Any], source: str, model: str) -> Dict[str, Any]:
  """Contract params (dense, unrolled layers) -> {HF tensor name: leaf}, kernels transposed
  (lazily for LazyArrays); `model` ('LlamaForCausalLM', ...) is named in errors. A head tied to
  the embedding writes no lm_head, as `save_pretrained` does."""
  return TABLE.to_theirs(params, source, model)


def convert(tensors: Dict[str, LazyArray], hf: Dict[str, Any], config_path: str,
            weights_path: str, table: NameTable = TABLE,
            family: str = 'Llama / Mistral / Qwen2 / Mixtral',
            ) -> Tuple[Dict[str, Any], Dict[str, Any], List[str], Dict[str, str]]:
  """HF tensors + config.json -> (nested contract params, description, notes, names).

  `names`: contract path -> HF tensor name, for errors. With `tie_word_embeddings` (false by
  default in all three) the output layer is the embedding: an `lm_head.weight` in the file
  must then equal `model.embed_tokens.weight` and is dropped. `table`, `family`: the names and
  the models they are (Qwen2-MoE's for `hf_qwen2_moe`).
  """
  params, hf_names, unknown = table.to_ours(tensors, skip=_DERIVED.fullmatch)
  if unknown:
    raise checkpoint_error(
        weights_path, f'tensors that a {family} causal LM does not have',
        expected='model.embed_tokens, model.layers.*.{self_attn,mlp,block_sparse_moe,'
        'input_layernorm,post_attention_layernorm}, model.norm, lm_head',
        found=sorted(unknown)[:8],
        fix='Check that config.json belongs to these weights (only *ForCausalLM models read)')
  if hf.get('tie_word_embeddings', False) and HEAD in params:
    embedding = tensors.get('model.embed_tokens.weight')
    if embedding is None or not np.array_equal(np.asarray(tensors['lm_head.weight']),
                                               np.asarray(embedding)):
      raise checkpoint_error(
          config_path, '"tie_word_embeddings": true, but lm_head.weight differs from '
          'model.embed_tokens.weight', fix='Set "tie_word_embeddings": false in config.json')
    del params[HEAD]
  description = {'model': 'llama', 'hf_config': dict(hf), 'config_path': config_path}
  return tree.unflatten(params), description, [], hf_names
