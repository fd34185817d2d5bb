"""Optimizers and learning-rate schedules, as the trainer's `Optimizer`s (interfaces.py).

  T5XAdafactor        T5X's Adafactor, factored by logical axes (experts apart): the T5 runs
  BigVisionAdafactor  big_vision's Adafactor with decoupled weight decay: the ViT runs
  Adafactor           optax.adafactor with T5X's defaults (whole tensors, no axis names)
  AdamW               AdamW with global-norm clipping
  RoutersOnly         another optimizer on the MoE routers alone (UpIT's router stage)

`build(param_axes)` gets the params' logical axis names (path -> names), which only
T5XAdafactor uses. Schedules are functions of the optimizer's step count. An upcycled run
carries the dense run's count (upcycle/optimizer_state/carry.py, counts.py), so a schedule
defined over the whole budget (dense + upcycled steps) continues across the upcycling point.
"""

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from upcycle import fields, tree
from upcycle.train import t5x_adafactor

Schedule = Callable[[jnp.ndarray], jnp.ndarray]
ParamAxes = Mapping[str, Optional[Sequence[Optional[str]]]]


def rsqrt_schedule(base_learning_rate: float = 1.0, warmup_steps: int = 10_000) -> Schedule:
  """T5X's inverse square root: base / sqrt(max(step, warmup)) (constant during warmup)."""
  fields.number_value('optimizers.rsqrt_schedule.base_learning_rate', base_learning_rate)
  fields.integer_value('optimizers.rsqrt_schedule.warmup_steps', warmup_steps, 0)
  def schedule(step):
    return base_learning_rate / jnp.sqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))
  return schedule


def constant_schedule(learning_rate: float = 1e-3) -> Schedule:
  """A constant learning rate (T5X's fine-tuning default, 1e-3 with Adafactor)."""
  fields.number_value('optimizers.constant_schedule.learning_rate', learning_rate)
  return lambda step: jnp.full((), learning_rate, jnp.float32)


def warmup_decay_schedule(peak_learning_rate: float, warmup_steps: int, total_steps: int,
                          decay: str = 'cosine', end_learning_rate: float = 0.0) -> Schedule:
  """Linear warmup from 0 to the peak, then cosine or linear decay to the end value."""
  name = 'optimizers.warmup_decay_schedule.'
  fields.number_value(f'{name}peak_learning_rate (LEARNING_RATE)', peak_learning_rate)
  fields.number_value(f'{name}end_learning_rate (MIN_LEARNING_RATE)', end_learning_rate)
  fields.integer_value(f'{name}warmup_steps (WARMUP_STEPS)', warmup_steps, 0)
  fields.integer_value(f'{name}total_steps (SCHEDULE_STEPS)', total_steps, 0)
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


def big_vision_schedule(total_steps: int, decay_type: str = 'rsqrt', warmup_steps: int = 0,
                        cooldown_steps: int = 0, timescale: int = 10_000,
                        linear_end: float = 0.0) -> Schedule:
  """big_vision's `create_learning_rate_schedule` with base 1 (a multiplier of the peak).

  `total_steps` is the whole budget the schedule is defined over: for a dense run that will
  be upcycled, the dense plus the upcycled steps, so that the upcycled run continues it.
  rsqrt: 1 / sqrt((step + timescale - warmup) / timescale) after warmup; cosine / linear:
  from 1 to 0 / `linear_end` over [warmup, total]. Then linear warmup from 0 and linear
  cooldown to 0 over the last `cooldown_steps`.
  """
  if decay_type not in ('rsqrt', 'cosine', 'linear'):
    raise ValueError(f"big_vision_schedule.decay_type={decay_type!r}: expected 'rsqrt', "
                     f"'cosine' or 'linear'.")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
    if decay_type == 'rsqrt':
      lr = jnp.where(step > warmup_steps,
                     1.0 / jnp.sqrt((step + timescale - warmup_steps) / timescale), 1.0)
    elif decay_type == 'cosine':
      lr = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    else:
      lr = 1.0 + (linear_end - 1.0) * progress
    if warmup_steps:
      lr = lr * jnp.minimum(1.0, step / warmup_steps)
    if cooldown_steps:
      lr = lr * jnp.minimum(1.0, (total_steps - step) / cooldown_steps)
    return jnp.asarray(lr, jnp.float32)

  return schedule


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

  def build(self, param_axes: Optional[ParamAxes] = None) -> optax.GradientTransformation:
    del param_axes  # Factors whole tensors.
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

  def build(self, param_axes: Optional[ParamAxes] = None) -> optax.GradientTransformation:
    del param_axes
    adam = optax.adamw(self.schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay)
    if self.grad_clip_norm is None:
      return adam
    return optax.chain(optax.clip_by_global_norm(self.grad_clip_norm), adam)


@dataclasses.dataclass(frozen=True)
class T5XAdafactor:
  """T5X's Adafactor (`t5x_adafactor.py`): per-parameter factor rules from logical axis names,
  experts as a BATCH axis (statistics, clipping and parameter scale per expert), the decay
  rate and learning rate on the global step. Defaults are T5X's.

  Attributes:
    logical_factor_rules: axis name -> 'row' / 'column' / 'batch' / 'none' (or FactorDim);
      None: T5X's MoE rules (`t5x_adafactor.moe_logical_factor_rules`).
  """

  schedule: Schedule = dataclasses.field(default_factory=rsqrt_schedule)
  logical_factor_rules: Optional[Mapping[str, Union[str, t5x_adafactor.FactorDim]]] = None
  decay_rate: float = 0.8
  step_offset: int = 0
  clipping_threshold: Optional[float] = 1.0
  multiply_by_parameter_scale: bool = True
  beta1: Optional[float] = None
  weight_decay_rate: Optional[float] = None
  factored: bool = True
  min_dim_size_to_factor: int = 128
  epsilon1: float = 1e-30
  epsilon2: float = 1e-3

  def build(self, param_axes: Optional[ParamAxes] = None) -> optax.GradientTransformation:
    """`param_axes`: param path -> logical axis names (the Trainer passes the model's)."""
    if param_axes is None:
      raise ValueError('T5XAdafactor.build(param_axes) needs the params\' logical axis names '
                       '(path -> names), which the Trainer passes; called directly, pass '
                       'upcycle.partitioning.logical_axes(boxed params).')
    rules = self.logical_factor_rules
    rules = t5x_adafactor.factor_rules(
        param_axes, t5x_adafactor.moe_logical_factor_rules() if rules is None else rules)
    return t5x_adafactor.t5x_adafactor(
        self.schedule, rules, factored=self.factored, decay_rate=self.decay_rate,
        step_offset=self.step_offset, clipping_threshold=self.clipping_threshold,
        multiply_by_parameter_scale=self.multiply_by_parameter_scale, beta1=self.beta1,
        weight_decay_rate=self.weight_decay_rate,
        min_dim_size_to_factor=self.min_dim_size_to_factor, epsilon1=self.epsilon1,
        epsilon2=self.epsilon2)


def _kernels(params: Any) -> Any:
  """big_vision's default weight-decay mask, '.*/kernel$': True for leaves named kernel."""
  def mark(node, name):
    if isinstance(node, Mapping):
      return {k: mark(v, k) for k, v in node.items()}
    return name == 'kernel'
  return mark(params, '')


@dataclasses.dataclass(frozen=True)
class BigVisionAdafactor:
  """big_vision's Adafactor (`big_vision/optax.py: scale_by_adafactor` inside `make`).

  The chain: clip by global norm -> factored RMS (decay 1 - (t+1)^-0.8 capped at
  `beta2_cap`; factored if the second-largest axis has >= `min_dim_size_to_factor`) ->
  optional block-RMS clipping -> momentum (EMA, not debiased, `momentum_dtype`) -> x
  `learning_rate` -> + `weight_decay` x param for kernels (decoupled: not multiplied by
  `learning_rate`) -> x `decay_schedule(step)` -> x -1.

  So the learning rate is `learning_rate * decay_schedule(step)` (`schedule`, logged), and the
  kernels decay by `weight_decay * decay_schedule(step)` per step.
  """

  decay_schedule: Schedule
  learning_rate: float = 1e-3
  weight_decay: float = 1e-4
  grad_clip_norm: Optional[float] = 1.0
  min_dim_size_to_factor: int = 32
  decay_rate: float = 0.8
  beta2_cap: float = 0.999
  clipping_threshold: Optional[float] = None
  momentum: Optional[float] = 0.9
  momentum_dtype: str = 'bfloat16'
  epsilon: float = 1e-30

  def __post_init__(self):   # LEARNING_RATE and WEIGHT_DECAY in runs/vit_pretrain.gin
    fields.number(self, 'learning_rate')
    fields.number(self, 'weight_decay')

  @property
  def schedule(self) -> Schedule:
    return lambda step: self.learning_rate * self.decay_schedule(step)

  def build(self, param_axes: Optional[ParamAxes] = None) -> optax.GradientTransformation:
    del param_axes  # big_vision factors by shape.
    cap = self.beta2_cap
    decay_rate_fn = lambda t, exponent: jnp.minimum(
        cap, 1.0 - (jnp.asarray(t, jnp.float32) + 1.0) ** (-exponent))
    parts = [
        optax.clip_by_global_norm(self.grad_clip_norm) if self.grad_clip_norm else
        optax.identity(),
        optax.scale_by_factored_rms(
            factored=True, decay_rate=self.decay_rate,
            min_dim_size_to_factor=self.min_dim_size_to_factor, epsilon=self.epsilon,
            decay_rate_fn=decay_rate_fn),
        optax.clip_by_block_rms(self.clipping_threshold) if self.clipping_threshold else
        optax.identity(),
        optax.ema(self.momentum, debias=False, accumulator_dtype=self.momentum_dtype)
        if self.momentum else optax.identity(),
        optax.scale(self.learning_rate),
    ]
    if self.weight_decay:
      parts.append(optax.add_decayed_weights(self.weight_decay, _kernels))
    parts += [optax.scale_by_schedule(self.decay_schedule), optax.scale(-1.0)]
    return optax.chain(*parts)


def _router_or_frozen(params: Any) -> Any:
  """'router' for every leaf under an MoE block's `router/`, else 'frozen' (same tree)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: 'router' if any(getattr(k, 'key', None) == tree.ROUTER for k in path)
      else 'frozen', params)


@dataclasses.dataclass(frozen=True)
class RoutersOnly:
  """`inner` on the MoE routers' parameters, no update and no state for the others (UpIT's
  router stage, `router_stage.RouterStage`): `optax.multi_transform`, so the checkpoint holds
  the inner optimizer's state of the routers alone.

  Attributes:
    inner: the optimizer of the routers (e.g. `AdamW`; gradient clipping then counts the
      routers' gradients only).
  """

  inner: Any

  @property
  def schedule(self) -> Schedule:
    return self.inner.schedule

  def build(self, param_axes: Optional[ParamAxes] = None) -> optax.GradientTransformation:
    if param_axes is not None and not any(
        f'/{tree.ROUTER}/' in f'/{path}' for path in param_axes):
      raise ValueError('RoutersOnly: the model has no MoE router to train (no parameter '
                       'under router/). Fix: give the model MoE layers, or another optimizer.')
    return optax.multi_transform({'router': self.inner.build(param_axes),
                                  'frozen': optax.set_to_zero()}, _router_or_frozen)
