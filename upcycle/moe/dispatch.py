"""What `MoeLayer` asks of a dispatch: how the routed tokens reach the experts and come back.

A dispatch is a frozen dataclass; a `MoeConfig` names one (`MoeConfig.dispatch`, a key of
`upcycle.moe.config.DISPATCHES`, the one registry, which builds it from the config). The
layer routes, asks the dispatch for the slots the routing fills (its metrics), then for the
output:

  plan(routed, mask, num_tokens, config) -> (SlotUse, plan)
  __call__(grouped [G, S, d], plan, config=, expert=, deterministic=) -> [G, S, d]

Dispatches: `upcycle.moe.slots.Slots(by)` (capacity slots, 'masked' or 'indices') and
`upcycle.moe.dropless.Dropless(kernel)` (every token's K choices, grouped matmuls). Adding
one: its module here in moe/, and its name in `DISPATCHES`.
"""

import abc
from typing import Any, Callable, ClassVar, Optional, Tuple

import flax.linen as nn
import jax

from upcycle.moe import routers, routing

Array = jax.Array


class Dispatch(abc.ABC):
  """A dispatch (subclasses are frozen dataclasses)."""

  dropless: ClassVar[bool]   # True: no capacity, every token's choices computed

  def validate(self, config) -> None:
    """Raises `fields.ConfigError` naming the binding if `config` cannot use this dispatch."""

  @abc.abstractmethod
  def plan(self, routed: routers.Routing, mask: Optional[Array], num_tokens: int,
           config) -> Tuple[routing.SlotUse, Any]:
    """What the routing fills (for the layer's metrics) and what `__call__` computes from.
    mask `[G, S]` (False: padding; None: every token counts)."""

  @abc.abstractmethod
  def __call__(self, grouped: Array, plan: Any, *, config, expert: Callable[..., nn.Module],
               deterministic: bool) -> Array:
    """grouped `[G, S, d]` -> `[G, S, d]`, the routed tokens through the experts of the dense
    MLP module factory `expert` (built here, named 'expert', inside the calling layer)."""
