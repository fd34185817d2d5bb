"""What a restore builds from a checkpoint, as data: one mode per kind of plan.

  Continue(cast)                   every leaf copied from the same path: the model is the
                                   checkpoint's architecture (continue a dense or MoE run)
  Upcycle(experts, router, cast)   a dense checkpoint into the MoE model (`plan.make`); with
                                   experts from several checkpoints (`sources.MultiSource`:
                                   Branch-Train-MiX, UpIT) the plan copies their shared leaves
  GrowExperts(sources, usage)      a trained MoE with more experts per block (`expert_growth`)
  GrowDepth(layer_map)             a checkpoint with more layers per stack (`depth_growth`)

`mode.plan(source, target, step=..., layers=...)` is the plan; the training restore hook
(`upcycle/restore/`: `Restore(source, mode)`, the mode bound in gin as
`restore.Restore.mode = @modes.Upcycle()`) and `python -m upcycle.convert` take the same
modes, and `upcycle.aot` lowers every one. `upcycles` says whether the mode starts from a
dense checkpoint (an MoE source is refused).

A new mode is its plan's module and one dataclass here with `plan` and `upcycles`, added to
`Mode` (the registration); gin binds it by name, and a file in configs/upcycling/ may name it
for users.
"""

import dataclasses
import json
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from etils import epath

from upcycle import fields
from upcycle.upcycling import depth_growth, expert_growth
from upcycle.upcycling import experts as experts_lib
from upcycle.upcycling import plan as plan_lib
from upcycle.upcycling import router_init
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.router_init import RouterInit
from upcycle.upcycling.sources import MultiSource

Layers = Optional[Mapping[str, Tuple[str, int]]]


@dataclasses.dataclass(frozen=True)
class Continue:
  """The checkpoint's own architecture: every leaf copied from its path, a dense model from a
  dense checkpoint (continue dense training: the baseline of the upcycling experiments) or an
  MoE from an MoE checkpoint (`python -m upcycle.convert`'s, or another run's). `cast`: also
  allow casts that round values (`Upcycle.cast`)."""

  cast: bool = False
  upcycles = False

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers  # nothing is initialized
    return plan_lib.identity(source, target, cast=self.cast, step=step)


@dataclasses.dataclass(frozen=True)
class Upcycle:
  """A dense checkpoint into the MoE model: `experts` and `router` initialize the blocks.

  Attributes:
    experts: an ExpertInit, or 'copy', 'drop', 'noise', 'random'. Branch-Train-MiX / UpIT:
      the FromCheckpoints or Merge class (gin: `@sources.FromCheckpoints`, no parentheses,
      its other arguments bound in gin) with several source checkpoints; the restore hook
      calls it with `sources=` (`sources.combine`, as `python -m upcycle.convert` does) and
      the plan then holds the `sources.MultiSource` it made.
    router: a RouterInit, or 'normal', 'uniform', 'zeros'.
    cast: also allow casts that round values (a float32 checkpoint into bfloat16
      parameters). Casts that keep every value (a bfloat16 checkpoint, as HF Llamas ship,
      into a float32 model) need nothing; every cast is listed in the report
      (MODEL_DIR/upcycling_report.txt), as exact or rounding.
  """

  experts: Union[str, ExpertInit, Callable[..., Any]] = 'copy'
  router: Union[str, RouterInit] = 'normal'
  cast: bool = False
  upcycles = True

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    """With a MultiSource initializer (Branch-Train-MiX, UpIT) `source` is its
    `shared_params()`: the sources are the plan's, the executors do not know them."""
    shared = (self.experts.describe_shared() if isinstance(self.experts, MultiSource)
              else 'copy')
    return plan_lib.make(source, target, experts_lib.get(self.experts),
                         router_init.get(self.router), cast=self.cast, shared=shared, step=step,
                         layers=layers)


Usage = Union[str, Mapping[str, Sequence[float]]]


@dataclasses.dataclass(frozen=True)
class GrowExperts:
  """A trained MoE with more experts per block, each new one a copy of `sources`' choice
  (`expert_growth.py`). The model is the checkpoint's with a larger num_experts (and, for an
  exactly preserved function, capacity factor or k scaled).

  Attributes:
    sources: which experts the new ones copy: 'tile', 'most_used' (with `usage`),
      'router_norm', a list of expert indices, or {MoE block: list}.
    usage: {MoE block: [E] usage} for sources='most_used' (e.g.
      `expert_growth.router_usage`), or a JSON file (local or gs://) holding that mapping.
    binding: the name of `sources` in errors; '' names its gin binding.
  """

  sources: expert_growth.Sources = 'tile'
  usage: Optional[Usage] = None
  binding: str = ''
  upcycles = False

  def _usage(self) -> Optional[Mapping[str, Sequence[float]]]:
    if not isinstance(self.usage, str):
      return self.usage
    try:
      return json.loads(epath.Path(self.usage).read_text())
    except (OSError, ValueError) as e:
      raise fields.ConfigError(f'{fields.binding(self, "usage")}={self.usage!r}: cannot read '
                               f'a JSON mapping {{MoE block: [E] usage}} from it ({e}).') from e

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers
    return expert_growth.plan(source, target, sources=self.sources, usage=self._usage(),
                              step=step, binding=self.binding or fields.binding(self, 'sources'))


@dataclasses.dataclass(frozen=True)
class GrowDepth:
  """A checkpoint with more layers per stack, each a copy of the layer `layer_map` names
  (`depth_growth.py`; not function-preserving). The model is the checkpoint's with more
  layers (num_encoder_layers / num_decoder_layers, ViT depth).

  Attributes:
    layer_map: 'tile' ([0, ..., L-1, 0, ...]), 'repeat' ([0, 0, 1, 1, ...]), a list of source
      layers, or {stack: one of these} ('encoder/layers', 'decoder/layers',
      'Transformer/encoderblock').
    binding: the name of `layer_map` in errors; '' names its gin binding.
  """

  layer_map: depth_growth.LayerMap = 'tile'
  binding: str = ''
  upcycles = False

  def plan(self, source: Any, target: Any, *, step: int, layers: Layers = None
           ) -> plan_lib.Plan:
    del layers
    return depth_growth.plan(source, target, layer_map=self.layer_map, step=step,
                             binding=self.binding or fields.binding(self, 'layer_map'))


MODES = (Continue, Upcycle, GrowExperts, GrowDepth)   # the registration
Mode = Union[MODES]
