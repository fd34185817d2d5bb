"""Dense param tree + abstract MoE param tree -> MoE param tree, eagerly on the host.

The rule and its checks are the plan's (`plan.py`); this module is the public entry for
running it in one call. Inputs are never modified.
"""

from typing import Any, Dict, Mapping, Optional, Tuple, Union

import jax

from upcycle.upcycling import execute, modes, plan as plan_lib
from upcycle.upcycling import router_init
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.sources import MultiSource

Params = Dict[str, Any]
Layers = Mapping[str, Tuple[str, int]]   # {MLP path: (stack, layer index)}


def _key(rng: Union[jax.Array, int]) -> jax.Array:
  return jax.random.PRNGKey(rng) if isinstance(rng, int) else rng


def make_plan(dense_params: Mapping[str, Any], target: Mapping[str, Any], *,
              experts: Union[str, ExpertInit] = 'copy',
              router: Union[str, router_init.RouterInit] = 'normal', cast: bool = False,
              step: int = 0, layers: Optional[Layers] = None) -> plan_lib.Plan:
  """The plan of `upcycle`, initializers given by name or instance (`modes.Upcycle`'s)."""
  return modes.Upcycle(experts, router, cast).plan(dense_params, target, step=step,
                                                   layers=layers)


def upcycle(dense_params: Mapping[str, Any], target: Mapping[str, Any], *,
            experts: Union[str, ExpertInit] = 'copy',
            router: Union[str, router_init.RouterInit] = 'normal',
            rng: Union[jax.Array, int], cast: bool = False,
            layers: Optional[Layers] = None) -> Tuple[Params, UpcycleReport]:
  """Builds MoE params from dense params, shaped like `target`.

  Args:
    dense_params: nested dict of dense leaves (arrays, numpy or lazily read
      arrays), e.g. `Checkpoint.params`. Never modified.
    target: nested dict of the MoE model's abstract params, e.g.
      `jax.eval_shape(moe_model.init, ...)['params']`; flax partitioning
      boxes are unboxed.
    experts: expert initializer, or one of `experts.EXPERT_INITS`.
    router: router initializer, or one of `router_init.ROUTER_INITS`.
    rng: key (or int seed). Each layer's draws depend only on the key and the
      layer's path.
    cast: cast dense values to the target dtypes instead of failing on a
      dtype mismatch.
    layers: the MoE blocks' places, `config.moe_positions()` of the MoE model's
      config; None reads them from the parameter names (`plan.make`).

  Returns:
    (params, report): a nested dict like `target` with jax arrays (experts
    `[E, ...]`), and the `UpcycleReport` of what was done to every leaf.

  Raises:
    ValueError: naming the path and both shapes/dtypes for a target leaf that
      matches no dense leaf, a shape or dtype mismatch, or an initializer
      that cannot handle the block.
  """
  if isinstance(experts, MultiSource):
    raise ValueError(f'{type(experts).__name__} also decides the non-expert params: call '
                     f'upcycle_from_checkpoints(experts, target, ...) instead.')
  plan = make_plan(dense_params, target, experts=experts, router=router, cast=cast,
                   layers=layers)
  return execute.run(plan, dense_params, _key(rng)), plan.report()


def upcycle_from_checkpoints(experts: MultiSource, target: Mapping[str, Any], *,
                             router: Union[str, router_init.RouterInit] = 'normal',
                             rng: Union[jax.Array, int],
                             cast: bool = False, layers: Optional[Layers] = None
                             ) -> Tuple[Params, UpcycleReport]:
  """Upcycles several dense checkpoints (Branch-Train-MiX, UpIT) into one MoE.

  Experts come from `experts` (FromCheckpoints or Merge); every other leaf
  from `experts.shared_params()` (the mean of the sources, or source `base`).
  Otherwise exactly `upcycle`.
  """
  if not isinstance(experts, MultiSource):
    raise ValueError(f'upcycle_from_checkpoints needs FromCheckpoints or Merge, got {experts!r}.')
  shared = experts.shared_params()
  plan = make_plan(shared, target, experts=experts, router=router, cast=cast, layers=layers)
  return execute.run(plan, shared, _key(rng)), plan.report()


def copy_params(params: Mapping[str, Any], target: Mapping[str, Any], *,
                cast: bool = False) -> Tuple[Params, UpcycleReport]:
  """Every target leaf copied from the leaf at the same path: no upcycling rule at all.

  For continuing training from a checkpoint of the target's own architecture:
  a dense model from a dense checkpoint, or an MoE model from an MoE checkpoint
  (e.g. one written by `python -m upcycle.convert`), whose `expert/` leaves
  are then copied as they are. Shape and dtype checks and the report are
  those of `upcycle`.

  Returns:
    (params, report): a nested dict like `target`, and the report (every
    entry 'copied'; `unused` lists source leaves the target does not have).
  """
  plan = plan_lib.identity(params, target, cast=cast)
  return execute.run(plan, params, jax.random.PRNGKey(0)), plan.report()
