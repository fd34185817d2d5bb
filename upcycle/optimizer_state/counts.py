"""An optimizer state's step counts: where an upcycled (or continued) run starts counting,
'keep', 'reset' or a step number, and the counts of a fresh or reused state that follow.

  'keep'   the checkpoint's step continues (0 for formats without one: HF, .npz), and so does
           the learning-rate schedule. A reused optimizer state keeps all its counts; a fresh
           one gets the step in its schedule counts only, while its moment counts (Adam bias
           correction, Adafactor decay) start at 0 with the moments.
  'reset'  step 0 and every count 0.
  N        step N, schedule counts N (e.g. a HF T5 v1.1 checkpoint known to be at 1M steps).

Optax keeps one count per stateful transformation. The learning rate follows the count of
`scale_by_schedule` (`ScaleByScheduleState`, also inside `inject_hyperparams`); moment
estimators keep their own for bias correction (Adam) and decay (Adafactor), which belong
with their moments. T5X's Adafactor (`T5XAdafactorState`) has one count, the global step,
for its learning rate and its decay rate alike (T5X's `state.step`): a schedule count, so a
fresh state after upcycling carries the dense step there too.
"""

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

from upcycle.optimizer_state.adafactor import T5XAdafactorState

SCHEDULE_COUNTS = (optax.ScaleByScheduleState, T5XAdafactorState)
Step = Union[str, int]


def check(step: Any, binding: str) -> Step:
  """'keep', 'reset' or an int >= 0 (a string of digits is read as one); else an error."""
  if step in ('keep', 'reset'):
    return step
  if isinstance(step, str) and step.isdigit():
    return int(step)
  if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
    return step
  raise ValueError(f"{binding}={step!r}: expected 'keep', 'reset' or a step number >= 0.")


def start(step: Step, checkpoint_step: Optional[int]) -> int:
  """The first step of the new run."""
  if step == 'keep':
    return int(checkpoint_step or 0)
  return 0 if step == 'reset' else int(step)


def _is_counted(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, '_fields') and 'count' in x._fields


def set_counts(state: Any, step: Any, schedule_only: bool) -> Any:
  """`state` with step counts set to `step`: all of them, or those of LR schedules only."""

  def fix(x):
    if not _is_counted(x):
      return x
    if isinstance(x, optax.InjectHyperparamsState):
      return x._replace(count=jnp.full_like(x.count, step),
                        inner_state=set_counts(x.inner_state, step, schedule_only))
    if schedule_only and not isinstance(x, SCHEDULE_COUNTS):
      return x
    return x._replace(count=jnp.full_like(x.count, step))

  return jax.tree.map(fix, state, is_leaf=_is_counted)


def fresh(opt_state: Any, first: int) -> Any:
  """A freshly initialized optimizer state for a run starting at step `first`."""
  return set_counts(opt_state, first, schedule_only=True)


def reused(opt_state: Any, step: Step, first: int) -> Any:
  """A reused optimizer state under the policy `step` (module docstring)."""
  if step == 'keep':
    return opt_state
  if step == 'reset':
    return set_counts(opt_state, 0, schedule_only=False)
  return set_counts(opt_state, first, schedule_only=True)
