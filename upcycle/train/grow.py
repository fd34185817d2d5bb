"""Restore hooks that grow a trained checkpoint: more experts per MoE block, or more layers.

  GrowExperts  a trained MoE checkpoint -> the same MoE with more experts per block, every new
               expert (and its router column) a copy of an old one (`upcycling/expert_growth.py`)
  GrowDepth    a checkpoint with L layers per stack -> L' layers, each a copy of one of them
               (`upcycling/depth_growth.py`)

Like `restore.UpcycleFromDense` they read any format `checkpoints.load` knows, check every
name and shape before reading (sources='router_norm' reads the router kernels), print the
report, and build the state in one `jax.jit` placed with the run's shardings
(`restore.plan_jit`). A reused optimizer state is taken like the parameters (new experts
and layers get their sources' moments, `upcycling/optimizer.py`) and keeps its counts
under step='keep', so the schedule continues. In gin (upcycling/grow.gin, upcycling/depth.gin):

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

from upcycle import fields, pretrained
from upcycle.train import restore
from upcycle.train.state import TrainState
from upcycle.upcycling import depth_growth, expert_growth, step_policy
from upcycle.upcycling.plan import Plan

Usage = Union[str, Mapping[str, Sequence[float]]]


def _jit(owner: str, hook, abstract_state: TrainState, optimizer, model_config,
         make_plan) -> restore.StateJit:
  """The state jit of `hook` (checkpoint, format, reuse_optimizer_state, step) via
  `make_plan`, for a model of `model_config` (`restore.layout`)."""
  ckpt = pretrained.load(hook.checkpoint, hook.format, lazy=True)
  first = step_policy.start(hook.step, ckpt.step)
  target = restore.layout(ckpt.params, abstract_state.params, model_config)
  try:
    growth: Plan = make_plan(ckpt.params, target.target, first)
  except ValueError as e:
    raise fields.ConfigError(f'{owner}({ckpt.path!r}, format {ckpt.format!r}): {e}') from e
  return restore.plan_jit(
      ckpt, abstract_state, optimizer, growth, target=target,
      reuse_optimizer_state=hook.reuse_optimizer_state, step=hook.step, seed=0, owner=owner)


@dataclasses.dataclass(frozen=True)
class GrowExperts(restore.OneJit):
  """Initializer: a trained MoE checkpoint with more experts per block.

  The model is the checkpoint's with a larger num_experts (and, for an exactly preserved
  function, capacity factor or k scaled: `upcycling/expert_growth.py`).

  Attributes:
    checkpoint: the MoE checkpoint (file or directory, any supported format).
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    sources: which experts the new ones copy: 'tile', 'most_used' (with `usage`),
      'router_norm', a list of expert indices, or {MoE block: list}.
    usage: {MoE block: [E] usage} for sources='most_used' (e.g.
      `expert_growth.router_usage`), or a JSON file (local or gs://) holding that mapping.
    reuse_optimizer_state: take the checkpoint's optimizer state like the parameters
      (the run's optimizer must be the checkpoint's); False: fresh state.
    step: 'keep', 'reset' or a step number (`upcycling/step_policy.py`).
    restore_dataset: read on from the checkpoint's data position
      (`restore.UpcycleFromDense`).
  """

  checkpoint: str
  format: Optional[str] = None
  sources: expert_growth.Sources = 'tile'
  usage: Optional[Usage] = None
  reuse_optimizer_state: bool = True
  step: step_policy.Step = 'keep'
  restore_dataset: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'step', step_policy.check(self.step, fields.binding(self, 'step')))

  def _usage(self) -> Optional[Mapping[str, Sequence[float]]]:
    if not isinstance(self.usage, str):
      return self.usage
    try:
      return json.loads(epath.Path(self.usage).read_text())
    except (OSError, ValueError) as e:
      raise fields.ConfigError(f'{fields.binding(self, "usage")}={self.usage!r}: cannot read '
                               f'a JSON mapping {{MoE block: [E] usage}} from it ({e}).') from e

  def _jit(self, abstract_state: TrainState, optimizer, model_config) -> restore.StateJit:
    usage = self._usage()
    return _jit('GrowExperts', self, abstract_state, optimizer, model_config,
                lambda params, target, first: expert_growth.plan(
                    params, target, sources=self.sources, usage=usage, step=first,
                    binding=fields.binding(self, 'sources')))


@dataclasses.dataclass(frozen=True)
class GrowDepth(restore.OneJit):
  """Initializer: a checkpoint with more layers per stack, each a copy of one of its layers.

  The model is the checkpoint's with more layers (num_encoder_layers / num_decoder_layers,
  ViT depth). Not function-preserving (`upcycling/depth_growth.py`).

  Attributes:
    checkpoint: file or directory, any supported format.
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    layer_map: 'tile' ([0, ..., L-1, 0, ...]), 'repeat' ([0, 0, 1, 1, ...]), a list of source
      layers, or {stack: one of these} ('encoder/layers', 'decoder/layers',
      'Transformer/encoderblock').
    reuse_optimizer_state: take the checkpoint's optimizer state like the parameters;
      False: fresh state.
    step: 'keep', 'reset' or a step number (`upcycling/step_policy.py`).
    restore_dataset: read on from the checkpoint's data position
      (`restore.UpcycleFromDense`).
  """

  checkpoint: str
  format: Optional[str] = None
  layer_map: depth_growth.LayerMap = 'tile'
  reuse_optimizer_state: bool = True
  step: step_policy.Step = 'keep'
  restore_dataset: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'step', step_policy.check(self.step, fields.binding(self, 'step')))

  def _jit(self, abstract_state: TrainState, optimizer, model_config) -> restore.StateJit:
    return _jit('GrowDepth', self, abstract_state, optimizer, model_config,
                lambda params, target, first: depth_growth.plan(
                    params, target, layer_map=self.layer_map, step=first,
                    binding=fields.binding(self, 'layer_map')))
