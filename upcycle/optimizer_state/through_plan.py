"""A trained optimizer state through a plan: the new params' state, every slot made like its
parameter (`Plan.ops`, carried by `optimizer_state.carry`).

  upcycling   experts' slots are the dense MLP's, tiled along the expert axis (whatever the
              expert initializer: Drop and Noise experts get the dense moments too); routers'
              slots are fresh; shared experts and every other leaf copy the dense slots (a
              narrower shared expert's, those of its first d_ff units)
  growth      new experts and layers take their sources' slots, as the params are taken

Adafactor's factored moments (optax `FactoredState`, T5X's slots) are carried as factors where
the op only moves the axes they factor over, else through the estimate
(`optimizer_state.adafactor.carry`). Step counts and injected hyperparameters are the
source's, so the schedule continues (`keep_step=False`: fresh). Any chain of optax
transformations is handled without knowing it, inside `optax.masked` and
`optax.multi_transform` too (a parameter a branch does not update keeps its
`optax.MaskedNode` slots). A T5X-written state is first read into the run's optax state
(`optimizer_state.from_t5x_adafactor`).
"""

from typing import Any, Mapping

import optax

from upcycle import tree
from upcycle.optimizer_state import carry, units

_UPCYCLE_FIX = ('the dense state must come from the same optax optimizer (same chain and '
                'options) as the MoE one; expert initializers that change shapes (Granular) '
                'need tile_moments=False.')
_GROWTH_FIX = ('the checkpoint\'s optimizer must be this run\'s (the same optax chain and '
               'options), or start with a fresh optimizer state.')


def carry_optimizer_state(state: Any, plan: Any, params: Mapping[str, Any],
                          optimizer: optax.GradientTransformation, *,
                          tile_moments: bool = True, keep_step: bool = True) -> Any:
  """The new params' optimizer state, made from `state` by the plan that made the params.

  Args:
    state: the source params' optax state (e.g. `optimizer_state.as_optax` of a stored one),
      from the same optimizer. Never modified.
    plan: the `upcycling.Plan` that made `params` (`plan.make`, `expert_growth.plan`,
      `depth_growth.plan`): its `ops()`, `copies` and `blocks`.
    params: the new params or their abstract shapes; flax boxes are opened.
    optimizer: the run's optax optimizer.
    tile_moments: reuse the source's moments; False starts every moment fresh.
    keep_step: carry over step counts and other leaves of no parameter, so the schedule
      continues from the source's step; False resets them.

  Returns:
    A state of the structure `optimizer.init(params)` returns.
  """
  params = tree.zeros_for(params)
  ops = plan.ops()
  shapes = {p: tree.shape_of(x) for p, x in tree.flatten(params).items()}
  source_shapes = {source: tuple(leaf.source_shape) for leaf in _leaves(plan)
                   if (source := leaf.source)}
  upcycling = bool(plan.blocks)
  return carry.carry_state(
      units.flatten(state, source_shapes), optimizer.init(params), ops=ops,
      source_shapes=source_shapes, shapes=shapes, keep_counts=keep_step,
      moments=tile_moments, source_name='the dense' if upcycling else 'the checkpoint\'s',
      fix=_UPCYCLE_FIX if upcycling else _GROWTH_FIX)


def _leaves(plan: Any):
  return plan.copies + tuple(leaf for block in plan.blocks for leaf in block.leaves)
