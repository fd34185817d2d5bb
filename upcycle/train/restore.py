"""The restore hook: a run's first TrainState, built from a checkpoint directly on the mesh.

The trainer calls `initializer(abstract_state, optimizer, model_config)` only when MODEL_DIR
holds no checkpoint of the run; a run that has one resumes from it in the trainer, so
upcycling happens once. `abstract_state` is a TrainState of `jax.ShapeDtypeStruct`s whose
`.sharding`s say where each array goes, `optimizer` the run's optax transformation,
`model_config` the model's (a scanned model restores unrolled checkpoints: `Layout`); the
state returned is placed with exactly those shardings.

  UpcycleFromDense        a dense checkpoint -> the MoE model (Sparse Upcycling and its
                          variants: any expert / router initializer)
  ContinueFromCheckpoint  a checkpoint of the model's own architecture -> the same model
                          (continue dense training, or load an MoE checkpoint as it is)

Both read any format `upcycle.checkpoints.load` knows (T5X, T5X-orbax, ours, HF, ViT .npz),
build the upcycling plan from shapes alone (`upcycle.upcycling.plan`: every mismatch fails
before anything is read), log its report (its summary, and every leaf in
MODEL_DIR/upcycling_report.txt: `upcycling/report_file.py`), and run it in one `jax.jit` whose
out_shardings are the abstract state's: every expert tensor is created already split over
the 'expert' mesh axis and no host holds E copies. The dense leaves are its inputs, each host
reading only the blocks its devices need (`upcycling/sharded.py`). Initializers that read
their own sources (Branch-Train-MiX, UpIT: `traceable = False`) run the plan eagerly on the
host instead, and the result is placed on the mesh. The hooks that grow a trained checkpoint,
with more experts or more layers (`grow.py`), share the executor (`plan_jit`).

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

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import checkpoints, fields, pretrained, tree
from upcycle.checkpoints import describe, orbax, paths
from upcycle.models import scan_layout
from upcycle.optimizer_state import shardings, stored
from upcycle.train.state import TrainState
from upcycle.upcycling import execute, report_file, sharded, step_policy
from upcycle.upcycling import plan as plan_lib
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.experts import Copy
from upcycle.upcycling.optimizer import carry_optimizer_state
from upcycle.upcycling.plan import Plan
from upcycle.upcycling.router_init import Normal, RouterInit
from upcycle.upcycling.sources import MultiSource, combine
from upcycle.upcycling.surgery import make_plan

log = logging.getLogger(__name__)


def _announce(owner: str, ckpt, plan: Plan, reuse: bool) -> None:
  if jax.process_index() != 0:
    return
  state = 'reused' if reuse else 'fresh'
  log.info('%s: %s (%s, step %s) -> start at step %s, %s optimizer state.', owner, ckpt.path,
           ckpt.format, ckpt.step, plan.step, state)
  for note in ckpt.notes:
    log.info('  reader: %s', note)
  report_file.show(plan.report(), log)


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
class Layout:
  """The params a plan targets, in the checkpoint's layer layout, and how the planned params
  become the model's. T5X, HF and vit_jax checkpoints hold unrolled layers (`layers_{i}`); a
  scanned model (`scan_layers=True`) is planned against its unrolled names and the result is
  stacked inside the jit (`models/scan_layout.py`)."""

  target: Any                        # abstract params (with shardings)
  to_model: Callable[[Any], Any]
  stacked: bool                      # whether to_model stacks layers


def layout(source_params: Any, abstract_params: Any, model_config: Optional[Any]) -> Layout:
  """The `Layout` of restoring `source_params` into a model of `model_config` (None: as is)."""
  if (model_config is None or not getattr(model_config, 'scan_layers', False)
      or tree.is_scanned(source_params)):
    return Layout(abstract_params, lambda params: params, stacked=False)
  return Layout(scan_layout.unstack(abstract_params, model_config),
                lambda params: scan_layout.stack(params, model_config), stacked=True)


@dataclasses.dataclass(frozen=True)
class StateJit:
  """A restore hook's one jit, its output placed with the run's shardings, and its inputs:
  `()` reads the inputs, each placed where the jit needs it, and runs it; `lower()` lowers it
  on abstract inputs without reading anything (`upcycle.aot`)."""

  jitted: Any
  sources: Mapping[str, Any]               # {path: lazy source leaf}
  placement: Mapping[str, NamedSharding]   # {path: its sharding}
  saved: Any                               # the stored optimizer state (lazy leaves) or None
  saved_shardings: Any                     # a tree like `saved`
  seed: int

  def __call__(self) -> TrainState:
    inputs = {p: sharded.read(self.sources[p], s) for p, s in self.placement.items()}
    saved = (None if self.saved is None else
             jax.tree.map(sharded.read, self.saved, self.saved_shardings))
    return self.jitted(inputs, saved, jax.random.PRNGKey(self.seed))

  def lower(self) -> jax.stages.Lowered:
    def placed(leaf, sharding):
      abstract = tree.abstract(leaf)
      return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)

    inputs = {p: placed(self.sources[p], s) for p, s in self.placement.items()}
    saved = (None if self.saved is None else
             jax.tree.map(placed, self.saved, self.saved_shardings))
    return self.jitted.lower(inputs, saved, jax.ShapeDtypeStruct((2,), jnp.uint32))


class ReadsOn:
  """A hook with `checkpoint` and `restore_dataset`: `dataset_state()` gives the trainer the
  data positions to read on from (None: the data starts from its beginning);
  `check_apart(model_dir)` refuses a run directory that would write into a source."""

  def check_apart(self, model_dir: str) -> None:
    """Refuses a MODEL_DIR inside a source checkpoint (the run would write into the source
    tree) or one whose checkpoints/ holds a source (retention would delete it)."""
    if paths.is_url(model_dir):
      return
    run = os.path.realpath(model_dir)
    steps = os.path.join(run, orbax.RUN_CHECKPOINTS)
    sources = [self.checkpoint] if isinstance(self.checkpoint, str) else list(self.checkpoint)
    for source in sources:
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

  def dataset_state(self) -> Optional[dict]:
    if not self.restore_dataset:
      return None
    owner = type(self).__name__
    if not isinstance(self.checkpoint, str):
      raise fields.ConfigError(
          f'{owner}.restore_dataset=True reads one checkpoint\'s data position; '
          f'{len(self.checkpoint)} are given. Fix: {owner}.restore_dataset = False.')
    ckpt = pretrained.load(self.checkpoint, self.format, lazy=True)
    state = orbax.dataset_state(ckpt.path) if ckpt.format == 'orbax' else None
    if state is None:
      raise fields.ConfigError(
          f'{owner}.restore_dataset=True: {ckpt.path} ({ckpt.format}) holds no data position; '
          f'only the steps of a `python -m upcycle.train` run do. Fix: {owner}.restore_dataset '
          f'= False (the data starts from its beginning).')
    return state


class OneJit(ReadsOn):
  """An initializer that is one `StateJit` (its `_jit`): calling it reads and runs the jit,
  `lower` lowers it on abstract inputs (`upcycle.aot`)."""

  def _jit(self, abstract_state: TrainState, optimizer, model_config) -> StateJit:
    raise NotImplementedError

  def __call__(self, abstract_state: TrainState, optimizer,
               model_config: Optional[Any] = None) -> TrainState:
    return self._jit(abstract_state, optimizer, model_config)()

  def lower(self, abstract_state: TrainState, optimizer,
            model_config: Optional[Any] = None) -> jax.stages.Lowered:
    """The hook's sharded jit lowered on abstract inputs (`upcycle.aot`)."""
    return self._jit(abstract_state, optimizer, model_config).lower()


def plan_jit(ckpt: checkpoints.Checkpoint, abstract_state: TrainState, optimizer, plan: Plan, *,
             target: Layout,
             reuse_optimizer_state: bool, step: step_policy.Step, seed: int,
             owner: str) -> StateJit:
  """The sharded executor of a plan: params and optimizer state made from a checkpoint in one
  jit, placed on the mesh, each source leaf read where the leaves made from it need it
  (`sharded.source_shardings`).

  Args:
    ckpt: the source checkpoint (lazy leaves).
    abstract_state: the trainer's abstract TrainState (leaves with `.sharding`).
    optimizer: the run's optax transformation.
    plan: from `ckpt.params` to `target.target` (upcycling, growth or a copy): its `step`
      starts the run, its `str` is the report.
    target: the layout the plan targets (`layout`).
    reuse_optimizer_state: fill the optimizer state from the checkpoint's.
    step: the step policy.
    seed: the rng seed of the initializers.
    owner: the hook's class name, for messages and gin bindings.
  """
  stacked = target.stacked
  placement = sharded.source_shardings(plan, tree.flatten(target.target))
  make_params = lambda source, rng: target.to_model(execute.run(plan, source, rng))
  if stacked and reuse_optimizer_state:
    raise fields.ConfigError(
        f'{owner}({ckpt.path!r}): the model is scanned (SCAN_LAYERS = True) and the checkpoint '
        f'holds unrolled layers, so its optimizer state does not fit the scanned slots. Fix: '
        f'{owner}.reuse_optimizer_state = False, or --gin.SCAN_LAYERS=False.')
  dense = tree.flatten(ckpt.params)
  dense_abstract = {p: tree.abstract(x) for p, x in dense.items()}
  saved = (stored.reusable(ckpt, f'{owner}.reuse_optimizer_state')
           if reuse_optimizer_state else None)

  def build(inputs, saved_state, rng):
    source = tree.unflatten({**dense_abstract, **inputs})
    params = make_params(source, rng)
    if saved_state is None:
      opt_state = step_policy.fresh(optimizer.init(params), plan.step)
    else:
      opt_state = stored.as_optax(saved_state, ckpt.format, source, optimizer, ckpt.path)
      opt_state = carry_optimizer_state(opt_state, plan, params, optimizer)
      opt_state = step_policy.reused(opt_state, step, plan.step)
    return TrainState(jnp.asarray(plan.step, abstract_state.step.dtype), params, opt_state)

  saved_abstract = None if saved is None else jax.tree.map(tree.abstract, saved)
  try:  # The optimizer-state conversion checks, before anything is read.
    jax.eval_shape(build, dense_abstract, saved_abstract, jax.ShapeDtypeStruct((2,), jnp.uint32))
  except ValueError as e:
    raise fields.ConfigError(f'{owner}({ckpt.path!r}, format {ckpt.format!r}): {e}') from e
  _announce(owner, ckpt, plan, reuse_optimizer_state)

  saved_shardings = None if saved is None else _saved_shardings(
      saved, dense_abstract, placement, optimizer, abstract_state.step.sharding.mesh)
  out_shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
  donate = () if abstract_state.step.sharding.mesh.devices.flat[0].platform == 'cpu' else (0,)
  return StateJit(jax.jit(build, out_shardings=out_shardings, donate_argnums=donate), dense,
                  placement, saved, saved_shardings, seed)


def _saved_shardings(saved: Any, source: Mapping[str, jax.ShapeDtypeStruct],
                     placement: Mapping[str, NamedSharding], optimizer, mesh) -> Any:
  """Where each stored optimizer-state leaf is read, a tree like `saved`.

  A leaf at the key path and of the shape of a leaf of the optimizer's state of the source
  params (every leaf of our orbax checkpoints; T5X slots of T5X Adafactor in the run's layout)
  is read like that slot (`optimizer_state/shardings.py`: along its parameter's placement);
  others (T5X slots read into optax Adafactor, or in another layout) by
  `sharded.slot_sharding`.

  Args:
    saved: the stored optimizer state (lazy leaves).
    source: {path: abstract leaf} of the source params.
    placement: {source path: sharding} of the source leaves that are read.
    optimizer: the run's optax transformation.
    mesh: the run's mesh.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  params = tree.unflatten(source)
  like = jax.eval_shape(optimizer.init, params)
  derived = shardings.state_shardings(
      like, params, tree.unflatten({p: placement.get(p, replicated) for p in source}))
  by_key = {tree.key_path(kp): (tree.shape_of(x), s) for (kp, x), s in zip(
      jax.tree_util.tree_leaves_with_path(like), jax.tree.leaves(derived))}
  placed = {p: (tree.shape_of(source[p]), s) for p, s in placement.items()}

  def where(keypath, leaf) -> NamedSharding:
    key, shape = tree.key_path(keypath), tree.shape_of(leaf)
    if key in by_key and by_key[key][0] == shape:
      return by_key[key][1]
    return sharded.slot_sharding(key, shape, placed, replicated)

  return jax.tree_util.tree_map_with_path(where, saved)


def _place(abstract_state: TrainState, state: TrainState) -> TrainState:
  return jax.device_put(state, jax.tree.map(lambda x: x.sharding, abstract_state))

@dataclasses.dataclass(frozen=True)
class UpcycleFromDense(ReadsOn):
  """Initializer: the MoE model's first state, upcycled from a dense checkpoint.

  Attributes:
    checkpoint: the dense checkpoint (file or directory, any supported format;
      a model directory means its latest step). Branch-Train-MiX / UpIT: a list
      of checkpoints, with `experts` the FromCheckpoints or Merge class (gin:
      `@FromCheckpoints`, its other arguments bound in gin); the hook calls it
      with `sources=` (`sources.combine`, as `python -m upcycle.convert` does).
      These run the surgery on the host (they are not traceable), reading the
      sources lazily, and then place the result on the mesh, so the host holds
      the MoE params at once; the optimizer state is then fresh.
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
      the report (MODEL_DIR/upcycling_report.txt).
    restore_dataset: read on from the data position saved with the checkpoint (a step of
      a `python -m upcycle.train` run; T5X's `restore_dataset`), so the new run sees none
      of the dense run's examples again; the batch size may differ if the position is a
      whole number of new batches. False: the data starts from its beginning.
  """

  checkpoint: Union[str, Sequence[str]]
  format: Optional[str] = None
  experts: Union[str, ExpertInit, Callable[..., MultiSource]] = 'copy'
  router: Union[str, RouterInit] = 'normal'
  reuse_optimizer_state: bool = False
  step: step_policy.Step = 'keep'
  seed: int = 0
  cast: bool = False
  restore_dataset: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'step', step_policy.check(self.step, 'UpcycleFromDense.step'))
    if isinstance(self.experts, MultiSource):
      raise fields.ConfigError(
          f'UpcycleFromDense.experts={self.experts!r}: pass the class instead of an instance '
          f'(gin: experts = @FromCheckpoints, without parentheses) and the source paths as '
          f'UpcycleFromDense.checkpoint = [...]; the hook reads them and calls it with sources=.')

  def __call__(self, abstract_state: TrainState, optimizer,
               model_config: Optional[Any] = None) -> TrainState:
    owner = 'UpcycleFromDense'
    ckpt, dense, target, plan = self._plan(abstract_state, owner, model_config)
    if plan.experts.traceable:
      return plan_jit(ckpt, abstract_state, optimizer, plan, target=target,
                      reuse_optimizer_state=self.reuse_optimizer_state,
                      step=self.step, seed=self.seed, owner=owner)()
    # The eager executor: the initializer reads its own sources on the host.
    _announce(owner, ckpt, plan, False)
    params = target.to_model(execute.run(plan, dense, jax.random.PRNGKey(self.seed)))
    opt_state = step_policy.fresh(optimizer.init(params), plan.step)
    return _place(abstract_state, TrainState(
        jnp.asarray(plan.step, abstract_state.step.dtype), params, opt_state))

  def lower(self, abstract_state: TrainState, optimizer,
            model_config: Optional[Any] = None) -> jax.stages.Lowered:
    """The hook's sharded jit lowered on abstract inputs: only the checkpoint's metadata is
    read (`upcycle.aot`)."""
    owner = 'UpcycleFromDense'
    ckpt, _, target, plan = self._plan(abstract_state, owner, model_config)
    if not plan.experts.traceable:
      raise fields.ConfigError(f'{owner}: experts from several checkpoints are made on the '
                               f'host, not in one sharded jit; there is nothing to compile.')
    return plan_jit(ckpt, abstract_state, optimizer, plan, target=target,
                    reuse_optimizer_state=self.reuse_optimizer_state,
                    step=self.step, seed=self.seed, owner=owner).lower()

  def _plan(self, abstract_state: TrainState, owner: str, model_config: Optional[Any]):
    """(checkpoint, dense params, target layout, plan to the MoE params)."""
    several = not isinstance(self.checkpoint, str)
    ckpt, dense, experts = (self._several(owner) if several else self._one(owner))
    where = repr(list(self.checkpoint)) if several else f'{ckpt.path!r}, format {ckpt.format!r}'
    target = layout(dense, abstract_state.params, model_config)
    layers = (model_config.moe_positions() if hasattr(model_config, 'moe_positions')
              else None)   # the MoE blocks' places, for Drop's ramp (None: from the names)
    plan = _plan(owner, where, lambda: make_plan(
        dense, target.target, experts=experts, router=self.router, cast=self.cast,
        step=step_policy.start(self.step, ckpt.step), layers=layers),
                 source=dense, target=target.target, upcycling=True,
                 binding=fields.binding(self, 'checkpoint'))
    return ckpt, dense, target, plan

  def _one(self, owner: str):
    """(checkpoint, dense params, initializer) for one dense checkpoint."""
    if not isinstance(self.experts, (str, ExpertInit)):
      raise fields.ConfigError(
          f'{owner}.experts={self.experts!r} is neither an initializer name nor an '
          f'ExpertInit instance. A class (gin: @sources.FromCheckpoints, no parentheses) takes '
          f'several source checkpoints: {owner}.checkpoint = [path, path, ...]; any '
          f'other initializer needs parentheses (gin: @experts.Drop()).')
    ckpt = pretrained.load(self.checkpoint, self.format, lazy=True)
    return ckpt, ckpt.params, self.experts

  def _several(self, owner: str):
    """(first checkpoint, shared params, initializer) for Branch-Train-MiX / UpIT sources."""
    if isinstance(self.experts, (str, ExpertInit)) or not callable(self.experts):
      raise fields.ConfigError(
          f'{owner}.checkpoint lists {len(self.checkpoint)} checkpoints, so {owner}.experts must '
          f'make experts from several sources: @FromCheckpoints or @Merge (gin), not '
          f'{self.experts!r}.')
    if self.reuse_optimizer_state:
      raise fields.ConfigError(f'{owner}: several source checkpoints have no one optimizer '
                               f'state to reuse. Fix: {owner}.reuse_optimizer_state = False.')
    ckpts = [pretrained.load(path, self.format, lazy=True) for path in self.checkpoint]
    try:
      ckpt, init = combine(ckpts, self.experts, step=self.step, names={
          'step': f'{owner}.step', 'experts': f'{owner}.experts'})
    except ValueError as e:
      raise fields.ConfigError(f'{owner}: {e}') from None
    return ckpt, init.shared_params(), init


@dataclasses.dataclass(frozen=True)
class ContinueFromCheckpoint(OneJit):
  """Initializer: the first state of a run continuing a checkpoint of the same architecture.

  Every parameter is copied from the same path (a plan with `upcycling=False`, as `copy_params`): a dense
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
    restore_dataset: read on from the checkpoint's data position (`UpcycleFromDense`).
  """

  checkpoint: str
  format: Optional[str] = None
  reuse_optimizer_state: bool = True
  step: step_policy.Step = 'keep'
  cast: bool = False
  restore_dataset: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'step', step_policy.check(self.step, 'ContinueFromCheckpoint.step'))

  def _jit(self, abstract_state: TrainState, optimizer, model_config) -> StateJit:
    owner = 'ContinueFromCheckpoint'
    ckpt = pretrained.load(self.checkpoint, self.format, lazy=True)
    target = layout(ckpt.params, abstract_state.params, model_config)
    plan = _plan(owner, f'{ckpt.path!r}, format {ckpt.format!r}', lambda: plan_lib.make(
        ckpt.params, target.target, Copy(), Normal(), cast=self.cast,
        step=step_policy.start(self.step, ckpt.step), upcycling=False),
                 source=ckpt.params, target=target.target, upcycling=False,
                 binding=fields.binding(self, 'checkpoint'))
    return plan_jit(ckpt, abstract_state, optimizer, plan, target=target,
                    reuse_optimizer_state=self.reuse_optimizer_state,
                    step=self.step, seed=0, owner=owner)
