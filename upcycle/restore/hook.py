"""The restore hook: a run's first TrainState, built from a checkpoint directly on the mesh.

The trainer calls `initializer(abstract_state, optimizer, model_config)` only when MODEL_DIR
holds no checkpoint of the run; a run that has one resumes from it in the trainer, so
upcycling happens once. `abstract_state` is a TrainState of `jax.ShapeDtypeStruct`s whose
`.sharding`s say where each array goes, `optimizer` the run's optax transformation,
`model_config` the model's (a scanned model restores unrolled checkpoints: `Layout`); the
state returned is placed with exactly those shardings.

There is one hook, `Restore(source, mode)`: a checkpoint (or several), a mode
(`upcycling/modes.py`: what plan to build, as data) and how the rest of the state follows
(optimizer state, step, data position). The mode is bound in gin; configs/upcycling/ names
each for users:

  upcycle_from_dense.gin        a dense checkpoint -> the MoE model (`@modes.Upcycle()`: Sparse
                                Upcycling and its variants, any expert / router initializer,
                                several checkpoints for Branch-Train-MiX / UpIT)
  continue_from_checkpoint.gin  a checkpoint of the model's own architecture -> the same model
                                (`@modes.Continue()`: continue dense training, or an MoE as it is)
  grow_experts.gin              a trained MoE with more experts (`@modes.GrowExperts()`)
  grow_depth.gin                a checkpoint with more layers (`@modes.GrowDepth()`)

Every one reads any format `upcycle.checkpoints.load` knows (T5X, T5X-orbax, ours, HF, ViT
.npz), opened once for the hook's life (its plan, its digests and its data position), builds
its plan from shapes alone (every mismatch fails before anything is read), logs its report
(its summary, and every leaf in MODEL_DIR/upcycling_report.txt: `upcycling/report_file.py`),
carries a reused optimizer state through the plan (`optimizer_state/carry.py`), and
runs as one `jax.jit` placed with the run's shardings (`state_jit.py`), which `upcycle.aot`
lowers for every mode.

`step` is the step policy of `upcycle.optimizer_state.counts`: 'keep', 'reset' or N.

Combine-weight normalization is a model setting (`MoeConfig.normalize_combine_weights`),
bound in gin with the model, not here. In gin (the training entry point passes
`initializer` to the Trainer; runs/upcycle.gin includes upcycling/upcycle_from_dense.gin):

  from upcycle import restore
  from upcycle.upcycling import modes
  train_script.train.initializer = @restore.Restore()
  restore.Restore:
    source = %INITIAL_CHECKPOINT_PATH
    mode = @modes.Upcycle()
    reuse_optimizer_state = True
  modes.Upcycle.experts = @experts.Drop()      # or 'copy'
"""


import dataclasses
import functools
import os
from typing import Any, Callable, List, Optional, Sequence, Union

from upcycle import fields, pretrained, tree
from upcycle.checkpoints import (CheckpointError, Checkpoint, describe, digests, formats, orbax,
                                 paths, verify)
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.optimizer_state import counts
from upcycle.train_state import TrainState
from upcycle.restore.state_jit import StateJit, jit_plan, layout
from upcycle.upcycling import modes
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.sources import MultiSource, combine

def _plan(owner: str, where: str, make: Callable[[], Plan], *, source: Any, target: Any,
          upcycling: bool, binding: str) -> Plan:
  """`make()`, its errors saying what the checkpoint holds against what the config builds; a
  source of another family, or an MoE handed to upcycling, is refused first. `binding`: the
  hook's checkpoint field, named in the errors (ConfigError: one line at the command line)."""
  source_binding = f'{binding} (INITIAL_CHECKPOINT_PATH)'

  mismatch = None
  if describe.model_kind(source) != describe.model_kind(target):
    mismatch = (f'another model family. Fix: point {source_binding} at a checkpoint of the '
                f'model the gin files build, or build its model (its model gin file)')
  elif upcycling and tree.moe_layers(tree.flatten(source)):
    mismatch = (f'already an MoE: upcycling starts from a dense checkpoint. Fix: point '
                f'{source_binding} at the dense checkpoint, or continue this MoE with '
                f'restore.Restore.mode = @modes.Continue() (runs/continue_dense.gin with the '
                f'MoE model files)')
  if mismatch:   # the trees are described for an error only
    raise fields.ConfigError(f'{owner}({where}): the checkpoint holds {describe.summary(source)}; '
                             f'this config builds {describe.summary(target)}: {mismatch}.')
  try:
    return make()
  except ValueError as e:
    raise fields.ConfigError(f'{owner}({where}): {e} (The checkpoint, {source_binding}, holds '
                             f'{describe.summary(source)}; this config builds '
                             f'{describe.summary(target)}.)') from e


@dataclasses.dataclass(frozen=True)
class Restore:
  """The restore hook: the first state of a run from `source`, by the plan of `mode`.

  Attributes:
    source: file or directory, any supported format (a model directory means its latest
      step); several (a list) for experts made from several checkpoints (`modes.Upcycle`
      with `experts` the FromCheckpoints or Merge class).
    mode: what plan to build (`upcycling/modes.py`): `modes.Upcycle`, `modes.Continue`,
      `modes.GrowExperts` or `modes.GrowDepth` (gin: `@modes.Upcycle()`).
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    reuse_optimizer_state: carry the checkpoint's optimizer state (T5X Adafactor, our orbax
      checkpoints' optax state) through the plan (growth: new experts and layers take their
      sources' moments); the checkpoint's optimizer must be the one configured for this run.
      False: fresh state.
    step: 'keep', 'reset' or a step number (`optimizer_state/counts.py`).
    seed: seed of the initializers.
    restore_dataset: read on from the data position saved with the checkpoint (a step of a
      `python -m upcycle.train` run; T5X's `restore_dataset`), so the new run sees none of
      its examples again; the batch size may differ if the position is a whole number of new
      batches. False: the data starts from its beginning.
    verify: before anything is placed, compare every array read (the parameters, the
      optimizer state when it is reused) and the data position with the digests the
      checkpoint carries (a step of a training run, an output of convert or export;
      `checkpoints/verify.py`): changed bytes stop the run in one line. False reads it as
      it is.
  """

  source: Union[str, Sequence[str]]
  mode: modes.Mode
  format: Optional[str] = None
  reuse_optimizer_state: bool = False
  step: counts.Step = 'keep'
  seed: int = 0
  restore_dataset: bool = False
  verify: bool = True

  def __post_init__(self):
    object.__setattr__(self, 'step', counts.check(self.step, fields.binding(self, 'step')))
    if not isinstance(self.mode, modes.MODES):
      raise fields.ConfigError(
          f'{fields.binding(self, "mode")} = {self.mode!r}: expected a mode, one of '
          f'{", ".join(f"@modes.{m.__name__}()" for m in modes.MODES)} (gin, with parentheses).')
    if isinstance(getattr(self.mode, 'experts', None), MultiSource):
      raise fields.ConfigError(
          f'modes.Upcycle.experts={self.mode.experts!r}: pass the class instead of an instance '
          f'(gin: experts = @sources.FromCheckpoints, without parentheses) and the source paths '
          f'as {fields.binding(self, "source")} = [...]; the hook reads them and calls it with '
          f'sources=.')

  def _paths(self) -> List[str]:
    return [self.source] if isinstance(self.source, str) else list(self.source)

  @functools.cached_property
  def _opened(self) -> List[Checkpoint]:
    """The source checkpoints, opened once (lazy leaves; the optimizer state only when it is
    reused) for the plan, the digests and the data position."""
    return list(map(functools.partial(pretrained.load, format=self.format, lazy=True,
                                      with_optimizer_state=self.reuse_optimizer_state),
                    self._paths()))

  def __call__(self, abstract_state: TrainState, optimizer,
               model_config: Optional[Any] = None) -> TrainState:
    built = self.state_jit(abstract_state, optimizer, model_config)
    self.check_digests()
    return built()

  def _skip(self) -> str:
    """How a refusal of changed bytes says to read the checkpoint anyway."""
    return f'--gin.{fields.binding(self, "verify")}=False'

  def check_digests(self) -> None:
    """With `verify`, compares each source's parameters (and the optimizer state it reuses)
    with their digests (`verify.check`); CheckpointError in one line for changed bytes."""
    if self.verify:
      for ckpt in self._opened:
        verify.check(ckpt, skip=self._skip())

  def lower(self, abstract_state: TrainState, optimizer,
            model_config: Optional[Any] = None) -> Any:
    """The hook's jit lowered on abstract inputs: only the checkpoints' metadata is read
    (`upcycle.aot`)."""
    return self.state_jit(abstract_state, optimizer, model_config).lower()

  def state_jit(self, abstract_state: TrainState, optimizer,
                model_config: Optional[Any] = None) -> StateJit:
    """The hook's one jit, checked from shapes before anything is read."""
    owner = type(self).__name__
    ckpt, mode, source, where = self._source(owner, model_config)
    target = layout(source, abstract_state.params, model_config)
    layers = (model_config.moe_positions() if hasattr(model_config, 'moe_positions')
              else None)   # the MoE blocks' places, for Drop's ramp (None: from the names)
    plan = _plan(owner, where, functools.partial(
        mode.plan, target.source, target.target, step=counts.start(self.step, ckpt.step),
        layers=layers), source=target.source, target=target.target, upcycling=mode.upcycles,
                 binding=fields.binding(self, 'source'))
    if mode is self.mode:   # one source (several were each checked as read)
      pretrained.check_config(ckpt, model_config)   # shapes agree: does the function?
    return jit_plan(ckpt, abstract_state, optimizer, plan, target=target,
                    reuse_optimizer_state=self.reuse_optimizer_state, step=self.step,
                    seed=self.seed, owner=owner)

  def _source(self, owner: str, model_config: Optional[Any]):
    """(the checkpoint, the mode, the params the plan copies from, the source in errors).

    A mode reads several checkpoints when its experts are made from several sources (the
    FromCheckpoints or Merge class, called with them: Branch-Train-MiX, UpIT); they are
    combined into the mode's initializer (a new mode), each of them first checked against
    `model_config` on what changes the model's function (`pretrained.check_config`; one
    checkpoint is checked once its plan has its shapes)."""
    experts = getattr(self.mode, 'experts', 'copy')
    if not callable(experts) or isinstance(experts, (str, ExpertInit)):   # one checkpoint
      if not isinstance(self.source, str) and len(self.source) != 1:
        raise fields.ConfigError(
            f'{fields.binding(self, "source")} lists {len(self.source)} checkpoints, which only '
            f'experts made from several sources read: modes.Upcycle.experts = '
            f'@sources.FromCheckpoints or @sources.Merge (gin), not {self.mode!r}.')
      ckpt = self._opened[0]
      return ckpt, self.mode, ckpt.params, f'{ckpt.path!r}, format {ckpt.format!r}'
    if isinstance(self.source, str):
      raise fields.ConfigError(
          f'modes.Upcycle.experts={self.mode.experts!r} is neither an initializer name nor an '
          f'ExpertInit instance. A class (gin: @sources.FromCheckpoints, no parentheses) '
          f'takes several source checkpoints: {fields.binding(self, "source")} = [path, path, '
          f'...]; any other initializer needs parentheses (gin: @experts.Drop()).')
    if self.reuse_optimizer_state:
      raise fields.ConfigError(
          f'{owner}: several source checkpoints have no one optimizer state to reuse. Fix: '
          f'{fields.binding(self, "reuse_optimizer_state")} = False.')
    for ckpt in self._opened:
      pretrained.check_config(ckpt, model_config)
    try:
      ckpt, init = combine(self._opened, self.mode.experts, step=self.step, names={
          'step': fields.binding(self, 'step'), 'experts': 'modes.Upcycle.experts'})
    except ValueError as e:
      raise fields.ConfigError(f'{owner}: {e}') from None
    return (ckpt, dataclasses.replace(self.mode, experts=init), init.shared_params(),
            repr(self._paths()))

  def check_apart(self, model_dir: str) -> None:
    """Refuses a MODEL_DIR inside a source checkpoint (the run would write into the source
    tree) or one whose checkpoints/ holds a source (retention would delete it)."""
    if paths.is_url(model_dir):
      return
    run = os.path.realpath(model_dir)
    steps = os.path.join(run, orbax.RUN_CHECKPOINTS)
    for source in self._paths():
      if paths.is_url(source):
        continue
      src = os.path.realpath(source)
      if paths.inside(run, src) or paths.inside(src, steps):
        why = (f'lies inside the source checkpoint {source}, which a run only reads'
               if paths.inside(run, src) else f'holds the source checkpoint {source} in its '
               f'checkpoints/, where the run saves and deletes steps')
        raise fields.ConfigError(
            f'trainer.TrainConfig.model_dir = {model_dir!r} {why} '
            f'({fields.binding(self, "source")}, INITIAL_CHECKPOINT_PATH). Fix: give the run a '
            f'directory of its own, outside it.')

  def check_tokenizer(self, tokenizer: tokenizer_lib.Tokenizer, binding: str) -> None:
    """Refuses (`tokenizer.TokenizerError`, one line) the run's tokenizer unless it is the one
    each source checkpoint's weights were trained with, where that is known
    (`pretrained.trained_with`): several sources must share it."""
    shared = '' if isinstance(self.source, str) else '; merged checkpoints must share one'
    for source in self._paths():
      pretrained.check_trained(
          tokenizer, source, binding=binding, format=self.format,
          fix=f"TOKENIZER = {source!r}, the checkpoint's own (runs/llm_continue.gin's and "
          f"runs/llm_upcycle.gin's default){shared}.")

  def dataset_state(self) -> Optional[dict]:
    if not self.restore_dataset:
      return None
    flag = fields.binding(self, 'restore_dataset')
    if len(self._paths()) != 1:
      raise fields.ConfigError(
          f'{flag}=True reads one checkpoint\'s data position; {len(self._paths())} are given. '
          f'Fix: {flag} = False.')
    ckpt = self._opened[0]
    try:
      state = verify.dataset_state(ckpt.path) if formats.of(ckpt.format).run_step else None
    except CheckpointError as e:
      raise CheckpointError(f'{e}. Fix: copy the checkpoint again from its source, or read the '
                            f'data from its beginning: {flag} = False.') from e
    changed = (digests.check_json(digests.read(ckpt.path) or {}, state,
                                  os.path.join(ckpt.path, orbax.DATASET))
               if state is not None and self.verify else None)
    if changed:
      raise CheckpointError(f'{changed}. {verify.refusal(self._skip())}')
    if state is None:
      raise fields.ConfigError(
          f'{flag}=True: {ckpt.path} ({ckpt.format}) holds no data position; only the steps '
          f'of a `python -m upcycle.train` run do. Fix: {flag} = False (the data starts from '
          f'its beginning).')
    return state
