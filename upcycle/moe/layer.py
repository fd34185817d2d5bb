"""`MoeLayer`: grouping -> router -> dispatch -> experts -> combine.

The dispatch is an object (`upcycle.moe.dispatch`) that `MoeConfig.dispatch` names:
`Slots('masked')` and `Slots('indices')` fill each expert's capacity slots `[E, G, C, d]` and
run the experts vmapped over them (`upcycle.moe.slots`); `Dropless(kernel)` ('ragged') runs
each token's K copies sorted by expert through grouped matmuls (`upcycle.moe.dropless`).

The layer stands where the dense MLP stood, under the same name. Its parameters:
  expert/<dense MLP params with a leading expert axis>   e.g. expert/wi_0/kernel [E, d_model, d_ff]
  router/router_weights/w/kernel                          [d_model, E], float32
  shared_expert/<dense MLP params>                        with `MoeConfig.shared_expert`,
                                                          e.g. shared_expert/wi_0/kernel
                                                          [d_model, shared d_ff]

Auxiliary losses and metrics are sown (see `upcycle.moe.summary`):
  'aux_loss':    router_z_loss and what `MoeConfig.balance` sows (`upcycle.moe.balance`):
                 load_balancing_loss and weighted (their weighted sum); with
                 `balance.PooledSwitch` instead of load_balancing_loss: pooled_balance
                 (`balance.PooledStatistics`: f and p [groups, experts], the loss weight a
                 static field), weighted then being the weighted z-loss only
  'moe_metrics': fraction_dropped_tokens (tokens no expert took; Flaxformer's
                 fraction_tokens_left_behind); router_confidence (the router probability
                 of the filled slots, summed over them / their number) and expert_usage
                 (filled slots / all E * capacity * groups slots), as Flaxformer's metrics
                 of these names (its Expert Choice reports expert_usage 1.0 whatever fills
                 the slots, and its capacity is not capped at the group size);
                 router_top1_probability (mean top-1 router probability), tokens_per_expert
                 [E] (filled slots per group), expert_load [E] (tokens_per_expert / group
                 size) and effective_experts (`routing.effective_experts`: 2.0 when two
                 experts take every token, E when all take as many). Padding counts only
                 with ignore_padding_tokens=False.
  'router_logits': logits [batch, length, E] (float32; only when the collection is
                 mutable, e.g. for UpIT's router stage, `train/router_stage.py`)
"""

import logging
from typing import Callable, Optional, Set, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import layers, tree
from upcycle.layers import DenseGeneral, constrain
from upcycle.moe import grouping, routing
from upcycle.moe.config import MoeConfig

Array = jax.Array

GROUP_AXES = ('batch', 'length', 'embed')                       # [G, S, d_model]


class RouterWeights(nn.Module):
  num_experts: int
  init_std: float = 0.02   # `MoeConfig.router_std`

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return DenseGeneral(
        self.num_experts, ('embed', 'unmodeled'), dtype=jnp.float32,
        kernel_init=nn.initializers.normal(stddev=self.init_std), name='w')(x)


class RouterLogits(nn.Module):
  """Router logits in float32: `[groups, tokens, d_model] -> [groups, tokens, experts]`."""

  num_experts: int
  jitter_noise: float = 0.0
  init_std: float = 0.02

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    x = jnp.asarray(x, jnp.float32)
    if self.jitter_noise > 0 and not deterministic:
      x = x * jax.random.uniform(self.make_rng('jitter'), x.shape, jnp.float32,
                                 1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    return RouterWeights(self.num_experts, self.init_std, name='router_weights')(x)


_LOG = logging.getLogger(__name__)
_WARNED: Set[Tuple[int, int, int, str]] = set()


def _warn_if_groups_span_devices(cfg: MoeConfig, plan: grouping.GroupPlan, where: str) -> None:
  """Logs once per case, at trace time, when the groups do not split evenly over the batch
  shards of the current mesh: a group then spans devices, and the compiled step moves several
  times the bytes it needs (the fit table's T5 Base MoE on a v4-128, data 2 x expert 32, 32
  groups: 163 GB per chip per train step; with 64 groups, 52 GB)."""
  shards = layers.batch_shards()
  if cfg.dropless or plan.num_groups % shards == 0:   # dropless: cut per shard
    return
  fix = cfg.grouping.even_over(plan, shards, cfg.num_experts)
  if (plan.num_groups, plan.group_size, shards, fix) in _WARNED:
    return
  _WARNED.add((plan.num_groups, plan.group_size, shards, fix))
  _LOG.warning(
      f'MoE layer {where}: its {plan.num_groups} routing groups of {plan.group_size} tokens do '
      f'not split evenly over the {shards} batch shards of this mesh, so groups span devices '
      f'and the step moves several times the HBM bytes it needs. Fix: {fix} for this stack\'s '
      f'MoeConfig (its gin scope, e.g. encoder/).')


class MoeLayer(nn.Module):
  """A sparse MLP block: E copies of `expert` (a dense MLP module), one router, and
  optionally a shared expert every token goes through.

  Attributes:
    config: routing, capacity, dispatch and loss settings.
    expert: factory of the dense MLP module (`layers.GatedMlp`, `layers.Mlp`); the dispatch
      calls it with `intermediate_axes=None` (and the dropless one with `dense=`, its
      projections' module: `upcycle.moe.experts`); its `__call__(x, deterministic)` must be
      rank agnostic.
    causal: True in a decoder; a router that reads later positions (Expert Choice, Batch
      Priority Routing) is then refused (`Router.check_causal`).
    shared_expert: factory of the shared expert's dense MLP module (the experts' type,
      `config.shared_d_ff(...)` units), given iff `config.shared_expert`; called with
      `name='shared_expert'` only, so it keeps the dense MLP's logical axes.
  """

  config: MoeConfig
  expert: Callable[..., nn.Module]
  causal: bool = False
  shared_expert: Optional[Callable[..., nn.Module]] = None

  @nn.compact
  def __call__(self, x: Array, deterministic: bool,
               token_mask: Optional[Array] = None) -> Array:
    """x `[batch, length, d_model]`, token_mask `[batch, length]` (False = padding)."""
    cfg = self.config
    if self.causal:
      cfg.router.check_causal(self.name)
    if cfg.shared_expert != (self.shared_expert is not None):
      raise ValueError(
          f'{self.name}: MoeConfig.shared_expert={cfg.shared_expert} but the model passed '
          f'{"no" if self.shared_expert is None else "a"} shared_expert module factory; the '
          f'model must build it exactly when the config asks for it.')
    batch, length, d_model = x.shape
    plan = cfg.group_plan(batch, length)
    _warn_if_groups_span_devices(cfg, plan, '/'.join(self.scope.path))
    grouped, mask = grouping.group_tokens(x, token_mask, plan)
    if not cfg.ignore_padding_tokens:
      mask = None   # Flaxformer's ignore_padding_tokens=False: padding routed and counted
    grouped = constrain(grouped, GROUP_AXES)
    groups, tokens, _ = grouped.shape
    capacity = cfg.capacity(tokens, deterministic)

    logits = RouterLogits(cfg.num_experts, cfg.jitter_noise, cfg.router_std(d_model),
                          name=tree.ROUTER)(grouped, deterministic)
    probs = jax.nn.softmax(logits, axis=-1)                           # [G, S, E]
    dispatch = cfg.dispatcher
    routed = cfg.router.route(probs, capacity=None if dispatch.dropless else capacity,
                              token_mask=mask, balance=cfg.balance)
    use, dispatch_plan = dispatch.plan(routed, mask, tokens, cfg)
    self._sow_metrics(probs, use, mask)
    out = dispatch(grouped, dispatch_plan, config=cfg, expert=self.expert,
                   deterministic=deterministic)

    self.sow('router_logits', 'logits', grouping.ungroup_tokens(logits, batch, length, plan))
    self._sow_aux_losses(routed.balance, routing.router_z_loss(logits, mask))
    out = grouping.ungroup_tokens(out, batch, length, plan)
    if self.shared_expert is None:
      return out
    return out + self.shared_expert(name=tree.SHARED_EXPERT)(x, deterministic)

  def _sow_aux_losses(self, statistics: Optional[Tuple[Array, Array]], z_loss: Array) -> None:
    """statistics: the load-balancing (f, p) `[groups, experts]`; None: the router is
    balanced by construction (Expert Choice). What is sown besides the z-loss is
    `MoeConfig.balance`'s (`balance.Switch.layer_losses`)."""
    cfg = self.config
    self.sow('aux_loss', 'router_z_loss', z_loss)
    for name, value in cfg.balance.layer_losses(
        statistics, cfg.router_z_loss_weight * z_loss).items():
      self.sow('aux_loss', name, value)

  def _sow_metrics(self, probs: Array, use: routing.SlotUse, mask: Optional[Array]) -> None:
    """Routing metrics of the slots `use` fills (combine weights = router probabilities,
    before any normalization) over the tokens of `mask`; 'router_confidence' and
    'expert_usage' as Flaxformer's `MoeLayer` defines them."""
    groups, tokens, _ = probs.shape
    real = jnp.ones((groups, tokens), bool) if mask is None else mask
    num_real = jnp.maximum(real.sum(), 1)
    dispatched = jnp.sum(use.per_expert)
    tokens_per_expert = jnp.mean(use.per_expert, axis=0)              # [E]
    self.sow('moe_metrics', 'fraction_dropped_tokens',
             jnp.sum((use.slots_per_token == 0) & real) / num_real)
    self.sow('moe_metrics', 'router_confidence', use.weight / jnp.maximum(dispatched, 1))
    self.sow('moe_metrics', 'expert_usage', dispatched / use.num_slots)
    self.sow('moe_metrics', 'router_top1_probability',
             jnp.sum(jnp.max(probs, axis=-1) * real) / num_real)
    self.sow('moe_metrics', 'tokens_per_expert', tokens_per_expert)
    self.sow('moe_metrics', 'expert_load', tokens_per_expert / tokens)
    self.sow('moe_metrics', 'effective_experts', routing.effective_experts(tokens_per_expert))
