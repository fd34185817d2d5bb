"""T5 v1.1 encoder-decoder with T5X `t5_1_1` parameter names; any MLP block may be MoE.

Parameter tree (docs/checkpoints.md, "Parameter names"):
  token_embedder/embedding [vocab, d_model]
  encoder/relpos_bias/rel_embedding [heads, buckets]
  encoder/layers_{i}/{pre_attention_layer_norm, attention, pre_mlp_layer_norm, mlp}
    (an MoE block's mlp/{expert, router[, shared_expert]}: `upcycle.moe.layer`)
  decoder/layers_{i}/{pre_self_attention_layer_norm, self_attention,
                      pre_cross_attention_layer_norm, encoder_decoder_attention,
                      pre_mlp_layer_norm, mlp}
  {encoder/encoder_norm, decoder/decoder_norm}/scale, decoder/logits_dense/kernel
With `scan_layers=True` each stack's `layers_{i}` become `layers/subblock_{j}` with a leading
`layers` axis (`scan_layout`); `remat_policy` recomputes block activations (`stacking`).

Decoding (`T5.prefill`, then `T5.decode_step` per token, both applied with
`mutable=['cache']`) keeps a 'cache' collection: per decoder layer the self-attention's keys
and values `[batch, max_decode_length, heads, d_kv]` and the cross-attention's, computed once
from the encoder output `[batch, src_len, heads, d_kv]`; at the decoder's top `position`
(scalar int32: the next step's index), `key_valid` `[batch, max_decode_length]` (positions
written so far) and `cross_bias` `[batch, 1, 1, src_len]` (encoder padding). Every non-scalar
cache leaf has the batch axis first, so beam search can expand and reorder it.
"""

import dataclasses
import functools
from typing import ClassVar, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import fields, layers
from upcycle.models import flops, scan_layout, stacking
from upcycle.moe import grouping, placement
from upcycle.moe.config import MoeConfig
from upcycle.moe.layer import MoeLayer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class T5Config:
  """T5 v1.1 hyperparameters (defaults: T5 v1.1 Base). MoE per stack: a MoeConfig or None,
  at the blocks `encoder_moe_layers` / `decoder_moe_layers` name (`upcycle.moe.placement`).

  Every field is checked at construction, so a wrong gin binding fails before any work,
  naming the binding (`models.T5Config.d_model`).
  """

  vocab_size: int = 32128
  d_model: int = 768
  num_heads: int = 12
  d_kv: int = 64
  d_ff: int = 2048
  num_encoder_layers: int = 12
  num_decoder_layers: int = 12
  dropout_rate: float = 0.0
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  logits_via_embedding: bool = False
  dtype: str = 'float32'
  encoder_moe: Optional[MoeConfig] = None
  decoder_moe: Optional[MoeConfig] = None
  encoder_moe_layers: placement.Placement = 'every_other'
  decoder_moe_layers: placement.Placement = 'every_other'
  scan_layers: bool = False
  remat_policy: str = 'none'

  # What changes the model's function but not its parameters' shapes: a checkpoint that
  # describes its config (an HF config.json) must agree on these (`pretrained.check_config`).
  FUNCTION_FIELDS: ClassVar[Tuple[str, ...]] = (
      'relative_attention_num_buckets', 'relative_attention_max_distance',
      'layer_norm_epsilon', 'logits_via_embedding')

  def __post_init__(self):
    for name in ('vocab_size', 'd_model', 'num_heads', 'd_kv', 'd_ff', 'num_encoder_layers',
                 'num_decoder_layers', 'relative_attention_num_buckets',
                 'relative_attention_max_distance'):
      fields.integer(self, name, 1)
    fields.fraction(self, 'dropout_rate')
    fields.number(self, 'layer_norm_epsilon', 0.0, strictly=True)
    fields.boolean(self, 'logits_via_embedding')
    fields.choice(self, 'dtype', layers.DTYPES)
    for name in ('encoder_moe', 'decoder_moe'):
      fields.optional_instance(self, name, MoeConfig, '@moe.MoeConfig()')
    placement.check(self, 'encoder_moe_layers', self.num_encoder_layers)
    placement.check(self, 'decoder_moe_layers', self.num_decoder_layers)
    fields.boolean(self, 'scan_layers')
    fields.choice(self, 'remat_policy', tuple(stacking.REMAT_POLICIES))
    if self.scan_layers:
      for stack, _, _, num_layers, sparse in self.layer_stacks():
        scan_layout.check_scannable(sparse, num_layers,
                                    fields.binding(self, f'{stack}_moe_layers'))
    if self.decoder_moe is not None:
      self.decoder_moe.router.check_causal(
          f"{fields.binding(self, 'decoder_moe')}.router = {self.decoder_moe.router!r}")

  def sparse_layers(self, stack: str) -> tuple:
    """Indices of the MoE blocks of 'encoder' or 'decoder'."""
    if getattr(self, f'{stack}_moe') is None:
      return ()
    num_layers = getattr(self, f'num_{stack}_layers')
    return placement.sparse_layer_indices(getattr(self, f'{stack}_moe_layers'), num_layers)

  def moe_positions(self) -> dict:
    """{MLP path of every MoE block: (stack, layer index)}: where the upcycling plan's
    layer-dependent initializers (Drop's ramp) read each block's place."""
    return stacking.moe_positions(self, 'mlp')

  def with_depths(self, depths) -> 'T5Config':
    """This config, unscanned, with its stacks cut to their first `depths` layers (in
    `layer_stacks()` order), their MoE blocks where they were: a shallow copy of the model
    (`upcycle/fit/step_count.py` counts a step from such copies)."""
    encoder, decoder = depths
    return dataclasses.replace(
        self, num_encoder_layers=encoder, num_decoder_layers=decoder, scan_layers=False,
        encoder_moe_layers=tuple(i for i in self.sparse_layers('encoder') if i < encoder),
        decoder_moe_layers=tuple(i for i in self.sparse_layers('decoder') if i < decoder))

  def layer_stacks(self) -> list:
    """(prefix, unrolled block name, scanned name, num_layers, sparse): encoder, decoder."""
    return [(stack, 'layers_{}', 'layers', n, self.sparse_layers(stack))
            for stack, n in (('encoder', self.num_encoder_layers),
                             ('decoder', self.num_decoder_layers))]

  def forward_flops(self, batch: int, inputs_length: int, targets_length: int) -> int:
    """Forward FLOPs on `[batch, inputs_length]` inputs and `[batch, targets_length]` decoder
    tokens (`models/flops.py` counts)."""
    d, inner = self.d_model, self.num_heads * self.d_kv
    unit = 2 * 3 * d                                # wi_0, wi_1, wo per d_ff unit
    le, ld = inputs_length, targets_length
    total = 0
    for i in range(self.num_encoder_layers):
      moe = self.encoder_moe if i in self.sparse_layers('encoder') else None
      total += batch * flops.attention(le, le, d, inner)
      total += flops.mlp_block(moe, batch, le, d, self.d_ff, unit)
    for i in range(self.num_decoder_layers):
      moe = self.decoder_moe if i in self.sparse_layers('decoder') else None
      total += batch * (flops.attention(ld, ld, d, inner) + flops.attention(ld, le, d, inner))
      total += flops.mlp_block(moe, batch, ld, d, self.d_ff, unit)
    return total + 2 * batch * ld * d * self.vocab_size   # logits


def _mlp(config: T5Config, moe: Optional[MoeConfig], sparse: bool, causal: bool) -> nn.Module:
  """The dense MLP, or an MoE block of `moe` in its place (with its shared expert, if any)."""
  mlp = functools.partial(layers.GatedMlp, dropout_rate=config.dropout_rate, dtype=config.dtype)
  expert = functools.partial(mlp, d_ff=config.d_ff)
  if not sparse:
    return expert(name='mlp')
  shared_d_ff = moe.shared_d_ff(config.d_ff)
  shared = None if shared_d_ff is None else functools.partial(mlp, d_ff=shared_d_ff)
  return MoeLayer(moe, expert, causal=causal, shared_expert=shared, name='mlp')


def _attention(config: T5Config, name: str, kv_cache: Optional[str] = None) -> nn.Module:
  return layers.MultiHeadAttention(
      num_heads=config.num_heads, head_dim=config.d_kv, joined_kv=True, use_bias=False,
      scale_logits=False, dropout_rate=config.dropout_rate, dtype=config.dtype,
      kv_cache=kv_cache, name=name)


class EncoderLayer(nn.Module):
  config: T5Config
  sparse: bool = False

  @nn.compact
  def __call__(self, x, bias, token_mask, deterministic):
    cfg = self.config
    norm = functools.partial(layers.RMSNorm, cfg.layer_norm_epsilon, cfg.dtype)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    y = norm(name='pre_attention_layer_norm')(x)
    y = _attention(cfg, 'attention')(y, y, bias, deterministic)
    x = x + dropout(y, deterministic=deterministic)
    y = norm(name='pre_mlp_layer_norm')(x)
    mlp = _mlp(cfg, cfg.encoder_moe, self.sparse, causal=False)
    y = mlp(y, deterministic, token_mask) if self.sparse else mlp(y, deterministic)
    x = x + dropout(y, deterministic=deterministic)
    return layers.constrain(x, ('batch', 'length', 'embed'))


class DecoderLayer(nn.Module):
  config: T5Config
  sparse: bool = False

  @nn.compact
  def __call__(self, x, encoded, self_bias, cross_bias, token_mask, position, deterministic,
               decode=False):
    """x `[batch, length, d_model]`; a decode step (`position` set) has length 1."""
    cfg = self.config
    norm = functools.partial(layers.RMSNorm, cfg.layer_norm_epsilon, cfg.dtype)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    y = norm(name='pre_self_attention_layer_norm')(x)
    y = _attention(cfg, 'self_attention', 'append')(
        y, y, self_bias, deterministic, decode, position)
    x = x + dropout(y, deterministic=deterministic)
    y = norm(name='pre_cross_attention_layer_norm')(x)
    y = _attention(cfg, 'encoder_decoder_attention', 'fixed')(
        y, encoded, cross_bias, deterministic, decode)
    x = x + dropout(y, deterministic=deterministic)
    y = norm(name='pre_mlp_layer_norm')(x)
    if not self.sparse:
      y = _mlp(cfg, None, False, causal=True)(y, deterministic)
    elif not decode:
      y = _mlp(cfg, cfg.decoder_moe, True, causal=True)(y, deterministic, token_mask)
    else:
      # A decode step routes each sequence's new token `[batch, 1]` as a group of its own,
      # whatever the training grouping: capacity(1) is 1 slot per expert and the K choices
      # are distinct experts, so no token is dropped and a sequence's routing does not depend
      # on the other sequences of the batch, nor on whether they have finished (docs/inference.md).
      # The prefill's placeholder run (its outputs unused) is grouped the same way, so a
      # training group size that does not divide batch x max_length is no obstacle.
      step_moe = dataclasses.replace(cfg.decoder_moe, grouping=grouping.PerExample())
      y = _mlp(cfg, step_moe, True, causal=True)(y, deterministic)
    x = x + dropout(y, deterministic=deterministic)
    return layers.constrain(x, ('batch', 'length', 'embed'))


class Encoder(nn.Module):
  config: T5Config
  embedder: nn.Module

  @nn.compact
  def __call__(self, tokens, segment_ids, deterministic):
    """tokens `[batch, length]` (0 = padding) -> `[batch, length, d_model]`."""
    cfg = self.config
    valid = tokens > 0
    mask = layers.combine_masks(
        layers.make_attention_mask(valid, valid),
        None if segment_ids is None else layers.make_segment_mask(segment_ids, segment_ids))
    length = tokens.shape[1]
    relpos = layers.RelativePositionBias(
        cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
        cfg.num_heads, bidirectional=True, dtype=cfg.dtype, name='relpos_bias')(length, length)
    bias = relpos + layers.attention_bias_from_mask(mask, cfg.dtype)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    x = dropout(self.embedder(tokens), deterministic=deterministic)
    x = stacking.apply_stack(EncoderLayer, cfg, 0, x, (bias, valid), (deterministic,))
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name='encoder_norm')(x)
    return dropout(x, deterministic=deterministic)


class Decoder(nn.Module):
  config: T5Config
  embedder: nn.Module

  @nn.compact
  def __call__(self, *, encoded, encoder_tokens, decoder_tokens, deterministic,
               decoder_target_tokens=None, encoder_segment_ids=None, decoder_segment_ids=None,
               decode=False):
    """-> logits `[batch, target_length, vocab]` (float32).

    `decode=True`: the first call (no cache yet; `decoder_tokens` `[batch, max_decode_length]`,
    e.g. zeros) runs as usual and creates the cache; every later call is one step:
    `decoder_tokens` `[batch, 1]` is the token at `cache/position`, `encoded` and
    `encoder_tokens` may be None, and the logits are `[batch, 1, vocab]`.
    """
    cfg = self.config
    relpos = layers.RelativePositionBias(
        cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
        cfg.num_heads, bidirectional=False, dtype=cfg.dtype, name='relpos_bias')
    position = None
    if decode and self.has_variable('cache', 'position'):
      self_bias, cross_bias, position = self._step_biases(relpos)
      decoder_valid = None
    else:
      if decode and (encoder_segment_ids is not None or decoder_segment_ids is not None):
        raise ValueError('T5 decoding takes unpacked examples: pass no segment ids '
                         '(an unpacked TextPipeline, pack=False).')
      length = decoder_tokens.shape[1]
      decoder_valid = (jnp.ones(decoder_tokens.shape, bool) if decoder_target_tokens is None
                       else decoder_target_tokens > 0)
      segments = lambda q, k: None if q is None else layers.make_segment_mask(q, k)
      self_mask = layers.combine_masks(
          layers.make_causal_mask(length),
          layers.make_attention_mask(decoder_valid, decoder_valid),
          segments(decoder_segment_ids, decoder_segment_ids))
      cross_mask = layers.combine_masks(
          layers.make_attention_mask(decoder_valid, encoder_tokens > 0),
          segments(decoder_segment_ids, encoder_segment_ids))
      self_bias = relpos(length, length) + layers.attention_bias_from_mask(self_mask, cfg.dtype)
      cross_bias = layers.attention_bias_from_mask(cross_mask, cfg.dtype)
      if decode:
        self._create_cache(decoder_tokens.shape, encoder_tokens)
    dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
    x = dropout(self.embedder(decoder_tokens), deterministic=deterministic)
    x = stacking.apply_stack(
        DecoderLayer, cfg, 1, x, (encoded, self_bias, cross_bias, decoder_valid, position),
        (deterministic, decode))
    x = layers.RMSNorm(cfg.layer_norm_epsilon, cfg.dtype, name='decoder_norm')(x)
    x = dropout(x, deterministic=deterministic)
    if cfg.logits_via_embedding:
      # Tied embeddings (T5 v1.0 style): rescale, as T5 does, before attending.
      logits = self.embedder.attend(x / jnp.sqrt(x.shape[-1]).astype(x.dtype))
    else:
      logits = layers.DenseGeneral(cfg.vocab_size, ('embed', 'vocab'), dtype=cfg.dtype,
                                   name='logits_dense')(x)
    return layers.constrain(jnp.asarray(logits, jnp.float32), ('batch', 'length', 'vocab'))

  def _create_cache(self, decoder_shape, encoder_tokens) -> None:
    """The decoder-level cache: next position, written key positions, encoder padding bias."""
    batch, max_decode_length = decoder_shape
    one_query = jnp.ones((batch, 1), bool)
    self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
    self.variable('cache', 'key_valid', lambda: jnp.zeros((batch, max_decode_length), bool))
    self.variable('cache', 'cross_bias', lambda: layers.attention_bias_from_mask(
        layers.make_attention_mask(one_query, encoder_tokens > 0), self.config.dtype))

  def _step_biases(self, relpos):
    """-> self bias `[batch, heads, 1, max_len]`, cross bias `[batch, 1, 1, src_len]`, position;
    advances `cache/position` and marks it in `cache/key_valid`."""
    position_var = self.variable('cache', 'position')
    key_valid_var = self.variable('cache', 'key_valid')
    position = position_var.value
    length = key_valid_var.value.shape[1]
    key_valid = key_valid_var.value.at[:, position].set(True)
    key_valid_var.value = key_valid
    position_var.value = position + 1
    row = jax.lax.dynamic_slice_in_dim(relpos(length, length), position, 1, axis=2)
    self_bias = row + layers.attention_bias_from_mask(key_valid[:, None, None, :],
                                                      self.config.dtype)
    return self_bias, self.variable('cache', 'cross_bias').value, position


class T5(nn.Module):
  """T5 v1.1. `apply({'params': p}, encoder_input_tokens, decoder_input_tokens)` -> logits.

  Token id 0 is padding. Optional `decoder_target_tokens` masks decoder padding
  (as T5X does); segment ids mask attention between packed examples. MoE
  auxiliary losses and metrics: pass `mutable=upcycle.moe.MOE_COLLECTIONS` and read
  them with `upcycle.moe.aux_losses` / `upcycle.moe.metrics`.
  """

  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = layers.Embed(cfg.vocab_size, cfg.d_model, cfg.dtype)
    self.encoder = Encoder(cfg, self.token_embedder)
    self.decoder = Decoder(cfg, self.token_embedder)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, enable_dropout=False):
    return self.encoder(tokens=encoder_input_tokens, segment_ids=encoder_segment_ids,
                        deterministic=not enable_dropout)

  def prefill(self, encoder_input_tokens: Array, max_decode_length: int) -> None:
    """Encodes `[batch, src_len]` and creates the decoding cache for `max_decode_length` steps.

    Apply with `mutable=['cache']`; the returned variables' 'cache' is the initial cache.
    """
    encoded = self.encode(encoder_input_tokens)
    placeholder = jnp.zeros((encoder_input_tokens.shape[0], max_decode_length), jnp.int32)
    self.decoder(encoded=encoded, encoder_tokens=encoder_input_tokens, decoder_tokens=placeholder,
                 deterministic=True, decode=True)

  def decode_step(self, decoder_tokens: Array) -> Array:
    """One cached step: `[batch, 1]` tokens at `cache/position` -> logits `[batch, vocab]`.

    Apply with `{'params': p, 'cache': c}` and `mutable=['cache']` (the advanced cache).
    """
    logits = self.decoder(encoded=None, encoder_tokens=None, decoder_tokens=decoder_tokens,
                          deterministic=True, decode=True)
    return logits[:, 0]

  def __call__(self, encoder_input_tokens: Array, decoder_input_tokens: Array,
               decoder_target_tokens: Optional[Array] = None,
               encoder_segment_ids: Optional[Array] = None,
               decoder_segment_ids: Optional[Array] = None,
               enable_dropout: bool = False) -> Array:
    """`[batch, src_len]`, `[batch, tgt_len]` int tokens -> `[batch, tgt_len, vocab]` float32."""
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, enable_dropout)
    return self.decoder(encoded=encoded, encoder_tokens=encoder_input_tokens,
                        decoder_tokens=decoder_input_tokens,
                        decoder_target_tokens=decoder_target_tokens,
                        encoder_segment_ids=encoder_segment_ids,
                        decoder_segment_ids=decoder_segment_ids,
                        deterministic=not enable_dropout)
