"""Routers as objects: each owns its decision (who fills which expert slot) and the statistics
its load-balancing loss reads. Bound in gin as small configs:

  encoder/moe.MoeConfig.router = @routers.ExpertsChoose()
  decoder/moe.MoeConfig.router = @routers.TopK()
  decoder/routers.TopK.k = 2

`MoeLayer` asks its router for a `Routing` and dispatches it; the math lives in
`upcycle.moe.routing` (pure functions of the router probabilities). A new router is one class
here with `route`, `check_causal` and `experts_per_token`, and a gin line.
"""

import abc
import dataclasses
from typing import ClassVar, Optional, Tuple

import flax.struct
import jax

from upcycle import fields
from upcycle.moe import balance as balances
from upcycle.moe import routing

Array = jax.Array


@flax.struct.dataclass
class Routing:
  """One layer's routing of `[groups, tokens]` tokens over E experts.

  decision: the capacity slots (`routing.RoutingDecision`, `[groups, experts, capacity]`);
    None when routed dropless.
  gates, expert_index: `[groups, tokens, k]` each token's K chosen experts and their router
    probabilities, the most probable first; None when the experts choose.
  balance: the load-balancing statistics (f, p) `[groups, experts]`
    (`balance.Switch.statistics`); None when the routing is balanced by construction.
  """
  decision: Optional[routing.RoutingDecision] = None
  gates: Optional[Array] = None
  expert_index: Optional[Array] = None
  balance: Optional[Tuple[Array, Array]] = None


class Router(abc.ABC):
  """What `MoeLayer` asks of a router (subclasses are frozen dataclasses, their fields the
  router's settings)."""

  tokens_choose: ClassVar[bool]   # each token picks its experts: the router can run dropless

  @property
  @abc.abstractmethod
  def experts_per_token(self) -> int:
    """K, as the capacity conventions count it."""

  def validate(self, num_experts: int) -> None:
    """Raises `fields.ConfigError` if the router cannot route over `num_experts`."""

  @abc.abstractmethod
  def check_causal(self, where: str) -> None:
    """Raises `fields.ConfigError`, naming `where` (a binding or a layer), if the router
    reads later positions."""

  @abc.abstractmethod
  def route(self, probs: Array, *, capacity: Optional[int], token_mask: Optional[Array],
            balance: balances.Switch) -> Routing:
    """probs `[groups, tokens, experts]`, token_mask `[groups, tokens]` (False: padding),
    capacity slots per expert and group (None: dropless), balance the load-balancing loss
    (`MoeConfig.balance`) whose statistics a router that is not balanced by construction
    gathers."""


@dataclasses.dataclass(frozen=True)
class ExpertsChoose(Router):
  """Expert Choice (Zhou et al., 2022): every expert takes its top-capacity tokens of a group.
  Balanced by construction (no load-balancing statistics); each expert reads every position of
  its group, so never in a causal decoder."""

  tokens_choose: ClassVar[bool] = False   # False: cannot route dropless

  @property
  def experts_per_token(self) -> int:
    return 1   # the capacity conventions count Expert Choice as K = 1

  def check_causal(self, where: str) -> None:
    raise fields.ConfigError(
        f'{where}: Expert Choice lets each expert pick tokens from the whole group, future '
        'positions included, so a causal decoder would read the future (the output at '
        'position t depends on tokens after t; training and decoding disagree). Bind '
        '@routers.TopK() (e.g. k = 2) for decoder MoE blocks.')

  def route(self, probs: Array, *, capacity: Optional[int], token_mask: Optional[Array],
            balance: balances.Switch) -> Routing:
    del balance
    if capacity is None:
      raise ValueError('Expert Choice has no dropless routing: give a capacity.')
    return Routing(decision=routing.experts_choose(probs, capacity, token_mask))


@dataclasses.dataclass(frozen=True)
class TopK(Router):
  """Token choice: every token takes its k most probable experts (Switch k = 1, GShard /
  Mixtral k = 2), with the Switch load-balancing statistics.

  Attributes:
    k: experts per token, at most the number of experts.
    batch_priority: Batch Priority Routing (Riquelme et al., 2021): tokens claim expert slots
      in order of their top-1 router probability instead of their position in the group.
      Refused in a causal decoder (an earlier token's slot would depend on later tokens).
  """

  k: int = 2
  batch_priority: bool = False
  tokens_choose: ClassVar[bool] = True

  def __post_init__(self):
    fields.integer(self, 'k', 1)
    fields.boolean(self, 'batch_priority')

  @property
  def experts_per_token(self) -> int:
    return self.k

  def validate(self, num_experts: int) -> None:
    if self.k > num_experts:
      raise fields.ConfigError(f'{fields.binding(self, "k")} = {self.k}: Top-K needs k <= the '
                               f'number of experts ({num_experts}).')

  def check_causal(self, where: str) -> None:
    if self.batch_priority:
      raise fields.ConfigError(
          f'{where}: batch_priority = True cannot be used in a causal decoder: tokens claim '
          'expert slots in order of their router probability over the whole group, so a later '
          'token can take the slot of an earlier one and the output at position t depends on '
          'tokens after t (training and decoding disagree). Bind '
          'decoder/routers.TopK.batch_priority = False (T5X uses BPR in the encoder only).')

  def route(self, probs: Array, *, capacity: Optional[int], token_mask: Optional[Array],
            balance: balances.Switch) -> Routing:
    gates, expert_index = jax.lax.top_k(probs, self.k)                # [G, S, K]
    decision = None if capacity is None else routing.tokens_choose(
        probs, expert_index, capacity, self.batch_priority, token_mask)
    return Routing(decision=decision, gates=gates, expert_index=expert_index,
                   balance=balance.statistics(probs, expert_index, token_mask))
