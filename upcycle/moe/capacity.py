"""Capacity conventions: how a capacity factor C becomes slots per expert and routing group.
Bound in gin as small configs (`from upcycle.moe import capacity`):

  encoder/moe.MoeConfig.capacity_convention = @capacity.T5X()
  capacity.T5X.minimum = 4

The factors themselves stay on `MoeConfig` (`train_capacity_factor`, `eval_capacity_factor`),
the knob the ablations turn. Every convention's slots are capped at the group size by
`MoeConfig.capacity` (a token fills at most one slot per expert, so the cap changes no output).
"""

import abc
import dataclasses

from upcycle import fields


class Convention(abc.ABC):
  """Slots per expert for a group of `group_size` tokens routed over `num_experts`."""

  @abc.abstractmethod
  def slots(self, factor: float, group_size: int, num_experts: int,
            experts_per_token: int) -> int:
    """Slots per expert and group, before the cap at the group size."""

  @abc.abstractmethod
  def slots_per_token(self, experts_per_token: int) -> int:
    """How many slots per token a factor C counts: with C * this >= E every expert has a slot
    for every token of its group (nothing is dropped)."""


@dataclasses.dataclass(frozen=True)
class Vmoe(Convention):
  """V-MoE's (the paper's vision runs): ceil(K * C * S / E) rounded up to a multiple of
  `multiple_of` (1: none); C counts slots per token choice, K the router's experts per token.
  """

  multiple_of: int = 4

  def __post_init__(self):
    fields.integer(self, 'multiple_of', 1)

  def slots(self, factor: float, group_size: int, num_experts: int,
            experts_per_token: int) -> int:
    # Round before ceil so that e.g. 2 * 2.0 * 8 / 4 does not become 9.
    raw = experts_per_token * factor * group_size / num_experts
    slots = max(1, -(-round(raw, 6) // 1))
    return int(-(-slots // self.multiple_of) * self.multiple_of)

  def slots_per_token(self, experts_per_token: int) -> int:
    return experts_per_token


@dataclasses.dataclass(frozen=True)
class T5X(Convention):
  """T5X / Flaxformer's (the language runs; Flaxformer's `MoeLayer.__call__`):
  max(round(C * S / E), `minimum`), Python's round, not multiplied by K: Top-2 with C = 1.25
  has 1.25 * S / E slots per expert. `minimum` is Flaxformer's `min_expert_capacity` (4)."""

  minimum: int = 4

  def __post_init__(self):
    fields.integer(self, 'minimum', 1)

  def slots(self, factor: float, group_size: int, num_experts: int,
            experts_per_token: int) -> int:
    del experts_per_token
    return max(int(round(factor * group_size / num_experts)), self.minimum)

  def slots_per_token(self, experts_per_token: int) -> int:
    del experts_per_token
    return 1
