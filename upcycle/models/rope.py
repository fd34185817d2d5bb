"""Rotary position embeddings in HuggingFace's convention (Llama, Mistral, Qwen2).

HF rotates the two halves of each head (`rotate_half`), not interleaved pairs:

  x' = x * cos(p * f) + rotate_half(x) * sin(p * f),  rotate_half([a, b]) = [-b, a]

with `f` (`[head_dim / 2]`, repeated for both halves) the inverse frequencies
theta**(-2i / head_dim), optionally rescaled by Llama 3.1's `llama3` rule
(`Llama3RopeScaling`). The frequencies are numpy float32, computed as transformers computes
them in float32; cos and sin are float32 and cast to the activations' dtype before rotating,
as HF does.
"""

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import fields


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1's frequency rescaling (HF `rope_type: 'llama3'`, `_compute_llama3_parameters`).

  Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept,
  those longer than `original_max_position_embeddings / low_freq_factor` are stretched by
  `factor`, and those between are interpolated.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    for name in ('factor', 'low_freq_factor', 'high_freq_factor'):
      fields.number(self, name, 0.0, strictly=True)
    fields.integer(self, 'original_max_position_embeddings', 1)
    if self.high_freq_factor <= self.low_freq_factor:
      raise fields.ConfigError(
          f'{fields.binding(self, "high_freq_factor")} = {self.high_freq_factor}: expected more '
          f'than low_freq_factor ({self.low_freq_factor}); the interpolation divides by their '
          f'difference.')


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: Optional[Llama3RopeScaling] = None) -> np.ndarray:
  """-> `[head_dim / 2]` float32: theta**(-2i / head_dim), `scaling` applied."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
  if scaling is None:
    return inv_freq
  factor = np.float32(scaling.factor)
  low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
  old_context = np.float32(scaling.original_max_position_embeddings)
  wavelength = np.float32(2 * math.pi) / inv_freq
  stretched = np.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelength - low) / (high - low)
  smoothed = (1 - smooth) * stretched / factor + smooth * stretched
  medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
  return np.where(medium, smoothed, stretched).astype(np.float32)


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """x `[batch, length, heads, head_dim]`, positions `[batch, length]` int -> x rotated."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)   # [b, l, d/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]            # [b, l, 1, d]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-second, first], axis=-1) * sin
