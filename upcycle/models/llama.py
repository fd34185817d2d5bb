"""Llama decoder-only LM (transformers' `LlamaForCausalLM`; Mistral and Qwen2 are the same
function, `llama_hf`); any MLP block may be MoE.

Parameter tree: T5's decoder names (docs/checkpoints.md, "Parameter names") without the
cross-attention, so the naming contract, the upcycling rules and the sharding rules are T5's:
  token_embedder/embedding                                      [vocab, d_model]
  decoder/layers_{i}/pre_self_attention_layer_norm/scale        [d_model]
  decoder/layers_{i}/self_attention/query/kernel                [d_model, heads * head_dim]
  decoder/layers_{i}/self_attention/{key,value}/kernel          [d_model, kv_heads * head_dim]
  decoder/layers_{i}/self_attention/out/kernel                  [heads * head_dim, d_model]
    (+ query/key/value bias with `qkv_bias`, out bias [d_model] with `out_bias`)
  decoder/layers_{i}/pre_mlp_layer_norm/scale                   [d_model]
  decoder/layers_{i}/mlp/{wi_0,wi_1}/kernel                     [d_model, d_ff] (gate, up)
  decoder/layers_{i}/mlp/wo/kernel                              [d_ff, d_model] (down)
    (an MoE block's mlp/{expert, router[, shared_expert]}: `upcycle.moe.layer`)
  decoder/decoder_norm/scale                                    [d_model]
  decoder/logits_dense/kernel                                   [d_model, vocab] (untied only)
With `scan_layers=True` the `layers_{i}` become `layers/subblock_{j}` with a leading `layers`
axis (`scan_layout`); `remat_policy` recomputes block activations (`stacking`).

Inputs are T5X's decoder-only features: `decoder_input_tokens` `[batch, length]`, and for
packed rows `decoder_segment_ids` (0 = padding) and `decoder_positions` (restarting at 0 in
each segment). A token attends to the earlier tokens of its own segment; the positions feed the
rotary embeddings.

Decoding (`Llama.prefill`, then `Llama.decode_step` per token, both applied with
`mutable=['cache']`, as T5's) keeps a 'cache' collection: per layer the self-attention's rotated
keys and values `[batch, max_length, kv_heads, head_dim]`, and at the decoder's top `index`
(scalar int32: the column the next step writes), `key_valid` `[batch, max_length]` (columns
holding a real token) and `positions` `[batch]` (the next step's rotary position). Every
non-scalar cache leaf has the batch axis first, so beam search can expand and reorder it;
scanned layers stack theirs on axis 1.
"""

import dataclasses
import functools
from typing import Any, ClassVar, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import fields, fused_attention, layers
from upcycle.models import flops, llama_hf, rope, scan_layout, stacking
from upcycle.moe import grouping, placement
from upcycle.moe.config import MoeConfig
from upcycle.moe.layer import MoeLayer

Array = jax.Array

# HF's `initializer_range` default: the embedding is also the output layer when tied, and
# (unlike T5) its logits are not rescaled, so it starts small.
EMBEDDING_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama hyperparameters (defaults: transformers' `LlamaConfig`, Llama 2 7B). MoE: a MoeConfig
  or None, at the blocks `moe_layers` names (`upcycle.moe.placement`; default 'all', as Mixtral).
  `LlamaConfig.from_hf_config(config_json)` reads a Llama / Mistral / Qwen2 / Mixtral
  config.json, and a Qwen2-MoE one as `upcycle.export` writes it.

  Attributes beyond T5Config's names:
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    head_dim: per head; need not be d_model / num_heads.
    rope_theta, rope_scaling: the rotary embedding's base and optional Llama 3.1 rescaling.
    qkv_bias, out_bias: biases on the query/key/value and on the output projection (HF Llama's
      `attention_bias` sets both, Qwen2 has the first only).
    logits_via_embedding: tied output layer (HF `tie_word_embeddings`), not rescaled.
    sliding_window: the window of the HF model this config was read from (Mistral, Qwen2), or
      None. This model attends to the whole causal context, the same function on sequences of
      at most `sliding_window` tokens, so it refuses longer ones.
    max_position_embeddings: the context the model is published for (HF's field of that
      name, e.g. 131072 for Llama 3.1), or None; nothing here computes with it: the HF export
      writes it where the run's HF source does not say (`llama_hf.hf_config`).
    dropout_rate: as T5's (attention weights, block outputs, MLP hidden units); HF has none.
    attention: how training and evaluation attend over whole sequences
      (`upcycle.fused_attention.ATTENTION`): 'auto' (splash-attention kernel on TPU, cuDNN's
      on GPU for bfloat16 / float16, the einsum elsewhere), 'einsum', 'splash', 'cudnn' or
      'splash_interpret' (the kernel interpreted on any platform, for tests). Decoding steps
      with the KV cache, the prompt's prefill and attention dropout use the einsum.
  Every field is checked at construction, naming the binding (`models.LlamaConfig.d_model`).
  """

  vocab_size: int = 32000
  d_model: int = 4096
  num_heads: int = 32
  num_kv_heads: int = 32
  head_dim: int = 128
  d_ff: int = 11008
  num_layers: int = 32
  rope_theta: float = 10000.0
  rope_scaling: Optional[rope.Llama3RopeScaling] = None
  qkv_bias: bool = False
  out_bias: bool = False
  layer_norm_epsilon: float = 1e-6
  logits_via_embedding: bool = False
  sliding_window: Optional[int] = None
  max_position_embeddings: Optional[int] = None
  dropout_rate: float = 0.0
  attention: str = 'auto'
  dtype: str = 'float32'
  moe: Optional[MoeConfig] = None
  moe_layers: placement.Placement = 'all'
  scan_layers: bool = False
  remat_policy: str = 'none'

  # What changes the model's function but not its parameters' shapes: a checkpoint that
  # describes its config (an HF config.json) must agree on these (`pretrained.check_config`).
  FUNCTION_FIELDS: ClassVar[Tuple[str, ...]] = (
      'rope_theta', 'rope_scaling', 'layer_norm_epsilon', 'logits_via_embedding',
      'sliding_window', 'qkv_bias', 'out_bias')

  def __post_init__(self):
    for name in ('vocab_size', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim', 'd_ff',
                 'num_layers'):
      fields.integer(self, name, 1)
    fields.number(self, 'rope_theta', 0.0, strictly=True)
    fields.optional_instance(self, 'rope_scaling', rope.Llama3RopeScaling,
                             '@models.Llama3RopeScaling()')
    for name in ('qkv_bias', 'out_bias', 'logits_via_embedding', 'scan_layers'):
      fields.boolean(self, name)
    fields.number(self, 'layer_norm_epsilon', 0.0, strictly=True)
    fields.optional_integer(self, 'sliding_window', 1)
    fields.optional_integer(self, 'max_position_embeddings', 1)
    fields.fraction(self, 'dropout_rate')
    fields.choice(self, 'dtype', layers.DTYPES)
    fields.choice(self, 'attention', fused_attention.ATTENTION)
    if self.attention == 'cudnn' and self.dtype not in fused_attention.CUDNN_DTYPES:
      raise fields.ConfigError(
          f"{fields.binding(self, 'attention')} = 'cudnn': cuDNN's fused attention takes "
          f"{' or '.join(fused_attention.CUDNN_DTYPES)}, but dtype = {self.dtype!r}. Fix: set "
          f"dtype to one of them, or attention = 'auto'.")
    if self.attention not in ('auto', 'einsum') and self.dropout_rate:
      raise fields.ConfigError(
          f'{fields.binding(self, "attention")} = {self.attention!r}: the kernel has no '
          f'attention dropout, but dropout_rate = {self.dropout_rate}. Fix: attention = '
          f"'einsum' (or 'auto', which attends by the einsum while dropout is on), or "
          f'dropout_rate = 0.')
    fields.optional_instance(self, 'moe', MoeConfig, '@moe.MoeConfig()')
    placement.check(self, 'moe_layers', self.num_layers)
    fields.choice(self, 'remat_policy', tuple(stacking.REMAT_POLICIES))
    if self.num_heads % self.num_kv_heads:
      raise fields.ConfigError(
          f'{fields.binding(self, "num_kv_heads")} = {self.num_kv_heads}: does not divide '
          f'num_heads = {self.num_heads} (each key/value head serves a group of query heads).')
    if self.head_dim % 2:
      raise fields.ConfigError(
          f'{fields.binding(self, "head_dim")} = {self.head_dim}: expected an even number (the '
          f'rotary embedding rotates the two halves of each head).')
    if self.scan_layers:
      scan_layout.check_scannable(self.sparse_layers(), self.num_layers,
                                  fields.binding(self, 'moe_layers'))
    if self.moe is not None:
      self.moe.router.check_causal(
          f"{fields.binding(self, 'moe')}.router = {self.moe.router!r}")

  @classmethod
  def from_hf_config(cls, hf_config: Mapping[str, Any], max_length: Optional[int] = None,
                     source: str = 'config.json') -> 'LlamaConfig':
    """A Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE config.json (as a dict) -> the
    LlamaConfig of the same logits (Mixtral's: `moe` = `llama_hf.mixtral_moe`; Qwen2-MoE's
    that routing in its MoE layers, with its shared expert).

    `max_length`: the longest sequence the run feeds (refuses a shorter sliding window);
    `source`: the file named in errors. Refusals (`llama_hf.config_fields`) are one-line
    `fields.ConfigError`s naming the config.json field and the fix. Set `dtype`, `moe`,
    `scan_layers`, ... afterwards with `dataclasses.replace` (the `moe` of a dense one).
    """
    return cls(**llama_hf.config_fields(hf_config, max_length=max_length, source=source))

  def sparse_layers(self) -> tuple:
    if self.moe is None:
      return ()
    return placement.sparse_layer_indices(self.moe_layers, self.num_layers)

  def moe_positions(self) -> dict:
    """{MLP path of every MoE block: (stack, layer index)} (`T5Config.moe_positions`)."""
    return stacking.moe_positions(self, 'mlp')

  def with_depths(self, depths) -> 'LlamaConfig':
    """This config, unscanned, with its stacks cut to their first `depths` layers (in
    `layer_stacks()` order), their MoE blocks where they were: a shallow copy of the model
    (`upcycle/fit/step_count.py` counts a step from such copies)."""
    return scan_layout.cut_one_stack(self, 'num_layers', depths)

  def layer_stacks(self) -> list:
    """(prefix, unrolled block name, scanned name, num_layers, sparse): the one decoder stack."""
    return [('decoder', 'layers_{}', 'layers', self.num_layers, self.sparse_layers())]

  def forward_flops(self, batch: int, length: int) -> int:
    """Forward FLOPs on `[batch, length]` tokens (`models/flops.py` counts): q/o projections
    over all heads, k/v over the key/value heads (grouped-query attention), scores and sum
    over all heads."""
    d, hd = self.d_model, self.head_dim
    q_inner, kv_inner = self.num_heads * hd, self.num_kv_heads * hd
    attention = (2 * length * d * (2 * q_inner + 2 * kv_inner)
                 + 2 * 2 * length * length * q_inner)
    unit = 2 * 3 * d                                # wi_0 (gate), wi_1 (up), wo (down)
    sparse = self.sparse_layers()
    total = 0
    for i in range(self.num_layers):
      moe = self.moe if i in sparse else None
      total += batch * attention + flops.mlp_block(moe, batch, length, d, self.d_ff, unit)
    return total + 2 * batch * length * d * self.vocab_size   # logits

  def uncounted_flops(self, batch: int, length: int, *, train: bool) -> float:
    """FLOPs per device of the kernels on `[batch, length]` tokens that the TPU compiler's
    cost analysis counts as nothing, under the current mesh: the splash kernel's in every
    layer where `attention` compiles it for TPU (`fused_attention.compiles_splash`), else 0.
    `train`: a forward and backward (the forward twice with any `remat_policy` but 'none':
    the kernel's outputs are no dot a policy saves); else one forward."""
    if not fused_attention.compiles_splash(self.attention, batch,
                                           dropout=train and bool(self.dropout_rate)):
      return 0.0
    return self.num_layers * fused_attention.splash_flops(
        rows=batch, length=length, heads=self.num_heads, kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, forwards=2 if train and self.remat_policy != 'none' else 1,
        backward=train)


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary positions (HF `LlamaAttention`).

  Query head h reads key/value head h // (num_heads / num_kv_heads), as HF's `repeat_kv`;
  logits are scaled by head_dim**-0.5 and soft-maxed in float32 (`upcycle.fused_attention`,
  by `config.attention`). Keys are rotated before they are used, so a decoding cache can keep
  them as they are.
  """

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: Array, bias: Optional[Array], segment_ids: Optional[Array],
               positions: Array, deterministic: bool, cache_index: Optional[Array] = None,
               cache_length: Optional[int] = None) -> Array:
    """x `[batch, length, d_model]`, positions `[batch, length]` -> `[batch, length,
    d_model]`. Whole sequences (bias None): causal within the segments of `segment_ids`
    `[batch, length]` (None: one per row), by `config.attention`. Decoding: by the einsum with
    bias `[batch, 1, length, keys]` (additive mask).

    Decoding (`cache_length` set): the first call (the prompt) also writes its keys and
    values into a new cache of `cache_length` columns; a later call (one step, length 1)
    writes its own at `cache_index` and attends to the whole cache (keys = cache_length).
    """
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dense = functools.partial(layers.DenseGeneral, dtype=cfg.dtype)
    inv_freq = rope.inverse_frequencies(head_dim, cfg.rope_theta, cfg.rope_scaling)

    def project(name: str, num: int) -> Array:   # -> [batch, length, num, head_dim]
      return dense((num, head_dim), ('embed', 'joined_kv'), use_bias=cfg.qkv_bias,
                   flat_kernel=True, name=name)(x)

    q = layers.constrain(project('query', heads), ('batch', 'length', 'heads', 'kv'))
    q = rope.rotate(q, positions, inv_freq)
    k = rope.rotate(project('key', kv_heads), positions, inv_freq)
    v = project('value', kv_heads)
    if cache_length is not None:
      k, v = self._cached(k, v, cache_index, cache_length)
    dropout = None
    if not deterministic and cfg.dropout_rate:
      dropout = functools.partial(nn.Dropout(cfg.dropout_rate), deterministic=False)
    if bias is None:
      y = fused_attention.attend(q, k, v, segment_ids, cfg.attention, cfg.dtype, dropout)
    else:
      y = fused_attention.einsum_attention(q, k, v, bias, cfg.dtype, dropout)
    y = dense(cfg.d_model, ('joined_kv', 'embed'), in_features=(heads, head_dim),
              use_bias=cfg.out_bias, flat_kernel=True, name='out')(y)
    return layers.constrain(y, ('batch', 'length', 'embed'))

  def _cached(self, k: Array, v: Array, index: Optional[Array],
              cache_length: int) -> Tuple[Array, Array]:
    """Keys and values `[batch, length, kv_heads, head_dim]` -> those to attend to.

    No cache yet (the prompt): creates `cached_key` / `cached_value` `[batch, cache_length,
    kv_heads, head_dim]` holding these in the first columns, and returns them unchanged.
    Else (a step): writes them at column `index` and returns the whole cache.
    """
    if not self.has_variable('cache', 'cached_key'):
      shape = (k.shape[0], cache_length) + k.shape[2:]
      place = lambda x: jnp.zeros(shape, x.dtype).at[:, :x.shape[1]].set(x)
      self.variable('cache', 'cached_key', place, k)
      self.variable('cache', 'cached_value', place, v)
      return k, v
    cached_key = self.variable('cache', 'cached_key')
    cached_value = self.variable('cache', 'cached_value')
    cached_key.value = jax.lax.dynamic_update_slice_in_dim(cached_key.value, k, index, axis=1)
    cached_value.value = jax.lax.dynamic_update_slice_in_dim(cached_value.value, v, index, axis=1)
    return cached_key.value, cached_value.value


def _mlp(config: LlamaConfig, moe: Optional[MoeConfig]) -> nn.Module:
  """The SwiGLU MLP (wi_0 gate, wi_1 up, wo down), or an MoE block of `moe` (not None) with
  SwiGLU experts."""
  mlp = functools.partial(layers.GatedMlp, dropout_rate=config.dropout_rate,
                          dtype=config.dtype, activation='silu')
  expert = functools.partial(mlp, d_ff=config.d_ff)
  if moe is None:
    return expert(name='mlp')
  shared_d_ff = moe.shared_d_ff(config.d_ff)
  shared = None if shared_d_ff is None else functools.partial(mlp, d_ff=shared_d_ff)
  return MoeLayer(moe, expert, causal=True, shared_expert=shared, name='mlp')


class DecoderLayer(nn.Module):
  config: LlamaConfig
  sparse: bool = False

  @nn.compact
  def __call__(self, x, bias, segment_ids, positions, token_mask, cache_index, deterministic,
               cache_length=None):
    """x `[batch, length, d_model]`; bias None (whole sequences, of `segment_ids`) or the
    decoding's (`Attention`); token_mask `[batch, length]` (False: padding) or None; a decode
    step (`cache_index` set) has length 1."""
    cfg = self.config
    norm = functools.partial(layers.RMSNorm, cfg.layer_norm_epsilon, cfg.dtype,
                             scale_in_dtype=True)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    y = norm(name='pre_self_attention_layer_norm')(x)
    y = Attention(cfg, name='self_attention')(y, bias, segment_ids, positions, deterministic,
                                              cache_index, cache_length)
    x = x + dropout(y, deterministic=deterministic)
    y = norm(name='pre_mlp_layer_norm')(x)
    if not self.sparse:
      y = _mlp(cfg, None)(y, deterministic)
    elif cache_index is None and cache_length is None:
      y = _mlp(cfg, cfg.moe)(y, deterministic, token_mask)
    else:
      # Decoding (the prefill's prompts, then each step's new token) routes each sequence as
      # a group of its own, as T5's decoder does: a sequence's routing does not depend on the
      # rest of the batch, and a training group size that does not divide the prompts'
      # tokens is no obstacle (docs/inference.md).
      step_moe = dataclasses.replace(cfg.moe, grouping=grouping.PerExample())
      y = _mlp(cfg, step_moe)(y, deterministic, token_mask)
    x = x + dropout(y, deterministic=deterministic)
    return layers.constrain(x, ('batch', 'length', 'embed'))


class Decoder(nn.Module):
  config: LlamaConfig
  embedder: nn.Module

  def setup(self):
    cfg = self.config
    if not cfg.logits_via_embedding:
      self.logits_dense = layers.DenseGeneral(cfg.vocab_size, ('embed', 'vocab'),
                                              dtype=cfg.dtype, name='logits_dense')

  def project(self, x: Array) -> Array:
    """The final activations `[batch, length, d_model]` -> logits `[batch, length, vocab]`
    (float32): the output layer, or the embedding when tied."""
    logits = (self.embedder.attend(x) if self.config.logits_via_embedding
              else self.logits_dense(x))
    return layers.constrain(jnp.asarray(logits, jnp.float32), ('batch', 'length', 'vocab'))

  @nn.compact
  def __call__(self, tokens: Array, segment_ids: Optional[Array], positions: Optional[Array],
               deterministic: bool, decode: bool = False,
               cache_length: Optional[int] = None, project: bool = True) -> Array:
    """tokens `[batch, length]` -> logits `[batch, length, vocab]` (float32); with
    `project=False` the final activations `[batch, length, d_model]` that `project` turns
    into them.

    `decode=True`: the first call (no cache yet; the prompt, `cache_length` set) runs as
    usual and creates the cache (module docstring); every later call is one step: `tokens`
    `[batch, 1]` at `cache/index`, no segment ids or positions (the cache has them).
    """
    cfg = self.config
    cache_index = None
    if decode and self.has_variable('cache', 'index'):
      bias, positions, cache_index = self._step_inputs()
      cache_length = bias.shape[-1]
      token_mask = None
    else:
      batch, length = tokens.shape
      self._check_window(cache_length if decode else length)
      # The prompt's prefill attends by the einsum; training and evaluation by `attention`.
      bias = fused_attention.causal_bias(segment_ids, length) if decode else None
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      token_mask = None if segment_ids is None else segment_ids > 0
      if decode:
        self._create_cache(token_mask, positions, cache_length)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    x = dropout(self.embedder(tokens), deterministic=deterministic)
    x = stacking.apply_stack(DecoderLayer, cfg, 0, x,
                             (bias, segment_ids, positions, token_mask, cache_index),
                             (deterministic, cache_length if decode else None))
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, scale_in_dtype=True,
                       name='decoder_norm')(x)
    x = dropout(x, deterministic=deterministic)
    return self.project(x) if project else x

  def _check_window(self, length: int) -> None:
    cfg = self.config
    if cfg.sliding_window is not None and length > cfg.sliding_window:
      raise ValueError(
          f'Llama: sequences of {length} tokens, but {fields.binding(cfg, "sliding_window")} = '
          f'{cfg.sliding_window}: the checkpoint attends within that window and this model to '
          f'the whole context, the same only up to {cfg.sliding_window} tokens. Fix: feed at '
          f'most {cfg.sliding_window} tokens per row.')

  def _create_cache(self, token_mask: Optional[Array], positions: Array,
                    cache_length: int) -> None:
    """The decoder-level cache after a prompt `[batch, length]`: its real columns, and its
    last column and position as the next step's (the loops feed the last prompt token first)."""
    batch, length = positions.shape
    real = jnp.ones((batch, length), bool) if token_mask is None else token_mask
    self.variable('cache', 'index', lambda: jnp.asarray(length - 1, jnp.int32))
    self.variable('cache', 'key_valid', lambda: jnp.zeros((batch, cache_length), bool)
                  .at[:, :length].set(real))
    self.variable('cache', 'positions', lambda: positions[:, -1].astype(jnp.int32))

  def _step_inputs(self) -> Tuple[Array, Array, Array]:
    """-> the step's bias `[batch, 1, 1, max_length]`, positions `[batch, 1]` and cache
    column; marks the column real and advances `index` and `positions`."""
    index_var = self.variable('cache', 'index')
    key_valid_var = self.variable('cache', 'key_valid')
    positions_var = self.variable('cache', 'positions')
    index, positions = index_var.value, positions_var.value
    key_valid_var.value = key_valid_var.value.at[:, index].set(True)
    index_var.value = index + 1
    positions_var.value = positions + 1
    bias = layers.attention_bias_from_mask(key_valid_var.value[:, None, None, :])
    return bias, positions[:, None], index


class Llama(nn.Module):
  """`apply({'params': p}, decoder_input_tokens)` -> logits `[batch, length, vocab]` (float32).

  Every token id is a real token (Llama's 0 is one): padding is `decoder_segment_ids` 0. MoE
  auxiliary losses and metrics: pass `mutable=upcycle.moe.MOE_COLLECTIONS` and read them with
  `upcycle.moe.aux_losses` / `upcycle.moe.metrics`.
  """

  config: LlamaConfig

  def setup(self):
    cfg = self.config
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.d_model, cfg.dtype,
                                       embedding_init=EMBEDDING_INIT)
    self.decoder = Decoder(cfg, self.token_embedder)

  def __call__(self, decoder_input_tokens: Array, decoder_segment_ids: Optional[Array] = None,
               decoder_positions: Optional[Array] = None, enable_dropout: bool = False) -> Array:
    """`[batch, length]` int tokens -> `[batch, length, vocab]` float32.

    decoder_segment_ids: `[batch, length]`, each packed example's tokens one id >= 1, padding
      0; None: one example per row, no padding.
    decoder_positions: `[batch, length]`, each token's position in its example (HF's
      `position_ids`); None: 0, 1, 2, ... along the row.
    """
    return self.decoder(decoder_input_tokens, decoder_segment_ids, decoder_positions,
                        deterministic=not enable_dropout)

  def features(self, decoder_input_tokens: Array, decoder_segment_ids: Optional[Array] = None,
               decoder_positions: Optional[Array] = None,
               enable_dropout: bool = False) -> Array:
    """`__call__` up to its output layer: `[batch, length, d_model]`, which `project` turns
    into its logits (a loss that computes them a slice at a time:
    `losses.chunked_cross_entropy`)."""
    return self.decoder(decoder_input_tokens, decoder_segment_ids, decoder_positions,
                        deterministic=not enable_dropout, project=False)

  def project(self, features: Array) -> Array:
    """`[..., d_model]` final activations -> float32 logits `[..., vocab]`."""
    return self.decoder.project(features)

  def output_params(self, params: Any) -> Any:
    """The parameters `project` reads, a tree `apply` takes with `method=project`: the output
    layer's, or the embedding where it is tied (`logits_via_embedding`)."""
    if self.config.logits_via_embedding:
      return {'token_embedder': params['token_embedder']}
    return {'decoder': {'logits_dense': params['decoder']['logits_dense']}}

  def prefill(self, prompt_tokens: Array, prompt_mask: Array, max_length: int) -> Array:
    """Runs left-padded prompts and creates the decoding cache; -> their logits.

    Args:
      prompt_tokens: `[batch, prompt_len]`, each row's prompt at its end (HF's
        `padding_side='left'`), so that every row's next token is at the same column.
      prompt_mask: `[batch, prompt_len]`, 1 on the prompt, 0 on the padding before it (HF's
        `attention_mask`). Positions count from each row's first real token (HF generate's
        `cumsum(mask) - 1`); padding attends to nothing real and is not routed by MoE blocks.
      max_length: the longest sequence, prompt included: the cache's columns.

    Apply with `mutable=['cache']`; the returned variables' 'cache' is the initial cache. Its
    next step is the prompt's last column: the decoding loops start from a token (T5's start
    token), here the last prompt token, whose key and value that step computes again and
    writes over the same ones. Returns `[batch, prompt_len, vocab]` float32.
    """
    segment_ids = jnp.asarray(prompt_mask, jnp.int32)
    positions = (jnp.cumsum(segment_ids, axis=1) - 1) * segment_ids
    return self.decoder(prompt_tokens, segment_ids, positions, deterministic=True,
                        decode=True, cache_length=max_length)

  def decode_step(self, tokens: Array) -> Array:
    """One cached step: `[batch, 1]` tokens at `cache/index` -> logits `[batch, vocab]`.

    Apply with `{'params': p, 'cache': c}` and `mutable=['cache']` (the advanced cache).
    """
    return self.decoder(tokens, None, None, deterministic=True, decode=True)[:, 0]
