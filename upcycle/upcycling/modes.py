"""What a restore builds from a checkpoint, as data: one mode per kind of plan.

  Continue(cast)                   every leaf copied from the same path: the model is the
                                   checkpoint's architecture (continue a dense or MoE run)
  Upcycle(experts, router, cast)   a dense checkpoint into the MoE model (`plan.make`); with
                                   experts from several checkpoints (`sources.MultiSource`:
                                   Branch-Train-MiX, UpIT) the plan copies their shared leaves
  GrowExperts(sources, usage)      a trained MoE with more experts per block (`expert_growth`)
  GrowDepth(layer_map)             a checkpoint with more layers per stack (`depth_growth`)

`mode.plan(source, target, step=..., layers=...)` is the plan; the training restore hook
(`train/restore.py`, whose gin-facing classes each name one mode) and `python -m
upcycle.convert` take the same modes, and `upcycle.aot` lowers every one.
"""

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

from upcycle.upcycling import depth_growth, expert_growth
from upcycle.upcycling import plan as plan_lib
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.router_init import RouterInit
from upcycle.upcycling.surgery import make_plan

Layers = Optional[Mapping[str, Tuple[str, int]]]


@dataclasses.dataclass(frozen=True)
class Continue:
  """The checkpoint's own architecture: every leaf copied from its path."""

  cast: bool = False
  upcycles = False

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers  # nothing is initialized
    return plan_lib.identity(source, target, cast=self.cast, step=step)


@dataclasses.dataclass(frozen=True)
class Upcycle:
  """A dense checkpoint into the MoE model: `experts` (an `ExpertInit`, its name, or a
  `sources.MultiSource` made from several checkpoints) and `router` initialize the blocks."""

  experts: Union[str, ExpertInit] = 'copy'
  router: Union[str, RouterInit] = 'normal'
  cast: bool = False
  upcycles = True

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    return make_plan(source, target, experts=self.experts, router=self.router, cast=self.cast,
                     step=step, layers=layers)


@dataclasses.dataclass(frozen=True)
class GrowExperts:
  """A trained MoE with more experts per block, each new one a copy of `sources`' choice."""

  sources: expert_growth.Sources = 'tile'
  usage: Optional[Mapping[str, Any]] = None
  binding: str = 'sources'         # the name of `sources` in errors
  upcycles = False

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers
    return expert_growth.plan(source, target, sources=self.sources, usage=self.usage,
                              step=step, binding=self.binding)


@dataclasses.dataclass(frozen=True)
class GrowDepth:
  """A checkpoint with more layers per stack, each a copy of the layer `layer_map` names."""

  layer_map: depth_growth.LayerMap = 'tile'
  binding: str = 'layer_map'       # the name of `layer_map` in errors
  upcycles = False

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers
    return depth_growth.plan(source, target, layer_map=self.layer_map, step=step,
                             binding=self.binding)


Mode = Union[Continue, Upcycle, GrowExperts, GrowDepth]
