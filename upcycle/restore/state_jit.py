"""The restore hook's one jit: a plan run on the mesh, its output placed with the run's shardings.

`jit_plan` makes params and optimizer state from a checkpoint's lazy leaves inside one
`jax.jit` whose out_shardings are the abstract state's: every expert tensor is created already
split over the 'expert' mesh axis and no host holds E copies; each dense leaf is an input, read
by each host only in the blocks its devices need (`upcycling/sharded.py`). What the jit's
inputs are is its one varying part (`Inputs`): the source leaves the plan runs on inside the
jit (`traced`), or, for initializers that read their own sources (Branch-Train-MiX, UpIT:
`traceable = False`), the params the plan made eagerly on the host (`on_host`), which the jit
places. Either way the hook's work is one `StateJit`, which `upcycle.aot` lowers on abstract
inputs without reading anything.
"""

import contextlib
import dataclasses
import functools
import logging
import warnings
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import checkpoints, fields, tree
from upcycle.models import scan_layout
from upcycle.optimizer_state import counts, shardings, stored
from upcycle.optimizer_state.carry import carry_optimizer_state
from upcycle.train_state import TrainState
from upcycle.upcycling import execute, report_file, sharded
from upcycle.upcycling.plan import Plan

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


@dataclasses.dataclass(frozen=True)
class Layout:
  """The params a plan reads and targets, both in unrolled layers unless the checkpoint is
  stored exactly as the model holds it, and how the planned params become the model's.

  T5X, HF and vit_jax checkpoints hold unrolled layers (`layers_{i}`); a run trained with
  `scan_layers=True` holds `layers/subblock_{j}`, one sub-block per layer of its own placement's
  period (a dense stack: period 1; an MoE every other layer: period 2). A scanned source of
  another structure than the model's (a scanned dense run upcycled, or grown) is read unrolled
  (`tree.unroll_scanned`, each layer a lazy slice); a scanned model is planned against its
  unrolled names and the result is stacked inside the jit (`models/scan_layout.py`). A scanned
  source whose leaves are the model's, path for path and shape for shape (a scanned run
  continued), is planned as stored, so its optimizer state fits as it is."""

  source: Any                        # the checkpoint's params as the plan reads them
  target: Any                        # abstract params (with shardings)
  to_model: Callable[[Any], Any]
  stacked: bool                      # whether to_model stacks layers
  unrolled_source: bool              # whether `source` is a scanned checkpoint unrolled


def _same_leaves(source_params: Any, abstract_params: Any) -> bool:
  source, target = tree.flatten(source_params), tree.flatten(abstract_params)
  return source.keys() == target.keys() and all(
      tree.shape_of(source[p]) == tree.shape_of(target[p]) for p in source)


def layout(source_params: Any, abstract_params: Any, model_config: Optional[Any]) -> Layout:
  """The `Layout` of restoring `source_params` into a model of `model_config` (None: as is)."""
  unrolled_source = (tree.is_scanned(source_params)
                     and not _same_leaves(source_params, abstract_params))
  source = tree.unroll_scanned(source_params) if unrolled_source else source_params
  if (model_config is None or not getattr(model_config, 'scan_layers', False)
      or (tree.is_scanned(source_params) and not unrolled_source)):
    return Layout(source, abstract_params, lambda params: params, stacked=False,
                  unrolled_source=unrolled_source)
  return Layout(source, scan_layout.unstack(abstract_params, model_config),
                lambda params: scan_layout.stack(params, model_config), stacked=True,
                unrolled_source=unrolled_source)


@dataclasses.dataclass(frozen=True)
class StateJit:
  """A restore hook's one jit and how to feed it: `()` reads the inputs, each placed where the
  jit needs it, and runs it; `lower()` lowers it on the inputs' abstract values (with their
  shardings) without reading anything (`upcycle.aot`)."""

  jitted: Any                              # (inputs, saved optimizer state, rng) -> TrainState
  read: Callable[[], Tuple[Any, Any]]      # () -> (inputs, saved), placed
  abstract: Tuple[Any, Any]                # (inputs, saved) as jax.ShapeDtypeStruct
  seed: int

  def __call__(self) -> TrainState:
    inputs, saved = self.read()
    with _unaliased_donations_expected():
      return self.jitted(inputs, saved, jax.random.PRNGKey(self.seed))

  def lower(self) -> jax.stages.Lowered:
    with _unaliased_donations_expected():
      return self.jitted.lower(*self.abstract, jax.ShapeDtypeStruct((2,), jnp.uint32))


@contextlib.contextmanager
def _unaliased_donations_expected():
  """Lowering without JAX's 'Some donated buffers were not usable' warning: the jit donates
  its inputs so that a leaf copied as it is reuses its buffer, and the inputs no output
  matches (a dense leaf made into experts, a source leaf of another layout) are not aliased,
  as expected: they are freed when the jit returns."""
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
    yield


def _placed(leaf: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  abstract = tree.abstract(leaf)
  return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)


def _out_shardings(abstract_state: TrainState) -> Tuple[Any, Tuple[int, ...]]:
  """The jit's out_shardings, and what it donates (its inputs, except on CPU)."""
  donate = () if abstract_state.step.sharding.mesh.devices.flat[0].platform == 'cpu' else (0,)
  return jax.tree.map(lambda x: x.sharding, abstract_state), donate


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The params' part of the jit's inputs: how they are read (placed), their abstract values,
  and the params the jit makes of them."""

  read: Callable[[], Any]                  # () -> inputs, placed
  abstract: Any                            # the inputs as jax.ShapeDtypeStruct (sharded)
  params: Callable[[Any, jax.Array], Any]  # (inputs, rng) -> params, traceable
  source: Mapping[str, jax.ShapeDtypeStruct]   # {path: abstract} of the source params
  placement: Mapping[str, NamedSharding]       # {source path: sharding} of those read


def traced(plan: Plan, target: Layout, abstract_params: Any) -> Inputs:
  """Inputs of a traceable plan: the source leaves it reads, each placed where the leaves made
  from it need it (`sharded.source_shardings`); the plan runs inside the jit."""
  placement = sharded.source_shardings(plan, tree.flatten(abstract_params))
  dense = tree.flatten(target.source)
  source = {p: tree.abstract(x) for p, x in dense.items()}
  read = {p: dense[p] for p in placement}
  return Inputs(
      read=functools.partial(jax.tree.map, sharded.read, read, placement),
      abstract=jax.tree.map(_placed, read, placement),
      params=lambda inputs, rng: target.to_model(
          execute.run(plan, tree.unflatten({**source, **inputs}), rng)),
      source=source, placement=placement)


def on_host(plan: Plan, target: Layout, abstract_params: Any, seed: int) -> Inputs:
  """Inputs of a plan whose initializer reads its own sources (not traceable): the params,
  made on the host when read and placed with the run's shardings."""
  param_shardings = jax.tree.map(lambda x: x.sharding, abstract_params)

  def read():
    params = target.to_model(execute.run(plan, target.source, jax.random.PRNGKey(seed)))
    return jax.device_put(params, param_shardings)

  return Inputs(read=read, abstract=abstract_params, params=lambda inputs, rng: inputs,
                source={}, placement={})


def jit_plan(ckpt: checkpoints.Checkpoint, abstract_state: TrainState, optimizer, plan: Plan,
              *, target: Layout, reuse_optimizer_state: bool, step: counts.Step, seed: int,
              owner: str) -> StateJit:
  """The executor of a plan: params and optimizer state made from a checkpoint in one jit,
  placed on the mesh (`traced` or, for initializers that are not traceable, `on_host` inputs).

  Args:
    ckpt: the source checkpoint (lazy leaves; several sources: the one standing for them).
    abstract_state: the trainer's abstract TrainState (leaves with `.sharding`).
    optimizer: the run's optax transformation.
    plan: from `target.source` to `target.target` (upcycling, growth or a copy): its `step`
      starts the run, its `str` is the report.
    target: the layout: the params the plan reads and those it targets (`layout`).
    reuse_optimizer_state: fill the optimizer state from the checkpoint's.
    step: the step policy.
    seed: the rng seed of the initializers.
    owner: the hook's class name, for messages and gin bindings.
  """
  if reuse_optimizer_state and (target.stacked or target.unrolled_source):
    held = ('scanned layers of another structure than this model\'s (a run trained with '
            'SCAN_LAYERS = True)' if target.unrolled_source else 'unrolled layers')
    unroll = '' if target.unrolled_source else ', or --gin.SCAN_LAYERS=False'
    raise fields.ConfigError(
        f'{owner}({ckpt.path!r}): the checkpoint holds {held} and the model is '
        f'{"scanned" if target.stacked else "unrolled"} (SCAN_LAYERS = {target.stacked}), so '
        f'its optimizer state does not fit this model\'s slots. Fix: {owner}.'
        f'reuse_optimizer_state = False{unroll}.')
  inputs = (traced(plan, target, target.target) if plan.experts is None or plan.experts.traceable
            else on_host(plan, target, abstract_state.params, seed))
  saved = (stored.reusable(ckpt, f'{owner}.reuse_optimizer_state')
           if reuse_optimizer_state else None)

  def build(params_inputs, saved_state, rng):
    params = inputs.params(params_inputs, rng)
    if saved_state is None:
      opt_state = counts.fresh(optimizer.init(params), plan.step)
    else:
      opt_state = stored.as_optax(saved_state, ckpt.optimizer_layout, tree.unflatten(inputs.source),
                                  optimizer, ckpt.path)
      opt_state = carry_optimizer_state(opt_state, plan, params, optimizer)
      opt_state = counts.reused(opt_state, step, plan.step)
    return TrainState(jnp.asarray(plan.step, abstract_state.step.dtype), params, opt_state)

  saved_abstract = None if saved is None else jax.tree.map(tree.abstract, saved)
  try:  # The optimizer-state conversion checks, before anything is read.
    jax.eval_shape(build, inputs.abstract, saved_abstract, jax.ShapeDtypeStruct((2,), jnp.uint32))
  except ValueError as e:
    raise fields.ConfigError(f'{owner}({ckpt.path!r}, format {ckpt.format!r}): {e}') from e
  _announce(owner, ckpt, plan, reuse_optimizer_state)

  replicated = NamedSharding(abstract_state.step.sharding.mesh, PartitionSpec())
  saved_shardings = None if saved is None else shardings.stored_shardings(
      saved, tree.unflatten(inputs.source),
      tree.unflatten(dict.fromkeys(inputs.source, replicated) | dict(inputs.placement)),
      optimizer)
  out_shardings, donate = _out_shardings(abstract_state)

  def read():
    return inputs.read(), (None if saved is None else
                           jax.tree.map(sharded.read, saved, saved_shardings))

  abstract = (inputs.abstract,
              None if saved is None else jax.tree.map(_placed, saved, saved_shardings))
  return StateJit(jax.jit(build, out_shardings=out_shardings, donate_argnums=donate), read,
                  abstract, seed)
