"""Training FLOPs per step, from the model config, the batch shape and the routing capacity.

Counts the matrix multiplications (2 FLOPs per multiply-add), which dominate; norms,
softmaxes, activations, the router's top-k and the MoE dispatch/combine (a gather/scatter
with `dispatch='indices'`) are left out. A training step is 3 forward passes (the backward
pass costs two). An MoE block computes its experts on every capacity slot, filled or not
(with `dispatch='ragged'`, on each token's k choices only):
groups x E x capacity slots of one expert MLP each, plus the router (d x E per token), with
the training capacity factor and the grouping of `MoeConfig` (padding included), and its
shared expert (`MoeConfig.shared_expert`) on every token.
"""

from typing import Optional

from upcycle.models.llama import LlamaConfig
from upcycle.models.t5 import T5Config
from upcycle.models.vit import ViTConfig
from upcycle.moe.config import MoeConfig

TRAIN_PASSES = 3


def _attention(queries: int, keys: int, d_in: int, inner: int) -> int:
  """q/o projections of the queries, k/v of the keys, scores and the weighted sum."""
  return 2 * (2 * queries * d_in * inner + 2 * keys * d_in * inner + 2 * queries * keys * inner)


def _mlp_block(moe: Optional[MoeConfig], batch: int, length: int, d: int, d_ff: int,
               unit_flops: int) -> int:
  """A dense MLP of `d_ff` units, `unit_flops` per unit and token, on batch x length tokens,
  or an MoE block of it: its experts on every capacity slot, its router, its shared expert."""
  tokens = batch * length
  if moe is None:
    return tokens * d_ff * unit_flops
  plan = moe.group_plan(batch, length)
  if moe.dropless:     # each token's k rows, nothing more
    slots = plan.num_groups * plan.group_size * moe.router.experts_per_token
  else:
    slots = plan.num_groups * moe.num_experts * moe.capacity(plan.group_size, deterministic=False)
  shared = tokens * (moe.shared_d_ff(d_ff) or 0) * unit_flops
  return slots * d_ff * unit_flops + 2 * tokens * d * moe.num_experts + shared


def t5_forward_flops(config: T5Config, batch: int, inputs_length: int,
                     targets_length: int) -> int:
  """Forward FLOPs of T5 on `[batch, inputs_length]` inputs and `[batch, targets_length]`
  decoder tokens."""
  d, inner = config.d_model, config.num_heads * config.d_kv
  unit = 2 * 3 * d                                # wi_0, wi_1, wo per d_ff unit
  le, ld = inputs_length, targets_length
  total = 0
  for i in range(config.num_encoder_layers):
    moe = config.encoder_moe if i in config.sparse_layers('encoder') else None
    total += batch * _attention(le, le, d, inner)
    total += _mlp_block(moe, batch, le, d, config.d_ff, unit)
  for i in range(config.num_decoder_layers):
    moe = config.decoder_moe if i in config.sparse_layers('decoder') else None
    total += batch * (_attention(ld, ld, d, inner) + _attention(ld, le, d, inner))
    total += _mlp_block(moe, batch, ld, d, config.d_ff, unit)
  return total + 2 * batch * ld * d * config.vocab_size   # logits


def vit_forward_flops(config: ViTConfig, batch: int) -> int:
  """Forward FLOPs of ViT on `batch` images."""
  w, (gh, gw), (ph, pw) = config.width, config.grid, config.patch_size
  patches = gh * gw
  n = patches + (1 if config.pool_type == 'token' else 0)
  unit = 2 * 2 * w                                # Dense_0, Dense_1 per mlp_dim unit
  total = 2 * batch * patches * ph * pw * config.num_channels * w   # patch embedding
  sparse = config.sparse_layers()
  for i in range(config.depth):
    moe = config.moe if i in sparse else None
    total += batch * _attention(n, n, w, w) + _mlp_block(moe, batch, n, w, config.mlp_dim, unit)
  if config.pool_type == 'map':                   # one probe query, then an MLP on it
    total += batch * (_attention(1, n, w, w) + config.mlp_dim * unit)
  features = w
  if config.representation_size is not None:
    total += 2 * batch * w * config.representation_size
    features = config.representation_size
  return total + 2 * batch * features * config.num_classes


def llama_forward_flops(config: LlamaConfig, batch: int, length: int) -> int:
  """Forward FLOPs of a Llama on `[batch, length]` tokens: q/o projections over all heads,
  k/v over the key/value heads (grouped-query attention), scores and sum over all heads."""
  d, hd = config.d_model, config.head_dim
  q_inner, kv_inner = config.num_heads * hd, config.num_kv_heads * hd
  attention = 2 * length * d * (2 * q_inner + 2 * kv_inner) + 2 * 2 * length * length * q_inner
  unit = 2 * 3 * d                                # wi_0 (gate), wi_1 (up), wo (down)
  sparse = config.sparse_layers()
  total = 0
  for i in range(config.num_layers):
    moe = config.moe if i in sparse else None
    total += batch * attention + _mlp_block(moe, batch, length, d, config.d_ff, unit)
  return total + 2 * batch * length * d * config.vocab_size   # logits


def train_flops(forward_flops: int) -> int:
  """One training step: the forward pass and a backward pass costing two."""
  return TRAIN_PASSES * forward_flops
