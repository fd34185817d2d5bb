"""The restore hook: a run's first TrainState, built from a checkpoint directly on the mesh.

The trainer calls `initializer(abstract_state, optimizer, model_config)` only when MODEL_DIR
holds no checkpoint of the run; a run that has one resumes from it in the trainer, so
upcycling happens once. `abstract_state` is a TrainState of `jax.ShapeDtypeStruct`s whose
`.sharding`s say where each array goes, `optimizer` the run's optax transformation,
`model_config` the model's (a scanned model restores unrolled checkpoints: `Layout`); the
state returned is placed with exactly those shardings.

There is one hook, `Restore`: a checkpoint (or several), a mode (`upcycling/modes.py`: what
plan to build, as data) and how the rest of the state follows (optimizer state, step, data
position). Its gin-facing names each give one mode:

  UpcycleFromDense        a dense checkpoint -> the MoE model (`modes.Upcycle`: Sparse
                          Upcycling and its variants, any expert / router initializer, several
                          checkpoints for Branch-Train-MiX / UpIT)
  ContinueFromCheckpoint  a checkpoint of the model's own architecture -> the same model
                          (`modes.Continue`: continue dense training, or an MoE as it is)
  grow.GrowExperts        a trained MoE with more experts (`modes.GrowExperts`)
  grow.GrowDepth          a checkpoint with more layers (`modes.GrowDepth`)

Every one reads any format `upcycle.checkpoints.load` knows (T5X, T5X-orbax, ours, HF, ViT
.npz), builds its plan from shapes alone (every mismatch fails before anything is read), logs
its report (its summary, and every leaf in MODEL_DIR/upcycling_report.txt:
`upcycling/report_file.py`), carries a reused optimizer state through the plan
(`upcycling/optimizer.py`), and runs as one `jax.jit` placed with the run's shardings
(`state_jit.py`), which `upcycle.aot` lowers for every mode.

`step` is the step policy of `upcycle.upcycling.step_policy`: 'keep', 'reset' or N.

Combine-weight normalization is a model setting (`MoeConfig.normalize_combine_weights`),
bound in gin with the model, not here. In gin (the training entry point passes
`initializer` to the Trainer):

  from upcycle.train import restore
  train_script.train.initializer = @restore.UpcycleFromDense()
  restore.UpcycleFromDense:
    checkpoint = %INITIAL_CHECKPOINT_PATH
    experts = @experts.Drop()      # or 'copy'
    reuse_optimizer_state = True
"""


import abc
import dataclasses
import os
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from upcycle import fields, pretrained, tree
from upcycle.checkpoints import CheckpointError, describe, digests, orbax, paths, verify
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.train.state import TrainState
from upcycle.train.state_jit import StateJit, host_jit, layout, plan_jit
from upcycle.upcycling import modes, step_policy
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.router_init import RouterInit
from upcycle.upcycling.sources import MultiSource, combine


def _plan(owner: str, where: str, make: Callable[[], Plan], *, source: Any, target: Any,
          upcycling: bool, binding: str) -> Plan:
  """`make()`, its errors saying what the checkpoint holds against what the config builds; a
  source of another family, or an MoE handed to upcycling, is refused first. `binding`: the
  hook's checkpoint field, named in the errors (ConfigError: one line at the command line)."""
  held, built = describe.summary(source), describe.summary(target)
  source_binding = f'{binding} (INITIAL_CHECKPOINT_PATH)'
  mismatch = None
  if describe.model_kind(source) != describe.model_kind(target):
    mismatch = (f'another model family. Fix: point {source_binding} at a checkpoint of the '
                f'model the gin files build, or build its model (its model gin file)')
  elif upcycling and tree.moe_layers(tree.flatten(source)):
    mismatch = (f'already an MoE: upcycling starts from a dense checkpoint. Fix: point '
                f'{source_binding} at the dense checkpoint, or continue this MoE with '
                f'restore.ContinueFromCheckpoint (runs/continue_dense.gin with the MoE model '
                f'files)')
  if mismatch:
    raise fields.ConfigError(f'{owner}({where}): the checkpoint holds {held}; this config '
                             f'builds {built}: {mismatch}.')
  try:
    return make()
  except ValueError as e:
    raise fields.ConfigError(f'{owner}({where}): {e} (The checkpoint, {source_binding}, '
                             f'holds {held}; this config builds {built}.)') from e


@dataclasses.dataclass(frozen=True)
class Restore(abc.ABC):
  """The restore hook: the first state of a run from `checkpoint`, by the plan of `mode()`.

  Attributes:
    checkpoint: file or directory, any supported format (a model directory means its latest
      step); several for experts made from several checkpoints (`UpcycleFromDense`).
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    reuse_optimizer_state: carry the checkpoint's optimizer state (T5X Adafactor, our orbax
      checkpoints' optax state) through the plan; the checkpoint's optimizer must be the one
      configured for this run. False: fresh state.
    step: 'keep', 'reset' or a step number (`upcycling/step_policy.py`).
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

  checkpoint: Union[str, Sequence[str]]
  format: Optional[str] = None
  reuse_optimizer_state: bool = False
  step: step_policy.Step = 'keep'
  seed: int = 0
  restore_dataset: bool = False
  verify: bool = True

  def __post_init__(self):
    object.__setattr__(self, 'step', step_policy.check(self.step, fields.binding(self, 'step')))

  @abc.abstractmethod
  def mode(self) -> modes.Mode:
    """What plan to build (`upcycling/modes.py`)."""

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
    if not self.verify:
      return
    sources = [self.checkpoint] if isinstance(self.checkpoint, str) else list(self.checkpoint)
    for source in sources:
      ckpt = pretrained.load(source, self.format, lazy=True,
                             with_optimizer_state=self.reuse_optimizer_state)
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
    ckpt, source, mode, where = self._sources(owner, model_config)
    target = layout(source, abstract_state.params, model_config)
    layers = (model_config.moe_positions() if hasattr(model_config, 'moe_positions')
              else None)   # the MoE blocks' places, for Drop's ramp (None: from the names)
    plan = _plan(owner, where, lambda: mode.plan(
        target.source, target.target, step=step_policy.start(self.step, ckpt.step),
        layers=layers), source=target.source, target=target.target, upcycling=mode.upcycles,
                 binding=fields.binding(self, 'checkpoint'))
    if isinstance(self.checkpoint, str):   # several sources were each checked as read
      pretrained.check_config(ckpt, model_config)   # shapes agree: does the function?
    if plan.experts is None or plan.experts.traceable:
      return plan_jit(ckpt, abstract_state, optimizer, plan, target=target,
                      reuse_optimizer_state=self.reuse_optimizer_state,
                      step=self.step, seed=self.seed, owner=owner)
    return host_jit(ckpt, abstract_state, optimizer, plan, target=target, seed=self.seed,
                    owner=owner)

  def _sources(self, owner: str, model_config: Optional[Any]
               ) -> Tuple[Any, Any, modes.Mode, str]:
    """(the checkpoint, the params the plan copies from, the mode, the checkpoint in errors);
    several checkpoints are combined by the mode's experts (Branch-Train-MiX, UpIT), each of
    which must agree with `model_config` on what changes the model's function
    (`pretrained.check_config`; one checkpoint is checked once its plan has its shapes)."""
    mode = self.mode()
    if isinstance(self.checkpoint, str):
      if isinstance(mode, modes.Upcycle) and not isinstance(mode.experts, (str, ExpertInit)):
        raise fields.ConfigError(
            f'{owner}.experts={mode.experts!r} is neither an initializer name nor an '
            f'ExpertInit instance. A class (gin: @sources.FromCheckpoints, no parentheses) '
            f'takes several source checkpoints: {owner}.checkpoint = [path, path, ...]; any '
            f'other initializer needs parentheses (gin: @experts.Drop()).')
      ckpt = pretrained.load(self.checkpoint, self.format, lazy=True)
      return ckpt, ckpt.params, mode, f'{ckpt.path!r}, format {ckpt.format!r}'
    ckpt, init = self._several(owner, mode, model_config)
    return (ckpt, init.shared_params(), dataclasses.replace(mode, experts=init),
            repr(list(self.checkpoint)))

  def _several(self, owner: str, mode: modes.Mode, model_config: Optional[Any]):
    """(first checkpoint, initializer) for Branch-Train-MiX / UpIT sources."""
    experts = getattr(mode, 'experts', None)
    if isinstance(experts, (str, ExpertInit)) or not callable(experts):
      raise fields.ConfigError(
          f'{owner}.checkpoint lists {len(self.checkpoint)} checkpoints, so {owner}.experts must '
          f'make experts from several sources: @FromCheckpoints or @Merge (gin), not '
          f'{experts!r}.')
    if self.reuse_optimizer_state:
      raise fields.ConfigError(f'{owner}: several source checkpoints have no one optimizer '
                               f'state to reuse. Fix: {owner}.reuse_optimizer_state = False.')
    ckpts = [pretrained.load(path, self.format, lazy=True) for path in self.checkpoint]
    for ckpt in ckpts:
      pretrained.check_config(ckpt, model_config)
    try:
      ckpt, init = combine(ckpts, experts, step=self.step, names={
          'step': f'{owner}.step', 'experts': f'{owner}.experts'})
    except ValueError as e:
      raise fields.ConfigError(f'{owner}: {e}') from None
    return ckpt, init

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
        owner = type(self).__name__
        why = (f'lies inside the source checkpoint {source}, which a run only reads'
               if paths.inside(run, src) else f'holds the source checkpoint {source} in its '
               f'checkpoints/, where the run saves and deletes steps')
        raise fields.ConfigError(
            f'trainer.TrainConfig.model_dir = {model_dir!r} {why} ({owner}.checkpoint, '
            f'INITIAL_CHECKPOINT_PATH). Fix: give the run a directory of its own, outside it.')

  def _paths(self) -> Sequence[str]:
    return [self.checkpoint] if isinstance(self.checkpoint, str) else list(self.checkpoint)

  def check_tokenizer(self, tokenizer: tokenizer_lib.Tokenizer, binding: str) -> None:
    """Refuses (`tokenizer.TokenizerError`, one line) the run's tokenizer unless it is the one
    each source checkpoint's weights were trained with, where that is known
    (`pretrained.trained_with`): several sources must share it."""
    shared = '' if isinstance(self.checkpoint, str) else '; merged checkpoints must share one'
    for source in self._paths():
      pretrained.check_trained(
          tokenizer, source, binding=binding, format=self.format,
          fix=f"TOKENIZER = {source!r}, the checkpoint's own (runs/llm_continue.gin's and "
          f"runs/llm_upcycle.gin's default){shared}.")

  def dataset_state(self) -> Optional[dict]:
    if not self.restore_dataset:
      return None
    owner = type(self).__name__
    if not isinstance(self.checkpoint, str):
      raise fields.ConfigError(
          f'{owner}.restore_dataset=True reads one checkpoint\'s data position; '
          f'{len(self.checkpoint)} are given. Fix: {owner}.restore_dataset = False.')
    ckpt = pretrained.load(self.checkpoint, self.format, lazy=True)
    try:
      state = verify.dataset_state(ckpt.path) if ckpt.format == 'orbax' else None
    except CheckpointError as e:
      raise CheckpointError(f'{e}. Fix: copy the checkpoint again from its source, or read the '
                            f'data from its beginning: {owner}.restore_dataset = False.') from e
    changed = (digests.check_json(digests.read(ckpt.path) or {}, state,
                                  os.path.join(ckpt.path, orbax.DATASET))
               if state is not None and self.verify else None)
    if changed:
      raise CheckpointError(f'{changed}. {verify.refusal(self._skip())}')
    if state is None:
      raise fields.ConfigError(
          f'{owner}.restore_dataset=True: {ckpt.path} ({ckpt.format}) holds no data position; '
          f'only the steps of a `python -m upcycle.train` run do. Fix: {owner}.restore_dataset '
          f'= False (the data starts from its beginning).')
    return state


@dataclasses.dataclass(frozen=True)
class UpcycleFromDense(Restore):
  """Initializer: the MoE model's first state, upcycled from a dense checkpoint
  (`modes.Upcycle`).

  Attributes (besides `Restore`'s):
    checkpoint: the dense checkpoint. Branch-Train-MiX / UpIT: a list of checkpoints, with
      `experts` the FromCheckpoints or Merge class (gin: `@FromCheckpoints`, its other
      arguments bound in gin); the hook calls it with `sources=` (`sources.combine`, as
      `python -m upcycle.convert` does). These run the surgery on the host (they are not
      traceable), reading the sources lazily, and then place the result on the mesh, so the
      host holds the MoE params at once; the optimizer state is then fresh.
    experts: an ExpertInit, or 'copy', 'drop', 'noise', 'random'.
    router: a RouterInit, or 'normal', 'uniform', 'zeros'.
    cast: also allow casts that round values (a float32 checkpoint into bfloat16
      parameters). Casts that keep every value (a bfloat16 checkpoint, as HF Llamas ship,
      into a float32 model) need nothing; every cast is listed in the report
      (MODEL_DIR/upcycling_report.txt), as exact or rounding.
  """

  experts: Union[str, ExpertInit, Callable[..., MultiSource]] = 'copy'
  router: Union[str, RouterInit] = 'normal'
  cast: bool = False

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.experts, MultiSource):
      raise fields.ConfigError(
          f'UpcycleFromDense.experts={self.experts!r}: pass the class instead of an instance '
          f'(gin: experts = @FromCheckpoints, without parentheses) and the source paths as '
          f'UpcycleFromDense.checkpoint = [...]; the hook reads them and calls it with sources=.')

  def mode(self) -> modes.Upcycle:
    return modes.Upcycle(self.experts, self.router, self.cast)


@dataclasses.dataclass(frozen=True)
class ContinueFromCheckpoint(Restore):
  """Initializer: the first state of a run continuing a checkpoint of the same architecture
  (`modes.Continue`).

  Every parameter is copied from the same path (as `copy_params`): a dense model from a dense
  checkpoint (continue dense training: the baseline of the upcycling experiments), or an MoE
  model from an MoE checkpoint (one written by `python -m upcycle.convert`, or another run's).

  Attributes (besides `Restore`'s):
    reuse_optimizer_state: restore the checkpoint's optimizer state as it is (default True).
    cast: also allow casts that round values (`UpcycleFromDense.cast`).
  """

  checkpoint: str
  reuse_optimizer_state: bool = True
  cast: bool = False

  def mode(self) -> modes.Continue:
    return modes.Continue(self.cast)
