"""Noticing a degenerate run: a metric that stays exactly the same from step to step.

A healthy loss or gradient norm changes every step; one repeated exactly for many steps
means training has stopped doing anything (e.g. a learning rate so large that the
parameters saturate and every gradient is 0). A value of exactly 0 (a gradient norm of 0)
never happens while training works, so it warns after `ZERO_STEPS` steps already. `Watch`
counts the repeats on device, so that checking costs no host round trip per step, and
reports each stall once.
"""

from typing import Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

ZERO_STEPS = 3   # consecutive steps of a metric exactly 0 that warn (if `steps` is larger)


@jax.jit
def _advance(state: Dict[str, Tuple[jax.Array, jax.Array]],
             values: Dict[str, jax.Array]) -> Dict[str, Tuple[jax.Array, jax.Array]]:
  """(last value, steps it has lasted) per metric, after one more step."""
  return {name: (value, jnp.where(value == last, lasted + 1, 1))
          for name, value in values.items() for last, lasted in [state[name]]}


class Watch:
  """Counts, per metric, the consecutive steps that ended with the same exact value."""

  def __init__(self, names: Sequence[str], steps: int):
    """`steps`: how many equal consecutive values make a warning (0: never warn)."""
    self.names, self.steps = tuple(names), steps
    self._state = {n: (jnp.float32(jnp.nan), jnp.int32(0)) for n in self.names}
    self._warned: Dict[str, int] = {}   # metric -> first step of the stall already reported

  def update(self, metrics: Mapping[str, jax.Array]) -> None:
    if self.steps:
      self._state = _advance(self._state, {n: jnp.float32(metrics[n]) for n in self.names})

  def warnings(self, step: int) -> List[Tuple[str, dict]]:
    """(message, fields) for each metric constant for >= `steps` steps up to `step`, once per
    stall."""
    if not self.steps:
      return []
    out = []
    for name, (value, lasted) in jax.device_get(self._state).items():
      lasted, since, value = int(lasted), step - int(lasted) + 1, float(np.asarray(value))
      enough = min(self.steps, ZERO_STEPS) if value == 0 else self.steps
      if lasted < enough or self._warned.get(name) == since:
        continue
      self._warned[name] = since
      out.append((
          f'{name} has been exactly {value:.6g} for {lasted} consecutive steps (steps {since} '
          f'to {step}): training is not changing the model. Check the learning rate (too large '
          f'a one can saturate the model and zero every gradient) and the data '
          f'(TrainConfig.stall_warning_steps sets how many steps warn; 0 turns this off).',
          {'metric': name, 'value': value, 'steps': lasted, 'since_step': since}))
    return out
