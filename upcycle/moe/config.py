"""`MoeConfig`: everything that decides how an MoE block routes and computes."""

import dataclasses
from typing import Callable, Dict, Optional, Union

from upcycle import fields
from upcycle.grouped_kernels import GROUPED_KERNELS
from upcycle.moe import balance as balances
from upcycle.moe import capacity as capacities
from upcycle.moe import dispatch as dispatches
from upcycle.moe import dropless, routers, slots
from upcycle.moe import grouping as groupings
from upcycle.router_scale import check_router_init, router_init_std

# The registry of dispatches (`upcycle.moe.dispatch`): `MoeConfig.dispatch` names one, built
# here from the config. Adding a dispatch: its module in moe/ and its name here.
DISPATCHES: Dict[str, Callable[['MoeConfig'], dispatches.Dispatch]] = {
    'masked': lambda config: slots.Slots('masked'),
    'indices': lambda config: slots.Slots('indices'),
    'ragged': lambda config: dropless.Dropless(config.grouped_kernel)}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """How the MoE blocks of one stack (T5 encoder or decoder, ViT, Llama) route and compute;
  which blocks are MoE is the model config's (`T5Config.encoder_moe_layers`, `moe.placement`).

  Attributes:
    num_experts: E, experts per MoE block.
    router: a router object (`upcycle.moe.routers`): `ExpertsChoose()` (each expert takes
      its top-capacity tokens of a group; never in a causal decoder) or `TopK(k,
      batch_priority)`; in gin `@routers.ExpertsChoose()` / `@routers.TopK()`.
    train_capacity_factor: C during training (see `capacity_convention`).
    eval_capacity_factor: C at evaluation (`deterministic=True`).
    capacity_convention: how C becomes slots per expert and group of S tokens, an object
      (`upcycle.moe.capacity`): `Vmoe(multiple_of)` (V-MoE, the vision runs: ceil(K * C * S /
      E) rounded up to a multiple) or `T5X(minimum)` (T5X / Flaxformer, the language runs:
      max(round(C * S / E), minimum), not multiplied by K); in gin `@capacity.Vmoe()` /
      `@capacity.T5X()`. Both are capped at S.
    normalize_combine_weights: rescale each token's combine weights over the
      experts that took it to sum to 1; with identical experts the block then
      computes exactly the dense MLP for every routed token.
    grouping: how the tokens of a batch are cut into routing groups, an object
      (`upcycle.moe.grouping`): `PerExample()` (each example one group), `Fixed(size)` or
      `Flaxformer(max_group_size, num_expert_replicas)` (T5X's GROUP_SIZE rule); in gin
      `@grouping.Flaxformer()`.
    dispatch: the name of a dispatch in `DISPATCHES`, built from this config by
      `dispatcher`: 'masked' (`slots.Slots('masked')`: one-hot einsum, TPU friendly) or
      'indices' (`slots.Slots('indices')`: gather/scatter, CPU/GPU friendly), the same
      function of the capacity slots; or 'ragged' (`dropless.Dropless(grouped_kernel)`, Top-K
      only): dropless, each token's K choices sorted by expert and the
      experts run as grouped matmuls (`grouped_kernel`) on exactly the rows that chose
      them; the capacity factors are then not used (it equals the other two with a capacity
      of the whole group, `capacity` returns the group size).
    grouped_kernel: with dispatch 'ragged', what multiplies each expert's rows
      (`upcycle.grouped_kernels`): 'ragged_dot' (`jax.lax.ragged_dot`; XLA's TPU compiler
      counts its kernels' gradient over all experts, and on CPU it is a masked product over
      all of them), 'blocked' (blocks of rows, each by its expert's kernel, in a scan: about
      the rows' own work on any platform), 'megablox' (on TPU megablox's Pallas `gmm`, whose
      backward is its own `gmm` and `tgmm` over each expert's rows only; 'blocked' on other
      platforms) or 'megablox_interpret' (the Pallas kernels interpreted, on any platform:
      slow, for tests). Unused by 'masked' and 'indices' (so a Mixtral file's 'megablox'
      stays when a run binds dispatch = 'indices').
    balance: the load-balancing loss, an object (`upcycle.moe.balance`): `Switch(weight,
      scope)` (each MoE layer its own Switch loss E * mean_g sum_e f_ge * p_ge, f and p
      counted per routing group with scope 'group' or over the batch with 'batch') or
      `PooledSwitch(weight, scope)` (f and p averaged over the MoE layers of the stack, one
      loss for the stack, as HF transformers' Switch Transformers and Mixtral compute it); in
      gin `@balance.Switch()` / `@balance.PooledSwitch()`. The default is `Switch()`: weight
      0.01, scope 'group'. Top-K only: Expert Choice is balanced by construction (its loss
      is 0 whatever the object).
    router_z_loss_weight: weight of the router z-loss.
    ignore_padding_tokens: True: padding (a False `token_mask`, e.g. T5 token 0, and the
      padding `grouping.Flaxformer` adds) is not routed by Top-K, is taken last by Expert Choice,
      and is left out of the auxiliary losses and metrics: f, p and the z-loss are means over
      the tokens routing considers. False: Flaxformer's router with
      `ignore_padding_tokens=False`, as T5X's MoE gin files set it: padding is routed and
      counted like any token (bit for bit Flaxformer's losses). Flaxformer's True, which
      keeps padding out of routing but still counts it in the means, is not offered.
    jitter_noise: multiplicative uniform noise in [1 - j, 1 + j] on the router
      input, training only, drawn from the 'jitter' rng stream.
    shared_expert: add an always-on expert (DeepSeekMoE, Qwen-MoE): the block computes
      routed MoE(x) + shared_expert(x), the shared expert a dense MLP of the experts' type
      under `X/shared_expert/` with the dense MLP's parameter names and logical axes.
      Upcycling copies the dense MLP into it (`upcycling.plan`).
    shared_expert_d_ff: the shared expert's d_ff (ViT: mlp_dim); None: the dense
      MLP's. Requires `shared_expert`.
    router_init: how the router kernel `[d_model, E]` is drawn, N(0, std^2) with std
      (`router_scale.router_init_std`): 'constant' 0.02 whatever the width, as Flaxformer's router
      (`routing.py`'s `default_kernel_init = normal(stddev=2e-2)`, T5X's MoE and Sparse
      Upcycling) and HF's Mixtral (`initializer_range` 0.02 for the gate); 'width_scaled'
      0.02 * sqrt(768 / d_model), equal to it at T5 Base's width and 0.0693 at d_model 64,
      so the logits (a sum over d_model products) are as large at any width (V-MoE's router,
      flax's default lecun_normal, also scales as 1 / sqrt(d_model): std 1 / sqrt(d_model));
      or a number, the std. At d_model 64 'constant' gives logits 3.4x smaller than at 768
      and the routers of a from-scratch MoE stay near uniform (docs/moe.md, "Router
      initialization"); the tiny models bind 'width_scaled'. Upcycling draws its fresh
      routers with its own initializer (`upcycling.router_init.Normal`, which takes the
      same names).
  """

  num_experts: int = 32
  router: routers.Router = routers.ExpertsChoose()
  train_capacity_factor: float = 2.0
  eval_capacity_factor: float = 2.0
  capacity_convention: capacities.Convention = capacities.Vmoe()
  normalize_combine_weights: bool = False
  grouping: groupings.Grouping = groupings.PerExample()
  dispatch: str = 'masked'
  grouped_kernel: str = 'ragged_dot'
  balance: balances.Switch = balances.Switch()
  router_z_loss_weight: float = 0.0001
  ignore_padding_tokens: bool = True
  jitter_noise: float = 0.0
  shared_expert: bool = False
  shared_expert_d_ff: Optional[int] = None
  router_init: Union[str, float] = 'constant'

  def __post_init__(self):
    fields.integer(self, 'num_experts', 1)
    fields.instance(self, 'router', routers.Router,
                    '@routers.ExpertsChoose() or @routers.TopK() in gin (from upcycle.moe import '
                    'routers), with its fields bound on it (routers.TopK.k = 2)')
    self.router.validate(self.num_experts)
    fields.number(self, 'train_capacity_factor', 0.0, strictly=True)
    fields.number(self, 'eval_capacity_factor', 0.0, strictly=True)
    fields.instance(self, 'capacity_convention', capacities.Convention,
                    '@capacity.Vmoe() or @capacity.T5X() in gin (from upcycle.moe import capacity)')
    fields.boolean(self, 'normalize_combine_weights')
    fields.instance(self, 'grouping', groupings.Grouping,
                    '@grouping.PerExample(), @grouping.Fixed() or @grouping.Flaxformer() in gin '
                    '(from upcycle.moe import grouping)')
    fields.choice(self, 'dispatch', tuple(DISPATCHES))
    fields.choice(self, 'grouped_kernel', tuple(GROUPED_KERNELS))
    self.dispatcher.validate(self)
    fields.instance(self, 'balance', balances.Switch,
                    '@balance.Switch() or @balance.PooledSwitch() in gin (from upcycle.moe import '
                    'balance), with its fields bound on it (balance.Switch.weight = 0.01)')
    fields.number(self, 'router_z_loss_weight', 0.0)
    fields.boolean(self, 'ignore_padding_tokens')
    fields.number(self, 'jitter_noise', 0.0)
    if self.jitter_noise >= 1:
      raise fields.ConfigError(f'{fields.binding(self, "jitter_noise")} = {self.jitter_noise}: '
                               f'expected a number in [0, 1).')
    fields.boolean(self, 'shared_expert')
    fields.optional_integer(self, 'shared_expert_d_ff', 1)
    if self.shared_expert_d_ff is not None and not self.shared_expert:
      raise fields.ConfigError(
          f'{fields.binding(self, "shared_expert_d_ff")} = {self.shared_expert_d_ff} without a '
          f'shared expert: set {fields.binding(self, "shared_expert")} = True too.')
    check_router_init(self.router_init, fields.binding(self, 'router_init'))

  def router_std(self, d_model: int) -> float:
    """The router kernel's init std at width `d_model` (`router_init`)."""
    return router_init_std(self.router_init, d_model)

  @property
  def dispatcher(self) -> dispatches.Dispatch:
    """The dispatch object `dispatch` names (`DISPATCHES`)."""
    return DISPATCHES[self.dispatch](self)

  @property
  def dropless(self) -> bool:
    """Whether the dispatch computes every token's choices, with no capacity."""
    return self.dispatcher.dropless

  def shared_d_ff(self, dense_d_ff: int) -> Optional[int]:
    """The shared expert's d_ff in a model whose dense MLP has `dense_d_ff`; None: none."""
    if not self.shared_expert:
      return None
    return dense_d_ff if self.shared_expert_d_ff is None else self.shared_expert_d_ff

  def group_plan(self, batch: int, length: int) -> groupings.GroupPlan:
    """How a `[batch, length, d_model]` input is cut into routing groups."""
    return self.grouping.plan(batch, length, num_experts=self.num_experts)

  def capacity(self, group_size: int, deterministic: bool) -> int:
    """Slots per expert and group of `group_size` tokens (see `capacity_convention`); the
    whole group for a dropless dispatch."""
    if self.dropless:
      return group_size
    factor = self.eval_capacity_factor if deterministic else self.train_capacity_factor
    capacity = self.capacity_convention.slots(
        factor, group_size=group_size, num_experts=self.num_experts,
        experts_per_token=self.router.experts_per_token)
    return min(capacity, group_size)

