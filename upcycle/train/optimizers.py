"""Optimizers and learning-rate schedules: T5X's Adafactor + rsqrt, and AdamW for ViT.

Schedules are functions of the optimizer's own step count. An upcycled run
carries the dense run's count (upcycle/upcycling/optimizer.py), so the schedule
continues where the dense run stopped.
"""

import dataclasses
from typing import Callable, Optional

import jax.numpy as jnp
import optax

Schedule = Callable[[jnp.ndarray], jnp.ndarray]


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000) -> Schedule:
  """T5X's inverse square root: base / sqrt(max(step, warmup)) (constant during warmup)."""
  def schedule(step):
    return base_learning_rate / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))
  return schedule


def constant_schedule(learning_rate: float = 1e-3) -> Schedule:
  """A constant learning rate (T5X's fine-tuning default, 1e-3 with Adafactor)."""
  return lambda step: jnp.full((), learning_rate, jnp.float32)


def warmup_decay_schedule(peak_learning_rate: float, warmup_steps: int, total_steps: int,
                          decay: str = 'cosine', end_learning_rate: float = 0.0) -> Schedule:
  """Linear warmup from 0 to the peak, then cosine or linear decay to the end value."""
  if decay == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak_learning_rate, warmup_steps,
                                              max(total_steps, warmup_steps + 1),
                                              end_learning_rate)
  if decay == 'linear':
    return optax.join_schedules([
        optax.linear_schedule(0.0, peak_learning_rate, warmup_steps),
        optax.linear_schedule(peak_learning_rate, end_learning_rate,
                              max(total_steps - warmup_steps, 1))], [warmup_steps])
  raise ValueError(f"decay={decay!r}: expected 'cosine' or 'linear'.")


@dataclasses.dataclass(frozen=True)
class Adafactor:
  """optax Adafactor with T5X's defaults (factored second moments, decay 0.8,
  update clipping 1.0, step size scaled by parameter RMS, no momentum)."""

  schedule: Schedule = dataclasses.field(default_factory=rsqrt_schedule)
  decay_rate: float = 0.8
  clipping_threshold: Optional[float] = 1.0
  multiply_by_parameter_scale: bool = True
  factored: bool = True
  min_dim_size_to_factor: int = 128
  momentum: Optional[float] = None

  def build(self) -> optax.GradientTransformation:
    return optax.adafactor(
        learning_rate=self.schedule, decay_rate=self.decay_rate,
        clipping_threshold=self.clipping_threshold,
        multiply_by_parameter_scale=self.multiply_by_parameter_scale,
        factored=self.factored, min_dim_size_to_factor=self.min_dim_size_to_factor,
        momentum=self.momentum)


@dataclasses.dataclass(frozen=True)
class AdamW:
  """AdamW with global-norm clipping, the usual ViT recipe (big_vision/vmoe)."""

  schedule: Schedule
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 1e-4
  grad_clip_norm: Optional[float] = 1.0

  def build(self) -> optax.GradientTransformation:
    adam = optax.adamw(self.schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
    if self.grad_clip_norm is None:
      return adam
    return optax.chain(optax.clip_by_global_norm(self.grad_clip_norm), adam)
