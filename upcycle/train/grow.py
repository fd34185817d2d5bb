"""Restore hooks that grow a trained checkpoint: more experts per MoE block, or more layers.

  GrowExperts  a trained MoE checkpoint -> the same MoE with more experts per block, every new
               expert (and its router column) a copy of an old one (`upcycling/expert_growth.py`)
  GrowDepth    a checkpoint with L layers per stack -> L' layers, each a copy of one of them
               (`upcycling/depth_growth.py`)

They are the restore hook (`restore.Restore`) with a growth mode (`upcycling/modes.py`): like
`restore.UpcycleFromDense` they read any format `checkpoints.load` knows, check every name and
shape before reading (sources='router_norm' reads the router kernels), print the report, and
build the state in one `jax.jit` placed with the run's shardings (`state_jit.py`). A reused
optimizer state is taken like the parameters (new experts and layers get their sources'
moments, `upcycling/optimizer.py`) and keeps its counts under step='keep', so the schedule
continues. In gin (upcycling/grow.gin, upcycling/depth.gin):

  from upcycle.train import grow
  train_script.train.initializer = @grow.GrowExperts()
  grow.GrowExperts:
    checkpoint = %INITIAL_CHECKPOINT_PATH
    sources = 'tile'
"""

import dataclasses
import json
from typing import Mapping, Optional, Sequence, Union

from etils import epath

from upcycle import fields
from upcycle.train import restore
from upcycle.upcycling import depth_growth, expert_growth, modes

Usage = Union[str, Mapping[str, Sequence[float]]]


@dataclasses.dataclass(frozen=True)
class GrowExperts(restore.Restore):
  """Initializer: a trained MoE checkpoint with more experts per block.

  The model is the checkpoint's with a larger num_experts (and, for an exactly preserved
  function, capacity factor or k scaled: `upcycling/expert_growth.py`).

  Attributes (besides `restore.Restore`'s):
    checkpoint: the MoE checkpoint (file or directory, any supported format).
    sources: which experts the new ones copy: 'tile', 'most_used' (with `usage`),
      'router_norm', a list of expert indices, or {MoE block: list}.
    usage: {MoE block: [E] usage} for sources='most_used' (e.g.
      `expert_growth.router_usage`), or a JSON file (local or gs://) holding that mapping.
    reuse_optimizer_state: take the checkpoint's optimizer state like the parameters
      (the run's optimizer must be the checkpoint's; default True); False: fresh state.
  """

  checkpoint: str
  reuse_optimizer_state: bool = True
  sources: expert_growth.Sources = 'tile'
  usage: Optional[Usage] = None

  def _usage(self) -> Optional[Mapping[str, Sequence[float]]]:
    if not isinstance(self.usage, str):
      return self.usage
    try:
      return json.loads(epath.Path(self.usage).read_text())
    except (OSError, ValueError) as e:
      raise fields.ConfigError(f'{fields.binding(self, "usage")}={self.usage!r}: cannot read '
                               f'a JSON mapping {{MoE block: [E] usage}} from it ({e}).') from e

  def mode(self) -> modes.GrowExperts:
    return modes.GrowExperts(self.sources, self._usage(), fields.binding(self, 'sources'))


@dataclasses.dataclass(frozen=True)
class GrowDepth(restore.Restore):
  """Initializer: a checkpoint with more layers per stack, each a copy of one of its layers.

  The model is the checkpoint's with more layers (num_encoder_layers / num_decoder_layers,
  ViT depth). Not function-preserving (`upcycling/depth_growth.py`).

  Attributes (besides `restore.Restore`'s):
    layer_map: 'tile' ([0, ..., L-1, 0, ...]), 'repeat' ([0, 0, 1, 1, ...]), a list of source
      layers, or {stack: one of these} ('encoder/layers', 'decoder/layers',
      'Transformer/encoderblock').
    reuse_optimizer_state: take the checkpoint's optimizer state like the parameters
      (default True); False: fresh state.
  """

  checkpoint: str
  reuse_optimizer_state: bool = True
  layer_map: depth_growth.LayerMap = 'tile'

  def mode(self) -> modes.GrowDepth:
    return modes.GrowDepth(self.layer_map, fields.binding(self, 'layer_map'))
