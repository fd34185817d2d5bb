"""HuggingFace Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE `config.json` <-> `LlamaConfig`
fields.

The five compute one function, up to which projections have biases (Llama's
`attention_bias`: query, key, value and output; Qwen2: query, key and value always; Qwen2-MoE:
those with `qkv_bias`; Mistral and Mixtral: none), a sliding window (Mistral's and Mixtral's
`sliding_window`, Qwen2's and Qwen2-MoE's with `use_sliding_window`) and the MoE MLP:
Mixtral's in every layer (`mixtral_moe`: Top-k of `num_local_experts` SwiGLU experts, softmax
then top-k then renormalized, no token dropped, its load-balancing loss pooled over layers and
tokens), Qwen2-MoE's the same routing in the layers `mlp_only_layers` leaves sparse, the top k
renormalized or not, plus a shared expert (of 0 units: none) (`qwen2_moe_fields`; read only
as this project writes it: experts of the dense d_ff, a gate `checkpoints.hf_qwen2_moe` checks).
What this model does not compute is refused in one line naming the config.json field and the
fix, rather than read into a model with other logits: RoPE types other than 'default' and
'llama3', partial rotary embeddings, MLP biases, activations other than SiLU, and a sliding
window shorter than the run's sequences. Both spellings of RoPE settings are read:
transformers 5's `rope_parameters` and the older top-level `rope_theta` with `rope_scaling`.

`hf_config` is the other direction, for `upcycle.hf_export`: the config.json (both RoPE
spellings) of the HF class that computes a LlamaConfig's function (`hf_model_type`: an MoE
Llama Mixtral's where Mixtral computes it, else Qwen2-MoE's where that computes it exactly,
else refused naming the binding).
"""

import dataclasses
import json
from typing import Any, Dict, Mapping, Optional, Tuple

from upcycle import fields
from upcycle.models import rope
from upcycle.moe import balance, capacity, placement, routers
from upcycle.moe.config import MoeConfig

MODEL_TYPES = ('llama', 'mistral', 'qwen2', 'mixtral', 'qwen2_moe')
ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
                 'qwen2': 'Qwen2ForCausalLM', 'mixtral': 'MixtralForCausalLM',
                 'qwen2_moe': 'Qwen2MoeForCausalLM'}
DEFAULT_ROPE_THETA = 10000.0      # transformers' `default_theta`
DEFAULT_RMS_NORM_EPS = 1e-6       # the three configs' default


def _refuse(source: str, field: str, value: Any, why: str, fix: str) -> fields.ConfigError:
  return fields.ConfigError(f'{source}: field "{field}" = {json.dumps(value)}: {why}. Fix: {fix}.')


def _required(hf: Mapping[str, Any], field: str, source: str, within: str = '') -> Any:
  """hf[field]; `within`: the name of the settings `hf` is, for the error."""
  if hf.get(field) is None:
    name = f'{within}.{field}' if within else field
    raise fields.ConfigError(f'{source}: field "{name}" is missing. Fix: a config.json '
                             f'written by transformers (save_pretrained) has it.')
  return hf[field]


def _rope(hf: Mapping[str, Any], source: str) -> Tuple[float, Optional[rope.Llama3RopeScaling]]:
  """-> (theta, llama3 scaling or None), with transformers' precedence: `rope_scaling` over
  `rope_parameters`; theta inside them over the top-level `rope_theta`."""
  field = 'rope_scaling' if hf.get('rope_scaling') is not None else 'rope_parameters'
  params = dict(hf.get(field) or {})
  if any(isinstance(v, Mapping) for v in params.values()):
    raise _refuse(source, field, params, 'RoPE settings per layer type are not supported',
                  'use a model with one RoPE for every layer')
  type_field = 'rope_type' if 'rope_type' in params else 'type'
  rope_type = params.get(type_field) or 'default'
  theta = params.get('rope_theta', hf.get('rope_theta', DEFAULT_ROPE_THETA))
  partial = params.get('partial_rotary_factor', hf.get('partial_rotary_factor'))
  if partial not in (None, 1.0):
    raise _refuse(source, 'partial_rotary_factor', partial, 'this model rotates whole heads',
                  'use a model with partial_rotary_factor 1.0 (or none)')
  if rope_type == 'default':
    return theta, None
  if rope_type != 'llama3':
    raise _refuse(source, f'{field}.{type_field}', rope_type,
                  "only 'default' and 'llama3' RoPE are implemented (upcycle/models/rope.py)",
                  "use a model whose RoPE type is 'default' or 'llama3', or implement this "
                  'one in upcycle/models/rope.py')
  # transformers prefers a top-level value (Phi-3 writes one), then the one in the settings.
  original = (hf.get('original_max_position_embeddings')
              or params.get('original_max_position_embeddings')
              or _required(hf, 'max_position_embeddings', source))
  factors = {name: _required(params, name, source, within=field)
             for name in ('factor', 'low_freq_factor', 'high_freq_factor')}
  return theta, rope.Llama3RopeScaling(**factors, original_max_position_embeddings=original)


def _sliding_window(hf: Mapping[str, Any], model_type: str, max_length: Optional[int],
                    source: str) -> Optional[int]:
  """The window the HF model attends within, or None; refused when shorter than `max_length`
  (a token then sees fewer earlier tokens in HF than in this model)."""
  window = hf.get('sliding_window')
  used = model_type in ('mistral', 'mixtral') or (model_type in ('qwen2', 'qwen2_moe') and
                                                 hf.get('use_sliding_window'))
  if not used or window is None:
    return None
  if max_length is not None and window < max_length:
    flag = ' with "use_sliding_window": true' if model_type.startswith('qwen2') else ''
    raise _refuse(source, 'sliding_window', window,
                  f'{model_type} attends within the last {window} tokens{flag}, this model to '
                  f'the whole context, so sequences of {max_length} tokens would differ',
                  f'train on sequences of at most {window} tokens')
  return window


def mixtral_moe(num_experts: int, k: int, aux_loss_coef: float) -> MoeConfig:
  """The MoE block transformers' MixtralSparseMoeBlock computes: router logits in float32,
  softmax over the E experts, the top k renormalized to sum to 1, every token processed by
  its k experts (the dropless 'ragged' dispatch, megablox's kernels on TPU; the capacity
  factors E, unused by it, give 'indices' or 'masked' a slot for every token too);
  `load_balancing_loss_func`'s loss (E x sum_e f_e p_e over all layers' and all real tokens'
  choices together: `balance.PooledSwitch` in scope 'batch') weighted by
  `router_aux_loss_coef`; no z-loss."""
  return MoeConfig(
      num_experts=num_experts, router=routers.TopK(k=k),
      train_capacity_factor=float(num_experts), eval_capacity_factor=float(num_experts),
      capacity_convention=capacity.Vmoe(multiple_of=1), normalize_combine_weights=True,
      dispatch='ragged', grouped_kernel='megablox',
      balance=balance.PooledSwitch(weight=aux_loss_coef, scope='batch'), router_z_loss_weight=0.0,
      ignore_padding_tokens=True)


def _qwen2_moe(hf: Mapping[str, Any], source: str) -> Optional[MoeConfig]:
  """Qwen2-MoE's block as `qwen2_moe_fields` writes it (None where every layer is dense):
  Mixtral's routing in the layers `mlp_only_layers` and `decoder_sparse_step` make MoE, the
  top k renormalized iff `norm_topk_prob`, a shared expert iff it has units (its gate, which
  must be zeros, is `hf_qwen2_moe`'s to check), experts of the dense MLPs' d_ff."""
  if not _qwen2_sparse_layers(hf, source) or not hf.get('num_experts', 60):   # HF default: 60
    return None
  d_ff = _required(hf, 'intermediate_size', source)
  if _required(hf, 'moe_intermediate_size', source) != d_ff:
    raise _refuse(source, 'moe_intermediate_size', hf['moe_intermediate_size'],
                  f'this model\'s experts have the dense MLP\'s d_ff ("intermediate_size" = '
                  f'{d_ff})', 'use a model whose experts and dense MLPs have one size')
  shared = _required(hf, 'shared_expert_intermediate_size', source)
  return dataclasses.replace(
      mixtral_moe(hf.get('num_experts', 60), _required(hf, 'num_experts_per_tok', source),
                  hf.get('router_aux_loss_coef', 0.001)),
      normalize_combine_weights=bool(hf.get('norm_topk_prob', False)),
      shared_expert=shared > 0, shared_expert_d_ff=None if shared in (0, d_ff) else shared)


def _qwen2_sparse_layers(hf: Mapping[str, Any], source: str) -> Tuple[int, ...]:
  """The layers a Qwen2-MoE makes MoE: not in `mlp_only_layers`, every `decoder_sparse_step`."""
  step, dense = hf.get('decoder_sparse_step', 1), set(hf.get('mlp_only_layers') or ())
  return tuple(i for i in range(_required(hf, 'num_hidden_layers', source))
               if i not in dense and (i + 1) % step == 0)


def _moe_layers(hf: Mapping[str, Any], source: str) -> placement.Placement:
  """`LlamaConfig.moe_layers`: every layer ('all'), or the ones a Qwen2-MoE makes MoE."""
  if hf.get('model_type') != 'qwen2_moe':
    return 'all'
  sparse = _qwen2_sparse_layers(hf, source)
  return 'all' if len(sparse) == _required(hf, 'num_hidden_layers', source) else sparse


def _moe(hf: Mapping[str, Any], source: str) -> Optional[MoeConfig]:
  """Mixtral's or Qwen2-MoE's MoE block (None for the dense families)."""
  if hf.get('model_type') == 'qwen2_moe':
    return _qwen2_moe(hf, source)
  if hf.get('model_type') != 'mixtral':
    return None
  if hf.get('router_jitter_noise'):
    raise _refuse(source, 'router_jitter_noise', hf['router_jitter_noise'],
                  'Mixtral\'s jitter multiplies the experts\' inputs too, this model\'s only '
                  'the router\'s', 'set it to 0.0 (MoeConfig.jitter_noise jitters the router)')
  return mixtral_moe(_required(hf, 'num_local_experts', source),
                     _required(hf, 'num_experts_per_tok', source),
                     hf.get('router_aux_loss_coef', 0.001))


def config_fields(hf: Mapping[str, Any], max_length: Optional[int] = None,
                  source: str = 'config.json') -> Dict[str, Any]:
  """config.json (a dict) -> `LlamaConfig` keyword arguments; refuses what it cannot compute.

  `max_length`: the run's longest sequence, or None when unknown (a sliding window is then
  kept in `sliding_window`, and the model refuses longer inputs). `source`: the file named in
  errors.
  """
  model_type = hf.get('model_type')
  if model_type not in MODEL_TYPES:
    raise _refuse(source, 'model_type', model_type, f'expected one of {list(MODEL_TYPES)}',
                  'read other models with their own config class')
  activation = hf.get('hidden_act', 'silu')
  if activation != 'silu':
    raise _refuse(source, 'hidden_act', activation, 'the MLP is SwiGLU',
                  'use a model with "hidden_act": "silu"')
  if hf.get('mlp_bias'):
    raise _refuse(source, 'mlp_bias', hf['mlp_bias'], 'the MLP has no biases',
                  'use a model with "mlp_bias": false')
  heads = _required(hf, 'num_attention_heads', source)
  d_model = _required(hf, 'hidden_size', source)
  if model_type == 'qwen2':
    qkv_bias, out_bias = True, False
  elif model_type == 'qwen2_moe':
    qkv_bias, out_bias = bool(hf.get('qkv_bias', True)), False
  else:
    qkv_bias = out_bias = model_type == 'llama' and bool(hf.get('attention_bias'))
  theta, scaling = _rope(hf, source)
  return dict(
      vocab_size=_required(hf, 'vocab_size', source), d_model=d_model, num_heads=heads,
      num_kv_heads=hf.get('num_key_value_heads') or heads,
      head_dim=hf.get('head_dim') or d_model // heads,
      d_ff=_required(hf, 'intermediate_size', source),
      num_layers=_required(hf, 'num_hidden_layers', source), rope_theta=theta,
      rope_scaling=scaling, qkv_bias=qkv_bias, out_bias=out_bias,
      layer_norm_epsilon=hf.get('rms_norm_eps', DEFAULT_RMS_NORM_EPS),
      logits_via_embedding=bool(hf.get('tie_word_embeddings', False)),
      sliding_window=_sliding_window(hf, model_type, max_length, source),
      max_position_embeddings=hf.get('max_position_embeddings'),
      moe=_moe(hf, source), moe_layers=_moe_layers(hf, source))


def _slots_per_token(moe: MoeConfig) -> int:
  """An expert has a slot for every token of its group once C * this >= E."""
  return moe.capacity_convention.slots_per_token(moe.router.experts_per_token)


def _drops_tokens(moe: MoeConfig) -> bool:
  """Whether an expert's capacity can drop a token: not the dropless 'ragged' dispatch, and
  a capacity factor C with C * `_slots_per_token` < E."""
  return not moe.dropless and min(
      moe.train_capacity_factor, moe.eval_capacity_factor) * _slots_per_token(moe) < (
          moe.num_experts)


def _moe_misfit(config) -> Optional[Tuple[str, str]]:
  """(why, fix), naming the binding, where Qwen2MoeForCausalLM does not compute the MoE Llama
  `config` exactly, else None. Qwen2-MoE (and Mixtral, a special case) routes each token to
  its top k and processes it with all k; Qwen2-MoE takes any set of MoE layers
  (`mlp_only_layers`), normalized or raw top-k weights, q/k/v biases or none, and a shared
  expert or none (`qwen2_moe_fields`)."""
  moe, binding = config.moe, lambda name: fields.binding(config.moe, name)
  if config.out_bias:
    return (f'{fields.binding(config, "out_bias")} = True: neither Mixtral nor Qwen2-MoE has '
            'an attention output bias', 'out_bias = False (Qwen2-MoE takes qkv_bias alone)')
  if not isinstance(moe.router, routers.TopK):
    return (f"{binding('router')} = {moe.router!r}: Mixtral and Qwen2-MoE route each token "
            'to its top k', 'router = @routers.TopK()')
  if _drops_tokens(moe):
    return (f'{binding("eval_capacity_factor")} / train_capacity_factor: an expert\'s capacity '
            'can drop tokens, and Mixtral and Qwen2-MoE process every token with its k experts',
            f"dispatch = 'ragged' (dropless) or capacity factors of at least "
            f'{moe.num_experts / _slots_per_token(moe):g}')
  return None


def _mixtral_computes(config) -> bool:
  """Whether MixtralForCausalLM computes the MoE Llama `config`: what Qwen2-MoE computes
  (`_moe_misfit`) without attention biases, with an MoE MLP in every layer, no shared expert
  and the top k weights renormalized to sum to 1."""
  moe = config.moe
  return (not config.qkv_bias and not moe.shared_expert and moe.normalize_combine_weights
          and config.sparse_layers() == tuple(range(config.num_layers))
          and _moe_misfit(config) is None)


def _moe_model_type(config) -> str:
  """'mixtral' where Mixtral computes the MoE Llama `config`, else 'qwen2_moe' where Qwen2-MoE
  computes it exactly; else refused in one line naming the binding to change."""
  if _mixtral_computes(config):
    return 'mixtral'
  misfit = _moe_misfit(config)
  if misfit is None:
    return 'qwen2_moe'
  why, fix = misfit
  raise fields.ConfigError(f'{why}, so neither MixtralForCausalLM nor Qwen2MoeForCausalLM '
                           f'computes this MoE. Fix: train it with {fix}, or export it with '
                           f'--format=t5x.')


def hf_model_type(config) -> str:
  """The HF family that computes `config`'s (a LlamaConfig's) function: an MoE model
  Mixtral's, else Qwen2-MoE's (`_moe_model_type`: what neither computes is refused, naming
  the binding), q/k/v biases alone Qwen2's, a sliding window without biases Mistral's, the
  rest Llama's (`attention_bias` biases all four projections or none). What none of them
  computes is refused in one line: an output bias alone, Llama with a window or with
  `hidden_size` not a multiple of the heads (transformers' LlamaConfig refuses that)."""
  if config.moe is not None:
    return _moe_model_type(config)
  if config.out_bias and not config.qkv_bias:
    raise fields.ConfigError(
        f'{fields.binding(config, "out_bias")} = True without qkv_bias: no HuggingFace '
        'causal LM has an output bias alone (Llama\'s attention_bias biases q, k, v and o). '
        'Fix: export a model with both biases or only qkv_bias (Qwen2).')
  if config.qkv_bias and not config.out_bias:
    return 'qwen2'
  if config.sliding_window is not None:
    if config.qkv_bias:
      raise fields.ConfigError(
          f'{fields.binding(config, "sliding_window")} = {config.sliding_window} with '
          'attention biases: LlamaForCausalLM attends to the whole context. Fix: set '
          'sliding_window = None (this model attends to the whole context anyway).')
    return 'mistral'
  if config.d_model % config.num_heads:
    raise fields.ConfigError(
        f'{fields.binding(config, "d_model")} = {config.d_model} is not a multiple of '
        f'num_heads = {config.num_heads}: transformers\' LlamaConfig refuses that, whatever '
        'head_dim is. Fix: export a model whose d_model the heads divide.')
  return 'llama'


def _rope_settings(config) -> Dict[str, Any]:
  """{'rope_parameters' (transformers 5), 'rope_theta' and 'rope_scaling' (older)}, one
  RoPE in both spellings (`_rope` reads either, transformers too)."""
  scaling = None
  if config.rope_scaling is not None:
    scaling = {'rope_type': 'llama3', 'factor': config.rope_scaling.factor,
               'low_freq_factor': config.rope_scaling.low_freq_factor,
               'high_freq_factor': config.rope_scaling.high_freq_factor,
               'original_max_position_embeddings':
                   config.rope_scaling.original_max_position_embeddings}
  parameters = {'rope_type': 'default', **(scaling or {}), 'rope_theta': config.rope_theta}
  return {'rope_parameters': parameters, 'rope_theta': config.rope_theta,
          'rope_scaling': scaling}


def qwen2_moe_fields(config) -> Dict[str, Any]:
  """The Qwen2-MoE part of config.json for the MoE Llama `config`: every layer its own
  (`decoder_sparse_step` 1), the dense ones `mlp_only_layers`; the experts and the dense MLPs
  both of `config.d_ff` units; `norm_topk_prob` the renormalized top k; the shared expert
  (Qwen2-MoE always has one, gated by `shared_expert_gate`) of `shared_d_ff` units, or of 0
  (output 0) where the model has none: `hf_qwen2_moe` writes our ungated one exactly.
  A sliding window covers every layer (`layer_types`; `max_window_layers` 0 for transformers
  4, which slides from that layer on)."""
  moe, windowed = config.moe, config.sliding_window is not None
  sparse = set(config.sparse_layers())
  return {
      'num_experts': moe.num_experts, 'num_experts_per_tok': moe.router.k,
      'moe_intermediate_size': config.d_ff, 'norm_topk_prob': moe.normalize_combine_weights,
      'shared_expert_intermediate_size': moe.shared_d_ff(config.d_ff) or 0,
      'decoder_sparse_step': 1,
      'mlp_only_layers': [i for i in range(config.num_layers) if i not in sparse],
      'qkv_bias': config.qkv_bias, 'router_aux_loss_coef': moe.balance.weight,
      'output_router_logits': True, 'use_sliding_window': windowed,
      'sliding_window': config.sliding_window,
      'max_window_layers': 0 if windowed else config.num_layers,
      'layer_types': [('sliding_attention' if windowed else 'full_attention')] * config.num_layers,
  }


def hf_config(config, dtype: str, token_ids: Mapping[str, Any],
              max_position_embeddings: Optional[int] = None) -> Dict[str, Any]:
  """A LlamaConfig (dense or MoE) -> the config.json of `hf_model_type(config)`'s
  *ForCausalLM with the same logits (`config_fields` reads it back to `config`, up to dtype
  and training fields, a dropless dispatch read as 'ragged').

  `dtype`: the weights' ('float32', 'bfloat16'). `token_ids`: {'bos_token_id', 'eos_token_id'
  (an int or a list), 'pad_token_id'}, None where unknown (written as null).
  `max_position_embeddings`: the context the HF source was published with; None: the model
  config's (`LlamaConfig.max_position_embeddings`, the shipped model files' published value),
  else a llama3 RoPE's original context times its factor, else the HF class's default. An MoE writes
  `output_router_logits` true, so that transformers adds the load-balancing loss
  (`router_aux_loss_coef`) when it fine-tunes.
  """
  model_type = hf_model_type(config)
  hf = {
      'architectures': [ARCHITECTURES[model_type]], 'model_type': model_type,
      'vocab_size': config.vocab_size, 'hidden_size': config.d_model,
      'intermediate_size': config.d_ff, 'num_hidden_layers': config.num_layers,
      'num_attention_heads': config.num_heads, 'num_key_value_heads': config.num_kv_heads,
      'head_dim': config.head_dim, 'hidden_act': 'silu',
      'rms_norm_eps': config.layer_norm_epsilon,
      'tie_word_embeddings': config.logits_via_embedding, **_rope_settings(config),
      **{name: token_ids.get(name) for name in ('bos_token_id', 'eos_token_id', 'pad_token_id')},
      'dtype': dtype, 'torch_dtype': dtype,
  }
  max_position_embeddings = max_position_embeddings or config.max_position_embeddings
  if max_position_embeddings is None and config.rope_scaling is not None:
    max_position_embeddings = int(config.rope_scaling.original_max_position_embeddings *
                                  config.rope_scaling.factor)
  if max_position_embeddings is not None:
    hf['max_position_embeddings'] = max_position_embeddings
  if model_type == 'llama':
    hf.update(attention_bias=config.qkv_bias, mlp_bias=False)
  elif model_type == 'mistral':
    hf['sliding_window'] = config.sliding_window
  elif model_type == 'mixtral':
    hf.update(sliding_window=config.sliding_window, num_local_experts=config.moe.num_experts,
              num_experts_per_tok=config.moe.router.k,
              router_aux_loss_coef=config.moe.balance.weight,
              output_router_logits=True, router_jitter_noise=0.0)
  elif model_type == 'qwen2_moe':
    hf.update(qwen2_moe_fields(config))
  else:   # qwen2: a window (read from a Qwen2 that had one) covers every layer
    windowed = config.sliding_window is not None
    hf.update(use_sliding_window=windowed, sliding_window=config.sliding_window,
              max_window_layers=0 if windowed else config.num_layers)
  return hf
