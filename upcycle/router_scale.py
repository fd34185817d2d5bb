"""The router kernel's initial scale, `MoeConfig.router_init`: a fresh MoE's router and an
upcycled one (`upcycling.router_init.Normal`) draw N(0, std^2) at the std one setting names.

'constant' is Flaxformer's and HF Mixtral's 0.02 (`initializer_range`) whatever the width;
'width_scaled' keeps the router logits' scale T5 Base's at any width (docs/moe.md, "Router
initialization": at d_model 64 the 0.02 routers of a tiny T5 MoE stayed near uniform).
"""

import math
import numbers
from typing import Union

from upcycle import fields

ROUTER_INITS = ('constant', 'width_scaled')
ROUTER_INIT_STD = 0.02      # Flaxformer's router kernel std (and HF's initializer_range)
ROUTER_INIT_WIDTH = 768     # T5 Base's d_model: where 'width_scaled' equals 'constant'


def router_init_std(init: Union[str, float], d_model: int) -> float:
  """The std of a router kernel `[d_model, E]` drawn from N(0, std^2) (`MoeConfig.router_init`):
  'constant' 0.02 whatever the width; 'width_scaled' 0.02 * sqrt(768 / d_model), 0.02 at T5
  Base's 768 and 0.0693 at d_model 64, so the router logits' scale does not depend on the
  width; a number is the std itself."""
  if init == 'constant':
    return ROUTER_INIT_STD
  if init == 'width_scaled':
    return ROUTER_INIT_STD * math.sqrt(ROUTER_INIT_WIDTH / d_model)
  return float(init)


def check_router_init(init: Union[str, float], name: str) -> None:
  """`fields.ConfigError` naming the binding `name` unless `init` is one of `ROUTER_INITS` or a
  number > 0."""
  if isinstance(init, numbers.Real) and not isinstance(init, bool):
    fields.number_value(name, init, 0.0, strictly=True)
  elif init not in ROUTER_INITS:
    raise fields.ConfigError(f'{name} = {init!r}: expected one of {ROUTER_INITS} or a router '
                             f'kernel std > 0.')
