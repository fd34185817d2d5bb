"""T5X's Adafactor (`t5x/adafactor.py`) as an optax transformation, factoring by logical axes.

Each parameter's second moment is factored by a rule derived from its logical axis names
(T5X's `logical_factor_rules`, with MoE's `'expert': BATCH` from
`t5x/contrib/moe/adafactor_utils.py`): ROW and COLUMN axes are factored, BATCH axes are kept
apart, so second moments, update clipping and the parameter scale of an `[E, d_model, d_ff]`
expert kernel are computed per expert, exactly as for each expert's own `[d_model, d_ff]`
matrix. A rule without both ROW and COLUMN keeps only its BATCH axes; a parameter of rank
<= 2 without BATCH axes (and any parameter without a rule) uses the heuristic: factor the two
largest axes if the second largest has >= `min_dim_size_to_factor` entries.

The update of a parameter p with gradient g at step t (the state's `count`, the global step):

  decay = 1 - (t - step_offset + 1)^-decay_rate
  v (or v_row, v_col) <- decay * v + (1 - decay) * (g^2 + epsilon1)   (factored: means)
  y = g / sqrt(v_hat);   y /= max(1, RMS(y) / clipping_threshold)
  u = learning_rate(t) * max(RMS(p), epsilon2) * y      (RMS over the non-BATCH axes)
  m <- beta1 * m + (1 - beta1) * u;  u = m              (with momentum)
  p <- (1 - weight_decay_rate) * p - u

The state is `optimizer_state.adafactor.T5XAdafactorState` (T5X's slot names and `[1]`
placeholders), so a T5X checkpoint's state and this one are the same thing. Not implemented
from T5X: `max_parameter_scale`, `global_norm_clip_threshold`, `weight_decay_rate_lr_exponent`,
`skip_nan_updates`, per-parameter `multiply_by_parameter_scale` maps.
"""

import enum
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle import tree
from upcycle.optimizer_state import adafactor
from upcycle.optimizer_state.adafactor import ParamSlots, T5XAdafactorState

Axes = Tuple[int, ...]


class FactorDim(enum.Enum):
  NONE = None      # not factored
  BATCH = 1        # kept apart: statistics per index (never averaged over)
  ROW = 2
  COLUMN = 3


Rule = Tuple[FactorDim, ...]
NAMES = {'row': FactorDim.ROW, 'col': FactorDim.COLUMN, 'column': FactorDim.COLUMN,
         'batch': FactorDim.BATCH, 'none': FactorDim.NONE, 'unfactorized': FactorDim.NONE}


def standard_logical_factor_rules() -> Dict[str, FactorDim]:
  """T5X's `standard_logical_factor_rules` (axis names of T5X/Flaxformer models)."""
  return {
      'vocab': FactorDim.COLUMN, 'embed': FactorDim.ROW, 'mlp': FactorDim.COLUMN,
      'heads': FactorDim.COLUMN, 'kv': FactorDim.COLUMN, 'joined_kv': FactorDim.COLUMN,
      'relpos_buckets': FactorDim.NONE, 'layers': FactorDim.BATCH, 'stack': FactorDim.BATCH,
      'q_wi_fused': FactorDim.COLUMN, 'o_wo_fused': FactorDim.COLUMN,
      'multiquery_heads': FactorDim.COLUMN, 'kv_fused': FactorDim.COLUMN,
      'layer_norm_scale': FactorDim.NONE}


def moe_logical_factor_rules() -> Dict[str, FactorDim]:
  """T5X's MoE rules (`contrib/moe/adafactor_utils.logical_factor_rules`): experts are BATCH."""
  return {**standard_logical_factor_rules(), 'expert': FactorDim.BATCH,
          'expert_mlp': FactorDim.COLUMN, 'unmodeled': FactorDim.NONE}


def _factor_dim(value: Union[FactorDim, str, None], axis: str) -> FactorDim:
  if isinstance(value, FactorDim):
    return value
  if value is None or (isinstance(value, str) and value.lower() in NAMES):
    return NAMES['none'] if value is None else NAMES[value.lower()]
  raise ValueError(f'Logical factor rule {axis!r}: {value!r}; expected one of {sorted(NAMES)}.')


def factor_rules(param_axes: Mapping[str, Optional[Sequence[Optional[str]]]],
                 logical_rules: Mapping[str, Union[FactorDim, str]]) -> Dict[str, Rule]:
  """Per-parameter rules from logical axis names, as T5X's `Adafactor.set_param_axes`.

  Args:
    param_axes: param path -> its logical axis names (None: no names, heuristic rule).
    logical_rules: axis name -> FactorDim (or 'row', 'column', 'batch', 'none').

  Returns:
    param path -> rule, for the parameters that have axis names.
  """
  out = {}
  for path, axes in param_axes.items():
    if axes is None:
      continue
    missing = [a for a in axes if a not in logical_rules]
    if missing:
      raise ValueError(
          f'T5X Adafactor: parameter {path} has logical axes {tuple(axes)}; {missing[0]!r} has no '
          f'factor rule. Fix: add it to T5XAdafactor.logical_factor_rules (gin), e.g. '
          f"{{'{missing[0]}': 'none'}}.")
    rule = tuple(_factor_dim(logical_rules[a], a) for a in axes)
    has = lambda d: d in rule
    if has(FactorDim.ROW) and has(FactorDim.COLUMN) and has(FactorDim.NONE):
      raise ValueError(f'T5X Adafactor: parameter {path} with axes {tuple(axes)} has the '
                       f'incomplete factor rule {rule} (ROW, COLUMN and NONE axes).')
    if not (has(FactorDim.ROW) and has(FactorDim.COLUMN)):
      rule = tuple(FactorDim.NONE if d in (FactorDim.ROW, FactorDim.COLUMN) else d for d in rule)
    out[path] = rule
  return out


def heuristic_dims(shape: Sequence[int], min_dim_size_to_factor: int) -> Tuple[Axes, Axes]:
  """T5X's `_factored_dims`: ((second largest,), (largest,)), or ((), ()) if not factored."""
  if len(shape) < 2:
    return (), ()
  order = np.argsort(shape)
  if shape[order[-2]] < min_dim_size_to_factor:
    return (), ()
  return (int(order[-2]),), (int(order[-1]),)


def layout(rule: Optional[Rule], shape: Sequence[int], *, factored: bool = True,
           min_dim_size_to_factor: int = 128, path: str = '') -> Tuple[Axes, Axes, Axes]:
  """T5X's `_parse_rule` resolved: (averaging axes, row axes, column axes).

  `rule` None means the heuristic. Averaging axes are those the RMS of the update and of the
  parameter run over: all but the BATCH axes. Row/column axes are () when unfactored.
  """
  ndim, every = len(shape), tuple(range(len(shape)))
  if not factored:
    return every, (), ()
  if rule is not None and len(rule) != ndim:
    raise ValueError(f'T5X Adafactor: factor rule {rule} of {path} has rank {len(rule)}, '
                     f'the parameter {tuple(shape)} rank {ndim}.')
  batch = () if rule is None else tuple(i for i, d in enumerate(rule) if d == FactorDim.BATCH)
  if rule is None or (ndim <= 2 and not batch):
    if ndim > 2:
      raise ValueError(f'T5X Adafactor: {path} {tuple(shape)} has rank > 2 and no factor rule '
                       f'(its logical axis names). Fix: give the parameter logical axis names.')
    return (every,) + heuristic_dims(shape, min_dim_size_to_factor)
  rows = tuple(i for i, d in enumerate(rule) if d == FactorDim.ROW)
  cols = tuple(i for i, d in enumerate(rule) if d == FactorDim.COLUMN)
  averaging = tuple(i for i in every if i not in batch)
  if not (rows and cols):
    return averaging, (), ()
  return averaging, rows, cols


def _rms(x: jax.Array, axes: Axes) -> jax.Array:
  return jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True))


def t5x_adafactor(learning_rate: Callable[[jax.Array], jax.Array],
                  rules: Mapping[str, Rule], *, factored: bool = True,
                  decay_rate: float = 0.8, step_offset: int = 0,
                  clipping_threshold: Optional[float] = 1.0,
                  multiply_by_parameter_scale: bool = True, beta1: Optional[float] = None,
                  momentum_dtype: Any = jnp.float32, weight_decay_rate: Optional[float] = None,
                  min_dim_size_to_factor: int = 128, epsilon1: float = 1e-30,
                  epsilon2: float = 1e-3) -> optax.GradientTransformation:
  """T5X's Adafactor (module docstring); its arguments are T5X's `Adafactor`'s.

  Args:
    learning_rate: schedule of the state's count (the global step).
    rules: param path ('/'-joined) -> factor rule (`factor_rules`); parameters without one
      use the heuristic.

  Returns:
    A GradientTransformation whose `update(grads, state, params)` needs `params` and returns
    `new_params - params`.
  """

  def param_layout(path: str, shape: Sequence[int]) -> Tuple[Axes, Axes, Axes]:
    return layout(rules.get(path), shape, factored=factored,
                  min_dim_size_to_factor=min_dim_size_to_factor, path=path)

  def init(params):
    def slots(path, p):
      _, rows, cols = param_layout(path, np.shape(p))
      return adafactor.init_slots(np.shape(p), rows, cols,
                                        None if beta1 is None else momentum_dtype)
    flat = tree.flatten(params)
    return T5XAdafactorState(jnp.zeros((), jnp.int32),
                             tree.unflatten({k: slots(k, p) for k, p in flat.items()}))

  def leaf(path, g, p, s: ParamSlots, lr, decay):
    averaging, _, _ = param_layout(path, p.shape)
    g = g.astype(jnp.float32)
    grad_sqr, mixing = g * g + epsilon1, 1.0 - decay
    if s.rows:
      v_row = decay * s.v_row + mixing * jnp.mean(grad_sqr, axis=s.cols)
      v_col = decay * s.v_col + mixing * jnp.mean(grad_sqr, axis=s.rows)
      s = s.replace(v_row=v_row, v_col=v_col)
      # T5X's order: g * row_factor * col_factor. The estimate itself (their product) can
      # underflow to 0 in float32 where both are tiny (units with no gradient), and then
      # rsqrt(0) * 0 = NaN; the factors apart stay finite.
      row, col = adafactor.factors(s)
      y = (g * jax.lax.rsqrt(row)) * jax.lax.rsqrt(col)
    else:
      s = s.replace(v=decay * s.v + mixing * grad_sqr)
      y = g * jax.lax.rsqrt(s.v)
    if clipping_threshold is not None:
      y = y / jnp.maximum(1.0, _rms(y, averaging) / clipping_threshold)
    scale = lr
    if multiply_by_parameter_scale:
      scale = scale * jnp.maximum(_rms(p.astype(jnp.float32), averaging), epsilon2)
    step = scale * y
    if beta1 is not None:
      step = beta1 * s.m + (1.0 - beta1) * step
      s = s.replace(m=step.astype(momentum_dtype))
    update = -step
    if weight_decay_rate is not None:
      update = update - weight_decay_rate * p
    return update.astype(p.dtype), s

  def update(grads, state: T5XAdafactorState, params=None):
    if params is None:
      raise ValueError('T5X Adafactor: update(grads, state, params) needs params (parameter '
                       'scale, weight decay).')
    t = jnp.asarray(state.count, jnp.float32) - step_offset + 1.0
    decay = 1.0 - t ** -decay_rate
    lr = learning_rate(state.count)
    flat_g, flat_p = tree.flatten(grads), tree.flatten(params)
    flat_s = tree.flatten(state.param_states)
    out = {k: leaf(k, flat_g[k], flat_p[k], flat_s[k], lr, decay) for k in flat_p}
    updates = tree.unflatten({k: u for k, (u, _) in out.items()})
    slots = tree.unflatten({k: s for k, (_, s) in out.items()})
    return updates, T5XAdafactorState(state.count + 1, slots)

  return optax.GradientTransformation(init, update)
