"""Training state: params, optimizer state and the global step, one pytree."""

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
  step: jax.Array      # [] int32, the global step (continues the dense run's on upcycled runs)
  params: Any
  opt_state: Any
