"""The restore hook: a run's first TrainState, built from a checkpoint directly on the mesh.

The trainer calls `initializer(abstract_state, optimizer)` only when MODEL_DIR holds no
checkpoint of the run; a run that has one resumes from it in the trainer, so upcycling happens
once. `abstract_state` is a TrainState of `jax.ShapeDtypeStruct`s whose `.sharding`s say where
each array goes, `optimizer` the run's optax transformation; the state returned is placed with
exactly those shardings.

  UpcycleFromDense        a dense checkpoint -> the MoE model (Sparse Upcycling and its
                          variants: any expert / router initializer)
  ContinueFromCheckpoint  a checkpoint of the model's own architecture -> the same model
                          (continue dense training, or load an MoE checkpoint as it is)

Both read any format `upcycle.checkpoints.load` knows (T5X, T5X-orbax, ours, HF, ViT .npz)
and build the whole state in one `jax.jit` whose out_shardings are the abstract state's: every
expert tensor is created already split over the 'expert' mesh axis and no host holds E copies.
The dense leaves are its inputs, each host reading only the blocks its devices need
(`sharded.py`). The surgery is traced without data first (`jax.eval_shape`), so a mismatch
fails before anything is read; the report is printed.

Step handling (`step`):
  'keep'   the checkpoint's step continues (0 for formats without one: HF, .npz), and so does
           the learning-rate schedule. A reused optimizer state keeps all its counts; a fresh
           one gets the step in its schedule counts only, while its moment counts (Adam bias
           correction, Adafactor decay) start at 0 with the moments.
  'reset'  step 0 and every count 0.
  N        step N, schedule counts N (e.g. a HF T5 v1.1 checkpoint known to be at 1M steps).

Combine-weight normalization is a model setting (`MoeConfig.normalize_combine_weights`),
bound in gin with the model, not here. In gin (the training entry point passes
`initializer` to the Trainer):

  from upcycle.upcycling import restore
  train_script.train.initializer = @restore.UpcycleFromDense()
  restore.UpcycleFromDense:
    checkpoint = %INITIAL_CHECKPOINT_PATH
    experts = @experts.Drop()      # or 'copy'
    reuse_optimizer_state = True
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import checkpoints
from upcycle.train.state import TrainState
from upcycle.upcycling import paths, sharded, stored_state
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.optimizer import upcycle_optimizer_state
from upcycle.upcycling.routers import RouterInit
from upcycle.upcycling.sources import MultiSource
from upcycle.upcycling.surgery import copy_params, upcycle, upcycle_from_checkpoints

Step = Union[str, int]


def _check_step(step: Step, owner: str) -> None:
  if step in ('keep', 'reset') or (isinstance(step, int) and not isinstance(step, bool)
                                   and step >= 0):
    return
  raise ValueError(f"{owner}.step={step!r}: expected 'keep', 'reset' or a step number >= 0.")


def _start_step(step: Step, checkpoint_step: Optional[int]) -> int:
  if step == 'keep':
    return int(checkpoint_step or 0)
  return 0 if step == 'reset' else int(step)


def _with_step_policy(opt_state: Any, step: Step, start: int) -> Any:
  """A reused optimizer state under the step policy (see the module docstring)."""
  if step == 'keep':
    return opt_state
  if step == 'reset':
    return stored_state.set_counts(opt_state, 0, schedule_only=False)
  return stored_state.set_counts(opt_state, start, schedule_only=True)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  dtype = x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype
  return jax.ShapeDtypeStruct(tuple(np.shape(x)), dtype)


def _announce(owner: str, ckpt, start: int, reuse: bool, report) -> None:
  if jax.process_index() != 0:
    return
  state = 'reused' if reuse else 'fresh'
  print(f'{owner}: {ckpt.path} ({ckpt.format}, step {ckpt.step}) -> start at step {start}, '
        f'{state} optimizer state.', flush=True)
  for note in ckpt.notes:
    print(f'  reader: {note}', flush=True)
  print(report, flush=True)


def build_state(ckpt: checkpoints.Checkpoint, abstract_state: TrainState,
                optimizer, make_params: Callable, *, reuse_optimizer_state: bool,
                upcycled: bool, step: Step, seed: int, owner: str) -> TrainState:
  """The shared path of both hooks: trace, report, read sharded, one jit.

  Args:
    ckpt: the source checkpoint (lazy leaves).
    abstract_state: the trainer's abstract TrainState (leaves with `.sharding`).
    optimizer: the run's optax transformation.
    make_params: `(dense tree, target tree, rng) -> (params, report)`, traceable.
    reuse_optimizer_state: fill the optimizer state from the checkpoint's.
    upcycled: whether the params are upcycled (the stored state is then the
      dense model's and is tiled) or copied (the stored state is the model's).
    step: the step policy.
    seed: the rng seed of the surgery.
    owner: the hook's class name, for messages and gin bindings.
  """
  dense = paths.flatten(ckpt.params)
  dense_abstract = {p: _abstract(x) for p, x in dense.items()}
  target = paths.flatten(abstract_state.params)
  start = _start_step(step, ckpt.step)
  saved = (stored_state.stored(ckpt, f'{owner}.reuse_optimizer_state')
           if reuse_optimizer_state else None)
  reports = []

  def build(inputs, saved_state, rng):
    tree = paths.unflatten({**dense_abstract, **inputs})
    params, report = make_params(tree, abstract_state.params, rng)
    reports.append(report)
    if saved_state is None:
      opt_state = stored_state.set_counts(optimizer.init(params), start, schedule_only=True)
    else:
      source = stored_state.as_optax(saved_state, ckpt.format, tree if upcycled else params,
                                     optimizer, ckpt.path)
      if upcycled:
        source = upcycle_optimizer_state(source, params, optimizer)
      opt_state = _with_step_policy(source, step, start)
    return TrainState(jnp.asarray(start, abstract_state.step.dtype), params, opt_state)

  rng = jax.random.PRNGKey(seed)
  saved_abstract = None if saved is None else jax.tree.map(_abstract, saved)
  try:
    jax.eval_shape(build, dense_abstract, saved_abstract, rng)
  except ValueError as e:
    raise ValueError(f'{owner}({ckpt.path!r}, format {ckpt.format!r}): {e}') from e
  report = reports[-1]
  _announce(owner, ckpt, start, reuse_optimizer_state, report)

  placement = sharded.source_shardings(report, target, dense)
  inputs = {path: sharded.read(dense[path], sharding) for path, sharding in placement.items()}
  saved_inputs = None
  if saved is not None:
    mesh = abstract_state.step.sharding.mesh
    slots = {p: (paths.shape_of(dense[p]), s) for p, s in placement.items()}
    replicated = NamedSharding(mesh, PartitionSpec())
    saved_inputs = jax.tree_util.tree_map_with_path(
        lambda kp, x: sharded.read(x, sharded.slot_sharding(
            jax.tree_util.keystr(kp, simple=True, separator='/'), np.shape(x), slots,
            replicated)), saved)
  out_shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
  donate = () if jax.default_backend() == 'cpu' else (0,)
  return jax.jit(build, out_shardings=out_shardings, donate_argnums=donate)(
      inputs, saved_inputs, rng)


@dataclasses.dataclass(frozen=True)
class UpcycleFromDense:
  """Initializer: the MoE model's first state, upcycled from a dense checkpoint.

  Attributes:
    checkpoint: the dense checkpoint (file or directory, any supported format;
      a model directory means its latest step). Branch-Train-MiX / UpIT: a list
      of checkpoints, with `experts` the FromCheckpoints or Merge class (gin:
      `@FromCheckpoints`, its other arguments bound in gin); the hook calls it
      with `sources=`. These run the surgery on the host (they are not
      traceable) and then place the result on the mesh, so the host holds all
      sources and the MoE params at once; the optimizer state is then fresh.
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    experts: an ExpertInit, or 'copy', 'drop', 'noise', 'random'.
    router: a RouterInit, or 'normal', 'uniform', 'zeros'.
    reuse_optimizer_state: tile the dense optimizer state (T5X Adafactor, or
      our orbax checkpoints' optax state) into the MoE one; the dense run's
      optimizer must be the one configured for this run. False: fresh state.
    step: 'keep', 'reset' or a step number (module docstring).
    seed: seed of the expert and router initializers.
    cast: cast dense values to the model's parameter dtypes (e.g. a bfloat16
      checkpoint into a float32 model) instead of failing; casts are listed in
      the printed report.
  """

  checkpoint: Union[str, Sequence[str]]
  format: Optional[str] = None
  experts: Union[str, ExpertInit, Callable[..., MultiSource]] = 'copy'
  router: Union[str, RouterInit] = 'normal'
  reuse_optimizer_state: bool = False
  step: Step = 'keep'
  seed: int = 0
  cast: bool = False

  def __post_init__(self):
    _check_step(self.step, 'UpcycleFromDense')
    if isinstance(self.experts, MultiSource):
      raise ValueError(
          f'UpcycleFromDense.experts={self.experts!r}: pass the class instead of an instance '
          f'(gin: experts = @FromCheckpoints, without parentheses) and the source paths as '
          f'UpcycleFromDense.checkpoint = [...]; the hook reads them and calls it with sources=.')

  def _several(self) -> bool:
    return not isinstance(self.checkpoint, str)

  def __call__(self, abstract_state: TrainState, optimizer) -> TrainState:
    if self._several():
      return self._from_several(abstract_state, optimizer)
    if not isinstance(self.experts, (str, ExpertInit)):
      raise ValueError(
          f'UpcycleFromDense.experts={self.experts!r} is neither an initializer name nor an '
          f'ExpertInit instance. A class (gin: @sources.FromCheckpoints, no parentheses) takes '
          f'several source checkpoints: UpcycleFromDense.checkpoint = [path, path, ...]; any '
          f'other initializer needs parentheses (gin: @experts.Drop()).')
    ckpt = checkpoints.load(self.checkpoint, self.format, lazy=True)

    def make_params(dense, target, rng):
      return upcycle(dense, target, experts=self.experts, router=self.router, rng=rng,
                     cast=self.cast)

    return build_state(ckpt, abstract_state, optimizer, make_params,
                       reuse_optimizer_state=self.reuse_optimizer_state, upcycled=True,
                       step=self.step, seed=self.seed, owner='UpcycleFromDense')

  def _from_several(self, abstract_state: TrainState, optimizer) -> TrainState:
    owner = 'UpcycleFromDense'
    if isinstance(self.experts, (str, ExpertInit)) or not callable(self.experts):
      raise ValueError(
          f'{owner}.checkpoint lists {len(self.checkpoint)} checkpoints, so {owner}.experts must '
          f'make experts from several sources: @FromCheckpoints or @Merge (gin), not '
          f'{self.experts!r}.')
    if self.reuse_optimizer_state:
      raise ValueError(f'{owner}: several source checkpoints have no one optimizer state to '
                       f'reuse. Fix: {owner}.reuse_optimizer_state = False.')
    ckpts = [checkpoints.load(path, self.format) for path in self.checkpoint]
    steps = sorted({c.step for c in ckpts}, key=lambda s: -1 if s is None else s)
    if self.step == 'keep' and len(steps) > 1:
      raise ValueError(f'{owner}: the source checkpoints are at different steps {steps}, so '
                       f"step='keep' is ambiguous. Fix: {owner}.step = 'reset' or a number.")
    init = self.experts(sources=[c.params for c in ckpts])
    if not isinstance(init, MultiSource):
      raise ValueError(f'{owner}.experts(sources=...) returned {init!r}; expected '
                       f'FromCheckpoints or Merge.')
    try:
      params, report = upcycle_from_checkpoints(init, abstract_state.params, router=self.router,
                                                rng=self.seed, cast=self.cast)
    except ValueError as e:
      raise ValueError(f'{owner}({list(self.checkpoint)}): {e}') from e
    start = _start_step(self.step, steps[0])
    _announce(owner, dataclasses.replace(ckpts[0], path=', '.join(self.checkpoint)), start,
              False, report)
    opt_state = stored_state.set_counts(optimizer.init(params), start, schedule_only=True)
    state = TrainState(jnp.asarray(start, abstract_state.step.dtype), params, opt_state)
    return jax.device_put(state, jax.tree.map(lambda x: x.sharding, abstract_state))


@dataclasses.dataclass(frozen=True)
class ContinueFromCheckpoint:
  """Initializer: the first state of a run continuing a checkpoint of the same architecture.

  Every parameter is copied from the same path (`surgery.copy_params`): a dense
  model from a dense checkpoint (continue dense training: the baseline of the
  upcycling experiments), or an MoE model from an MoE checkpoint (one written
  by `python -m upcycle.convert`, or another run's).

  Attributes:
    checkpoint: file or directory, any supported format.
    format: one of `upcycle.checkpoints.FORMATS`; None detects it.
    reuse_optimizer_state: restore the checkpoint's optimizer state (T5X
      Adafactor, our orbax optax state) as it is; False: fresh state.
    step: 'keep', 'reset' or a step number (module docstring).
    cast: cast checkpoint values to the model's parameter dtypes.
  """

  checkpoint: str
  format: Optional[str] = None
  reuse_optimizer_state: bool = True
  step: Step = 'keep'
  cast: bool = False

  def __post_init__(self):
    _check_step(self.step, 'ContinueFromCheckpoint')

  def __call__(self, abstract_state: TrainState, optimizer) -> TrainState:
    ckpt = checkpoints.load(self.checkpoint, self.format, lazy=True)

    def make_params(source, target, rng):
      del rng
      return copy_params(source, target, cast=self.cast)

    return build_state(ckpt, abstract_state, optimizer, make_params,
                       reuse_optimizer_state=self.reuse_optimizer_state, upcycled=False,
                       step=self.step, seed=0, owner='ContinueFromCheckpoint')

