"""ViT classifier with big_vision parameter names; any MLP block may be MoE.

  embedding/{kernel [ph, pw, channels, width], bias}
  pos_embedding [1, grid_h * grid_w, width]      (no class-token slot)
  cls [1, 1, width]                              (prepended after the position embedding)
  Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
                                MlpBlock_0/{Dense_0, Dense_1}}
    (an MoE block's MlpBlock_0/{expert, router[, shared_expert]}: `upcycle.moe.layer`)
  Transformer/encoder_norm, [pre_logits], head, [MAPHead_0]
With `scan_layers=True`, `encoderblock_{i}` become `encoderblock/subblock_{j}` with a leading
`layers` axis (`scan_layout`); `remat_policy` recomputes block activations (`stacking`).
"""

import dataclasses
import functools
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import fields, layers
from upcycle.models import flops, scan_layout, stacking
from upcycle.moe import placement
from upcycle.moe.config import MoeConfig
from upcycle.moe.layer import MoeLayer

Array = jax.Array

POOL_TYPES = ('token', 'gap', 'map')


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """ViT hyperparameters (defaults: ViT-B/16 at 224px). `moe`: a MoeConfig or None (dense), at
  the blocks `moe_layers` names (`upcycle.moe.placement`: 'every_other', 'last_2', indices...).

  Every field is checked at construction, so a wrong gin binding fails before any work,
  naming the binding (`models.ViTConfig.width`).
  """

  num_classes: int = 1000
  image_size: Tuple[int, int] = (224, 224)
  patch_size: Tuple[int, int] = (16, 16)
  num_channels: int = 3
  width: int = 768
  depth: int = 12
  mlp_dim: int = 3072
  num_heads: int = 12
  pool_type: str = 'token'
  representation_size: Optional[int] = None
  dropout_rate: float = 0.0
  layer_norm_epsilon: float = 1e-6
  approximate_gelu: bool = True
  head_zeroinit: bool = True
  dtype: str = 'float32'
  moe: Optional[MoeConfig] = None
  moe_layers: placement.Placement = 'every_other'
  scan_layers: bool = False
  remat_policy: str = 'none'

  def __post_init__(self):
    for name in ('num_classes', 'num_channels', 'width', 'depth', 'mlp_dim', 'num_heads'):
      fields.integer(self, name, 1)
    fields.integers(self, 'image_size', 2, 1)
    fields.integers(self, 'patch_size', 2, 1)
    object.__setattr__(self, 'image_size', tuple(self.image_size))
    object.__setattr__(self, 'patch_size', tuple(self.patch_size))
    fields.choice(self, 'pool_type', POOL_TYPES)
    fields.optional_integer(self, 'representation_size', 1)
    fields.fraction(self, 'dropout_rate')
    fields.number(self, 'layer_norm_epsilon', 0.0, strictly=True)
    fields.boolean(self, 'approximate_gelu')
    fields.boolean(self, 'head_zeroinit')
    fields.choice(self, 'dtype', layers.DTYPES)
    fields.optional_instance(self, 'moe', MoeConfig, '@moe.MoeConfig()')
    placement.check(self, 'moe_layers', self.depth)
    fields.boolean(self, 'scan_layers')
    fields.choice(self, 'remat_policy', tuple(stacking.REMAT_POLICIES))
    if self.scan_layers:
      scan_layout.check_scannable(self.sparse_layers(), self.depth,
                                  fields.binding(self, 'moe_layers'))
    if self.width % self.num_heads:
      raise fields.ConfigError(
          f'{fields.binding(self, "width")} = {self.width}: not divisible by '
          f'num_heads = {self.num_heads}.')
    if any(i % p for i, p in zip(self.image_size, self.patch_size)):
      raise fields.ConfigError(
          f'{fields.binding(self, "image_size")} = {self.image_size}: not a multiple of '
          f'patch_size = {self.patch_size}.')

  @property
  def grid(self) -> Tuple[int, int]:
    return tuple(i // p for i, p in zip(self.image_size, self.patch_size))

  def sparse_layers(self) -> tuple:
    if self.moe is None:
      return ()
    return placement.sparse_layer_indices(self.moe_layers, self.depth)

  def moe_positions(self) -> dict:
    """{MLP path of every MoE block: (stack, layer index)} (`T5Config.moe_positions`)."""
    return stacking.moe_positions(self, 'MlpBlock_0')

  def with_depths(self, depths) -> 'ViTConfig':
    """This config, unscanned, with its stacks cut to their first `depths` layers (in
    `layer_stacks()` order), their MoE blocks where they were: a shallow copy of the model
    (`upcycle/fit/step_count.py` counts a step from such copies)."""
    return scan_layout.cut_one_stack(self, 'depth', depths)

  def layer_stacks(self) -> list:
    """(prefix, unrolled block name, scanned name, num_layers, sparse) per stack (`scan_layout`)."""
    return [('Transformer', 'encoderblock_{}', 'encoderblock', self.depth, self.sparse_layers())]

  def forward_flops(self, batch: int) -> int:
    """Forward FLOPs on `batch` images (`models/flops.py` counts)."""
    w, (gh, gw), (ph, pw) = self.width, self.grid, self.patch_size
    patches = gh * gw
    n = patches + (1 if self.pool_type == 'token' else 0)
    unit = 2 * 2 * w                                # Dense_0, Dense_1 per mlp_dim unit
    total = 2 * batch * patches * ph * pw * self.num_channels * w   # patch embedding
    sparse = self.sparse_layers()
    for i in range(self.depth):
      moe = self.moe if i in sparse else None
      total += (batch * flops.attention(n, n, w, w)
                + flops.mlp_block(moe, batch, n, w, self.mlp_dim, unit))
    if self.pool_type == 'map':                     # one probe query, then an MLP on it
      total += batch * (flops.attention(1, n, w, w) + self.mlp_dim * unit)
    features = w
    if self.representation_size is not None:
      total += 2 * batch * w * self.representation_size
      features = self.representation_size
    return total + 2 * batch * features * self.num_classes


def _attention(cfg: ViTConfig) -> nn.Module:
  return layers.MultiHeadAttention(
      num_heads=cfg.num_heads, head_dim=cfg.width // cfg.num_heads, joined_kv=False,
      use_bias=True, scale_logits=True, dtype=cfg.dtype,
      kernel_init=nn.initializers.xavier_uniform(), name='MultiHeadDotProductAttention_0')


def _mlp(cfg: ViTConfig, sparse: bool) -> nn.Module:
  """The dense MLP, or an MoE block of `cfg.moe` in its place (with its shared expert, if any)."""
  mlp = functools.partial(layers.Mlp, dropout_rate=cfg.dropout_rate,
                          approximate_gelu=cfg.approximate_gelu, dtype=cfg.dtype)
  expert = functools.partial(mlp, mlp_dim=cfg.mlp_dim)
  if not sparse:
    return expert(name='MlpBlock_0')
  shared_dim = cfg.moe.shared_d_ff(cfg.mlp_dim)
  shared = None if shared_dim is None else functools.partial(mlp, mlp_dim=shared_dim)
  return MoeLayer(cfg.moe, expert, shared_expert=shared, name='MlpBlock_0')


class EncoderBlock(nn.Module):
  config: ViTConfig
  sparse: bool = False

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.config
    norm = functools.partial(layers.LayerNorm, cfg.layer_norm_epsilon, cfg.dtype)
    y = norm(name='LayerNorm_0')(x)
    y = _attention(cfg)(y, y, None, deterministic)
    x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = _mlp(cfg, self.sparse)(norm(name='LayerNorm_1')(x), deterministic)
    x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    return layers.constrain(x, ('batch', 'length', 'embed'))


class MAPHead(nn.Module):
  """Multihead attention pooling: a learned probe attends over the tokens."""

  config: ViTConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    probe = self.param('probe', nn.with_logical_partitioning(
        nn.initializers.xavier_uniform(), (None, None, 'embed')), (1, 1, x.shape[-1]))
    probe = jnp.tile(jnp.asarray(probe, x.dtype), (x.shape[0], 1, 1))
    y = _attention(cfg)(probe, x, None, True)
    z = layers.LayerNorm(cfg.layer_norm_epsilon, cfg.dtype, name='LayerNorm_0')(y)
    mlp = layers.Mlp(cfg.mlp_dim, approximate_gelu=cfg.approximate_gelu, dtype=cfg.dtype,
                     name='MlpBlock_0')
    return (y + mlp(z, True))[:, 0]


class Transformer(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    cfg = self.config
    x = stacking.apply_stack(EncoderBlock, cfg, 0, x, (), (deterministic,))
    return layers.LayerNorm(cfg.layer_norm_epsilon, cfg.dtype, name='encoder_norm')(x)


class ViT(nn.Module):
  """`apply({'params': p}, images [batch, h, w, c], train=False)` -> logits `[batch, classes]`.

  `apply(..., method=ViT.features)` gives the pre-logit features a linear probe uses.
  """

  config: ViTConfig

  def setup(self):
    cfg = self.config
    width = cfg.width
    self.embedding = nn.Conv(
        width, cfg.patch_size, strides=cfg.patch_size, padding='VALID', dtype=cfg.dtype,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), (None, None, None, 'embed')),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)))
    gh, gw = cfg.grid
    self.pos_embedding = self.param('pos_embedding', nn.with_logical_partitioning(
        nn.initializers.normal(stddev=1 / width ** 0.5), (None, 'length', 'embed')),
                                    (1, gh * gw, width))
    if cfg.pool_type == 'token':
      self.cls = self.param('cls', nn.with_logical_partitioning(
          nn.initializers.zeros, (None, None, 'embed')), (1, 1, width))
    self.Transformer = Transformer(cfg)
    if cfg.pool_type == 'map':
      self.MAPHead_0 = MAPHead(cfg)
    if cfg.representation_size is not None:
      self.pre_logits = layers.DenseGeneral(
          cfg.representation_size, ('embed', 'mlp'), use_bias=True, dtype=cfg.dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate)
    self.head = layers.DenseGeneral(
        cfg.num_classes, ('embed', 'classes'), use_bias=True, dtype=cfg.dtype,
        kernel_init=nn.initializers.zeros if cfg.head_zeroinit else layers.default_kernel_init)

  def features(self, images: Array, train: bool = False) -> Array:
    """`[batch, h, w, c]` -> `[batch, width or representation_size]`."""
    cfg = self.config
    deterministic = not train
    x = self.embedding(jnp.asarray(images, cfg.dtype))
    batch, gh, gw, width = x.shape
    if (gh, gw) != cfg.grid:
      raise ValueError(f'ViT got images of {images.shape[1:3]} -> a {gh}x{gw} patch grid; the '
                       f'config (image_size={cfg.image_size}) expects {cfg.grid}.')
    x = x.reshape(batch, gh * gw, width) + jnp.asarray(self.pos_embedding, x.dtype)
    if cfg.pool_type == 'token':
      x = jnp.concatenate([jnp.tile(jnp.asarray(self.cls, x.dtype), (batch, 1, 1)), x], axis=1)
    x = self.dropout(x, deterministic=deterministic)
    x = self.Transformer(layers.constrain(x, ('batch', 'length', 'embed')), deterministic)
    if cfg.pool_type == 'token':
      x = x[:, 0]
    elif cfg.pool_type == 'gap':
      x = jnp.mean(x, axis=1)
    else:
      x = self.MAPHead_0(x)
    if cfg.representation_size is not None:
      x = nn.tanh(self.pre_logits(x))
    return x

  def __call__(self, images: Array, train: bool = False) -> Array:
    return jnp.asarray(self.head(self.features(images, train)), jnp.float32)
