"""`build_run`: everything a run computes with, built whole before any state exists.

The mesh, the optimizer (built from the model's logical axes), the state's shapes and
shardings, the jitted train and eval steps and the model FLOPs per step: what the trainer
trains with and what `upcycle.aot` compiles for a TPU topology, from one function.
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from upcycle import fields, partitioning, tree
from upcycle.optimizer_state import shardings
from upcycle.train.objectives import init_params
from upcycle.train_state import TrainState
from upcycle.train.step import make_eval_step, make_train_step


@dataclasses.dataclass(frozen=True)
class BuiltRun:
  """A run's compute, built from its objective, optimizer and config.

  Attributes:
    objective: the run's objective (model, loss).
    mesh: the ('data', 'expert', 'model') mesh.
    rules: the logical axis rules (`TrainConfig.logical_axis_rules`).
    optimizer: the optax transformation (`Optimizer.build` of the model's logical axes).
    schedule: the learning rate schedule it follows (logged).
    batch: the global batch's shapes, `{feature: jax.ShapeDtypeStruct}`.
    abstract: the `TrainState` of `jax.ShapeDtypeStruct`s with their shardings: parameters by
      their logical axes, every optimizer slot like its parameter
      (`optimizer_state.shardings.state_shardings`).
    num_microbatches: gradient accumulation steps per batch.
    eval_microbatches: microbatches the eval step adds its sums over.
    host_batch_size: this host's share of the batch.
    flops_per_step: the model's matmul FLOPs of one training step (every microbatch).
    tokens_per_step: tokens the model is fed per step, all hosts together.
  """

  objective: Any
  mesh: Mesh
  rules: partitioning.Rules
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  batch: Dict[str, jax.ShapeDtypeStruct]
  abstract: TrainState
  num_microbatches: int
  eval_microbatches: int
  host_batch_size: int
  flops_per_step: float
  tokens_per_step: int

  @property
  def shardings(self) -> TrainState:
    return jax.tree.map(lambda x: x.sharding, self.abstract)

  @functools.cached_property
  def train_step(self) -> Callable[..., Any]:
    """`(state, batch, rng) -> (state, metrics)`, jitted with the state's shardings, the state
    donated; compiled once per batch shape."""
    return self.jit_train_step()

  @functools.cached_property
  def eval_step(self) -> Callable[..., Any]:
    """`(params, batch) -> summed metrics`, jitted; `eval_microbatches` at a time."""
    return self.jit_eval_step()

  def jit_train_step(self, microbatch_unroll: int = 1) -> Callable[..., Any]:
    """A new jit of the train step, its accumulation over microbatches unrolled
    `microbatch_unroll` per loop iteration (copies for the compiler to count,
    `fit/step_count.py`)."""
    step = make_train_step(self.objective, self.optimizer, self.schedule, self.num_microbatches,
                           microbatch_unroll=microbatch_unroll)
    return jax.jit(step, in_shardings=(self.shardings, None, None),
                   out_shardings=(self.shardings, None), donate_argnums=(0,))

  def jit_eval_step(self, microbatch_unroll: int = 1) -> Callable[..., Any]:
    """A new jit of the eval step, its microbatches `microbatch_unroll` per loop iteration
    (as `jit_train_step`)."""
    return jax.jit(make_eval_step(self.objective, self.eval_microbatches,
                                  microbatch_unroll=microbatch_unroll))

  def fresh_state(self, seed: int) -> TrainState:
    """A randomly initialized state (parameters from `seed`), created sharded."""

    def init(rng):
      batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in self.batch.items()}
      params = nn.meta.unbox(init_params(self.objective, rng, batch))
      return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

    with partitioning.activate(self.mesh, self.rules):
      return jax.jit(init, out_shardings=self.shardings)(jax.random.PRNGKey(seed))


def step_flops(objective: Any, batch: Mapping[str, Any], num_microbatches: int) -> float:
  """Model matmul FLOPs of a training step on the global `batch` (shapes): each microbatch
  is one forward and backward pass, and routes as one."""
  micro = {k: jax.ShapeDtypeStruct((v.shape[0] // num_microbatches,) + tuple(v.shape[1:]),
                                   v.dtype) for k, v in batch.items()}
  return float(objective.train_flops(micro) * num_microbatches)


def _global_shapes(host_batch: Mapping[str, Any], batch_size: int
                 ) -> Dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes from a host batch: arrays, or (shape, dtype) pairs as
  pipelines' `batch_spec` gives them."""
  out = {}
  for k, v in host_batch.items():
    shape, dtype = v if isinstance(v, tuple) else (v.shape, v.dtype)
    out[k] = jax.ShapeDtypeStruct((batch_size,) + tuple(shape[1:]), dtype)
  return out


def _check_batch_split(config: Any, ways: int, over: str) -> None:
  """Refuses a batch size that cannot be split `ways` ways (over the hosts, the devices)."""
  if config.batch_size % ways:
    raise fields.ConfigError(
        f'{fields.binding(config, "batch_size")} = {config.batch_size}: expected a multiple of '
        f'{ways}, the {over} the batch is split over. Fix: --gin.BATCH_SIZE='
        f'{-(-config.batch_size // ways) * ways} (or another multiple of {ways}).')


def _abstract_state(objective: Any, optimizer_config: Any, config: Any, mesh: Mesh,
                    batch: Dict[str, jax.ShapeDtypeStruct]):
  """(the optimizer, the abstract `TrainState`), computed without allocating anything."""
  boxed = jax.eval_shape(
      lambda b: init_params(objective, jax.random.PRNGKey(config.seed), b), batch)
  sizes = partitioning.mesh_sizes(expert=fields.binding(config, 'num_expert_partitions'),
                                  model=fields.binding(config, 'num_model_partitions'))
  partitioning.check_divisible(boxed, mesh, sizes, config.logical_axis_rules)
  optimizer = optimizer_config.build(partitioning.logical_axes(boxed))
  param_shardings = partitioning.logical_sharding(boxed, mesh, config.logical_axis_rules)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree.unbox(boxed), param_shardings)
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           opt_state, shardings.state_shardings(opt_state, params, param_shardings))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
  return optimizer, TrainState(step, params, opt_state)


def build_run(*, objective: Any, optimizer: Any, config: Any, host_batch: Mapping[str, Any],
              devices: Optional[Sequence[jax.Device]] = None) -> BuiltRun:
  """The run of `objective` trained by `optimizer` (an `interfaces.Optimizer`) under `config`
  (a `TrainConfig`) over `devices` (default: all), from one host batch's shapes (arrays or
  `batch_spec` pairs of `config.batch_size / jax.process_count()` rows).

  Refuses in one line, naming the binding, a batch that the hosts or the data x expert mesh
  axes cannot split and parameters their mesh axes cannot.
  """
  _check_batch_split(config, jax.process_count(), 'hosts')
  mesh = partitioning.make_mesh(config.num_expert_partitions, config.num_model_partitions,
                                devices)
  data, expert = mesh.shape['data'], mesh.shape['expert']
  _check_batch_split(config, data * expert, f'data x expert mesh axes ({data} x {expert})')
  batch = _global_shapes(host_batch, config.batch_size)
  with partitioning.activate(mesh, config.logical_axis_rules):
    built_optimizer, abstract = _abstract_state(objective, optimizer, config, mesh, batch)
  return BuiltRun(
      objective=objective, mesh=mesh, rules=config.logical_axis_rules, optimizer=built_optimizer,
      schedule=optimizer.schedule, batch=batch, abstract=abstract,
      num_microbatches=config.num_microbatches, eval_microbatches=config.eval_microbatches,
      host_batch_size=config.batch_size // jax.process_count(),
      flops_per_step=step_flops(objective, batch, config.num_microbatches),
      tokens_per_step=objective.tokens_per_batch(batch))
