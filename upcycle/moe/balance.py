"""The MoE block's load-balancing loss as an object, `MoeConfig.balance`: the statistics a
Top-K router gathers for it, what each MoE layer sows, and how a stack's loss is computed from
what its layers sowed. Bound in gin as small configs (`from upcycle.moe import balance`):

  moe.MoeConfig.balance = @balance.PooledSwitch()
  balance.PooledSwitch.weight = %ROUTER_AUX_LOSS_COEF
  balance.PooledSwitch.scope = 'batch'

`Switch(weight, scope)` (the default, weight 0.01 in scope 'group'): each MoE layer its own
Switch loss. `PooledSwitch(weight, scope)`: f and p averaged over the MoE layers of a stack,
one loss for the stack (`summary.aux_losses`), as HF transformers' Switch Transformers ('group')
and Mixtral ('batch') compute it. Expert Choice is balanced by construction: its router
gathers no statistics, and its layers sow a load-balancing loss of 0 whatever the object.
"""

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp

from upcycle import fields
from upcycle.moe import routing

Array = jax.Array

SCOPES = ('group', 'batch')   # `routing.load_balancing_statistics`'s
POOLED = 'pooled_balance'     # what a `PooledSwitch` layer sows instead of its own loss


@flax.struct.dataclass
class PooledStatistics:
  """What a `PooledSwitch` layer sows for its stack's one loss (`PooledSwitch.stack_losses`):
  its load-balancing statistics and, static, its loss weight."""
  fraction: Array      # [groups, experts] f (`routing.load_balancing_statistics`)
  probability: Array   # [groups, experts] p
  weight: float = flax.struct.field(pytree_node=False)   # `Switch.weight`


@dataclasses.dataclass(frozen=True)
class Switch:
  """The Switch load-balancing loss of each MoE layer on its own statistics,
  E * mean_g sum_e f_ge * p_ge (`routing.load_balancing_loss`): f_ge the fraction of group g's
  tokens that chose expert e among their K (summing to K), p_ge their mean router probability
  of e, over the tokens routing considers (`MoeConfig.ignore_padding_tokens`).

  Attributes:
    weight: what the loss is multiplied by in the training loss.
    scope: the tokens f and p are counted over in a layer: 'group' (each routing group, the
      loss averaged over groups; with `grouping.PerExample()` one group per sequence,
      Megatron-LM's 'seq_aux_loss' up to its factor 1/K) or 'batch' (all tokens of the batch
      as one group: over all devices, i.e. Megatron-LM's 'global_aux_loss' statistics with one
      microbatch; with microbatches, over each one).
  """

  weight: float = 0.01
  scope: str = 'group'

  def __post_init__(self):
    fields.number(self, 'weight', 0.0)
    fields.choice(self, 'scope', SCOPES)

  def statistics(self, probs: Array, expert_index: Array,
                 token_mask: Optional[Array]) -> Tuple[Array, Array]:
    """(f, p) `[groups, experts]` in `scope` of probs `[groups, tokens, experts]`, the chosen
    expert_index `[groups, tokens, k]` and token_mask `[groups, tokens]` (None: every token)."""
    return routing.load_balancing_statistics(probs, expert_index, self.scope, token_mask)

  def layer_losses(self, statistics: Optional[Tuple[Array, Array]],
                   weighted_z_loss: Array) -> Dict[str, Array]:
    """What an MoE layer sows in 'aux_loss' besides its z-loss: its 'load_balancing_loss' and
    'weighted', the weighted sum with its weighted z-loss. statistics: (f, p)
    `[groups, experts]` (`statistics`); None: balanced by construction (Expert Choice), the
    loss 0."""
    balance = (jnp.zeros((), jnp.float32) if statistics is None
               else routing.load_balancing_loss(*statistics))
    return {'load_balancing_loss': balance, 'weighted': self.weight * balance + weighted_z_loss}


@dataclasses.dataclass(frozen=True)
class PooledSwitch(Switch):
  """The Switch loss of a stack's MoE layers together: f and p averaged over the layers
  (expert e of every layer counted as one expert), one loss for the stack. Each layer sows its
  statistics (`PooledStatistics`, under `POOLED`) and its weighted z-loss alone as 'weighted';
  `summary.aux_losses` computes the stack's loss (`stack_losses`) and adds it, weighted."""

  def layer_losses(self, statistics: Optional[Tuple[Array, Array]],
                   weighted_z_loss: Array) -> Dict[str, Array]:
    if statistics is None:   # balanced by construction: nothing to pool
      return super().layer_losses(statistics, weighted_z_loss)
    return {POOLED: PooledStatistics(*statistics, weight=self.weight), 'weighted': weighted_z_loss}

  @staticmethod
  def stack_losses(layers: Sequence[PooledStatistics]) -> Tuple[Array, Array]:
    """(the loss, the weighted loss) of one stack from what its layers sowed, each
    `[groups, experts]` or, in a scanned stack, `[layers, groups, experts]`.

    f_ge and p_ge (means over the tokens routing considers) are averaged over the stack's
    layers and give one loss, E * mean_g sum_e f_ge * p_ge over the groups with a routed token
    (`routing.load_balancing_loss`). The layers of a stack see the same tokens and padding,
    so this is the loss of f and p counted over every (layer, token) of the stack. The
    weighted loss is the same loss of the layers' weighted fractions (the weight times f): the
    loss is linear in f and a stack's layers share one weight.
    """
    f, p, weighted_f = [
        jnp.mean(jnp.concatenate([v.reshape((-1,) + v.shape[-2:]) for v in values]), axis=0)
        for values in ([b.fraction for b in layers], [b.probability for b in layers],
                       [b.weight * b.fraction for b in layers])]   # [G, E] each
    return routing.load_balancing_loss(f, p), routing.load_balancing_loss(weighted_f, p)
