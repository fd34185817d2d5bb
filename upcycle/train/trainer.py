"""The training loop: sharded jit steps, checkpoints with the data position, metrics, eval.

A run is a pure function of its configuration and seed: dropout/jitter rngs are
folded from the step number, the data order from the seed and the iterator
position, so a run killed at any moment and restarted from its last checkpoint
reproduces the uninterrupted run exactly.
"""

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import fields, partitioning, pretrained
from upcycle.checkpoints import paths, t5x_export
from upcycle.checkpoints.orbax import RUN_CHECKPOINTS, CheckpointManager
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.optimizer_state import counts
from upcycle.train import (cadence, evaluation, host_states, preemption, resume,
                           routing_health, run_lock, stall, startup)
from upcycle.train import step as step_lib
from upcycle.train.built_run import build_run
from upcycle.train.host_data import HostData
from upcycle.train.interfaces import Initializer, Objective, Optimizer
from upcycle.train.logger import MetricLogger
from upcycle.train_state import TrainState
from upcycle.upcycling import report_file

log = logging.getLogger(__name__)

CHECKPOINT_DIR = RUN_CHECKPOINTS
T5X_DIR = 't5x'
# Other processes wait this long for process 0's T5X export (a large MoE takes a while).
EXPORT_TIMEOUT_SECONDS = 24 * 3600


class NonFiniteLossError(RuntimeError):
  pass


def _non_finite_message(step: int, *, start: int, resumed: bool, last: Optional[int],
                        directory: str) -> str:
  """What NonFiniteLossError says when the loss or gradients of a run that started at step
  `start` (`resumed`: from its own step `start` in `directory`) are not finite by `step`: the
  step a restart resumes from (`last`, the latest saved; None: none yet), or, at the first step
  after resuming, the values restored (a restart would resume from them again)."""
  if resumed and step == start + 1 and last == start:
    return (f'The training loss or gradients became NaN or infinite at step {step}, the first '
            f'step after resuming from step {start} in {directory}; stopped without saving. '
            f'The values restored from step {start} may be the cause, and a restart would '
            f'resume from them again. Fix: move step {start} aside (a restart then resumes from '
            f'an earlier step); else lower the learning rate or check the data.')
  where = (f'the last good checkpoint is step {last} in {directory}; a restart resumes from it'
           if last is not None else
           f'no checkpoint has been written yet, so a restart starts this run over from step '
           f'{start}')
  return (f'The training loss or gradients became NaN or infinite by step {step}. Stopped '
          f'without saving; {where}. Lower the learning rate or check the data first.')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How long, how big, how often.

  Attributes:
    model_dir: where checkpoints (model_dir/checkpoints), metrics.jsonl,
      TensorBoard files and the operative gin config go.
    train_steps: the global step to stop at (an upcycled run continuing a dense
      run at step S trains train_steps - S steps).
    batch_size: global batch size (all hosts together).
    seed: parameter init, dropout and data order.
    log_every / checkpoint_every / eval_every: in steps (eval_every 0: at the end only).
    eval_batches: batches per evaluation (0: the whole validation split).
    cache_eval_batches: keep this host's validation batches in host memory after the first
      evaluation and evaluate on them again (the split is read in the same order with the same
      seed every time, so the numbers are those of re-reading it); False re-reads the pipeline
      for every evaluation (for a split too large for host memory: eval_batches x host batch
      of token ids or images).
    keep_checkpoints: how many recent checkpoints stay on disk; None: every one (T5X's
      `SaveCheckpointConfig.keep` default).
    num_microbatches: gradient accumulation steps per batch.
    eval_microbatches: the eval step evaluates each batch in this many microbatches, one at a
      time, and adds their sums (the numbers do not change; a device holds a microbatch's
      activations and logits, not the whole batch's: MaxText's eval_per_device_batch_size).
      Set it to num_microbatches where the train step needs microbatches to fit.
    num_expert_partitions / num_model_partitions: mesh shape; data = rest.
    logical_axis_rules: where each logical axis lives on the mesh: 'default' (parameters
      replicated over 'data'), 'fsdp' (parameters and optimizer state also split over
      the data-parallel devices, 'data' x 'expert', along d_model), or a list of (logical axis, mesh
      axes) pairs (`partitioning.RULE_SETS`; T5X's `logical_axis_rules`).
    async_checkpoints: write checkpoints in the background.
    eval_at_start: evaluate the initial state before the first step of a new run
      (e.g. the upcycled model at step 0, to compare with the dense model).
    data_shards: how many shards the training data is read in (0: one per host); each host
      reads its own shards, so with the same number the examples of every step do not depend
      on the number of hosts (a multiple of it).
    tensorboard: write TensorBoard event files (MODEL_DIR/tensorboard/).
    stall_warning_steps: warn (console and metrics.jsonl) when the loss or the gradient
      norm has stayed exactly the same for this many consecutive steps, a sign of a
      degenerate run (e.g. a learning rate so large that every gradient is 0); a value of
      exactly 0 warns after 3 steps already (`stall.ZERO_STEPS`); 0: never.
    on_optimizer_mismatch: resuming a checkpoint whose optimizer state is not the one this
      config's optimizer makes (another optimizer, momentum on or off): 'stop' (with the
      first differing slot; nothing is changed) or 'fresh' (restore parameters, step and data
      position and start the optimizer state fresh at that step, said loudly). A state that
      fits is always restored.
    infer_eval: at every evaluation, also decode the run's decode data (`Trainer`'s
      `decode_data`: a T5 task split, unpacked) and report sequence accuracy and the task's
      own metrics (`predictions.decoded_metrics`, as `python -m upcycle.eval` does) as
      split 'infer_eval' (T5X's `infer_eval_dataset_cfg`).
    infer_eval_batches: batches (of `batch_size`) decoded at each inference evaluation
      (0: the whole split).
    export_t5x: at the end of the run, also write its final step in T5X's native layout to
      MODEL_DIR/t5x/checkpoint_<step>/ (`upcycle.export`: with the optimizer slots for
      `optimizers.T5XAdafactor`, else parameters only); a local MODEL_DIR only. A restarted
      finished run writes it if it is missing.

  Every field is checked at construction (types and ranges), so a wrong gin binding fails
  before any work, naming the binding.
  """

  model_dir: str
  train_steps: int
  batch_size: int
  seed: int = 0
  log_every: int = 10
  checkpoint_every: int = 100
  eval_every: int = 0
  eval_batches: int = 0
  cache_eval_batches: bool = True
  keep_checkpoints: Optional[int] = 3
  num_microbatches: int = 1
  eval_microbatches: int = 1
  num_expert_partitions: int = 1
  num_model_partitions: int = 1
  logical_axis_rules: Any = 'default'
  async_checkpoints: bool = True
  eval_at_start: bool = False
  stall_warning_steps: int = 50
  data_shards: int = 0
  tensorboard: bool = True
  on_optimizer_mismatch: str = 'stop'
  infer_eval: bool = False
  infer_eval_batches: int = 16
  export_t5x: bool = False

  def __post_init__(self):
    fields.string(self, 'model_dir')
    fields.directory(fields.binding(self, 'model_dir'), self.model_dir)
    fields.integer(self, 'train_steps', 0)
    fields.integer(self, 'batch_size', 1)
    fields.integer(self, 'seed')
    fields.optional_integer(self, 'keep_checkpoints', 1, none='every checkpoint is kept')
    for name in ('log_every', 'checkpoint_every', 'num_microbatches', 'eval_microbatches',
                 'num_expert_partitions', 'num_model_partitions'):
      fields.integer(self, name, 1)
    for name in ('num_microbatches', 'eval_microbatches'):
      fields.divisor_value(fields.binding(self, name), getattr(self, name),
                           total=self.batch_size, of='BATCH_SIZE')
    for name in ('eval_every', 'eval_batches', 'stall_warning_steps', 'data_shards',
                 'infer_eval_batches'):
      fields.integer(self, name, 0)
    fields.boolean(self, 'async_checkpoints')
    fields.boolean(self, 'eval_at_start')
    fields.boolean(self, 'cache_eval_batches')
    fields.boolean(self, 'tensorboard')
    fields.boolean(self, 'export_t5x')
    fields.boolean(self, 'infer_eval')
    fields.choice(self, 'on_optimizer_mismatch', ('stop', 'fresh'))
    object.__setattr__(self, 'logical_axis_rules', partitioning.rules(
        self.logical_axis_rules, fields.binding(self, 'logical_axis_rules')))
    if self.export_t5x and paths.is_url(self.model_dir):
      raise fields.ConfigError(
          f'{fields.binding(self, "export_t5x")} = True with model_dir={self.model_dir}: the '
          f'T5X writer writes local directories. Set it False and run python -m upcycle.export '
          f'into a local directory after the run.')


class Trainer:
  """Trains one run: its `BuiltRun` (mesh, optimizer, shardings, jitted steps, built at
  construction by `built_run.build_run`), its data, evaluation and checkpoints."""

  def __init__(self, objective: Objective, optimizer: Optimizer, config: TrainConfig,
               train_data, eval_data=None, initializer: Optional[Initializer] = None,
               devices: Optional[List[jax.Device]] = None, decode_data=None,
               decoding: Optional[Any] = None):
    """`decode_data` and `decoding` (a `decoding.DecodeConfig`; None: greedy): what
    `config.infer_eval` decodes at every evaluation."""
    self.config, self.train_data, self.eval_data = config, train_data, eval_data
    self.initializer = initializer
    if config.infer_eval and (decode_data is None or eval_data is None):
      raise fields.ConfigError(
          f'{fields.binding(config, "infer_eval")} = True, and the run has no '
          f'{"evaluation data" if eval_data is None else "decode data"} '
          f'(train_script.train.{"eval_data" if eval_data is None else "decode_data"}). Fix: '
          f'bind it (runs/pretrain.gin binds both for T5 tasks), or INFER_EVAL = False.')
    self.decode_data, self.decoding = decode_data, decoding
    self.built = build_run(objective=objective, optimizer=optimizer, config=config,
                           host_batch=self._host_data().example(), devices=devices)
    self._eval_batches: Optional[List[Dict[str, np.ndarray]]] = None   # cache_eval_batches
    model_config = objective.model.config
    self._moe_layers = step_lib.router_kernels(self.built.abstract.params, model_config)
    self._spread = jax.jit(lambda p: routing_health.expert_spread(p, model_config))

  def _host_data(self) -> HostData:
    """This host's batches of the training data, from its beginning."""
    cfg = self.config
    return HostData(self.train_data, global_batch_size=cfg.batch_size, seed=cfg.seed,
                    num_shards=cfg.data_shards)

  def infer_evaluate(self, params) -> Dict[str, Any]:
    """Sequence accuracy and the task's metrics of `decode_data`'s decodes
    (`config.infer_eval`)."""
    from upcycle import decoding, predictions  # pylint: disable=g-import-not-at-top
    cfg, built = self.config, self.built
    return predictions.decoded_metrics(
        built.objective, params, self.decode_data, self.decoding or decoding.DecodeConfig(),
        batch_size=cfg.batch_size, mesh=built.mesh, max_batches=cfg.infer_eval_batches,
        seed=cfg.seed)

  def _validation_batches(self) -> Iterable[Dict[str, np.ndarray]]:
    """This host's validation batches (`evaluation.host_batches`): read once and kept
    (`cache_eval_batches`), else read again at each call."""
    cfg, built = self.config, self.built
    batches = lambda: evaluation.host_batches(self.eval_data, built.host_batch_size,
                                              cfg.eval_batches, cfg.seed)
    if not cfg.cache_eval_batches:
      return batches()
    if self._eval_batches is None:
      self._eval_batches = list(batches())
    return self._eval_batches

  def evaluate(self, params) -> Dict[str, float]:
    """Loss and accuracy over the validation split (or `eval_batches` of it)."""
    built = self.built
    return evaluation.evaluate(built.eval_step, params, self.eval_data,
                               batch_size=built.host_batch_size, mesh=built.mesh,
                               batches=self._validation_batches())

  def _compile_eval_step(self, params) -> None:
    """Compiles the eval step for `params` and the validation batches before the first step,
    as T5X's trainer compiles its eval steps before training: an eval step that does not
    compile (a validation batch that does not fit in device memory, see `eval_microbatches`,
    or does not fit the model) stops the run at its start, not at its first evaluation. The
    evaluations run the program compiled here."""
    first = next(iter(self._validation_batches()), None)
    if first is None:
      return    # evaluate() says that the validation data gave no example
    try:
      self.built.eval_step.lower(params, evaluation.global_batch(first, self.built.mesh)).compile()
    except (TypeError, ValueError) as e:   # the model refuses the batch's shapes
      raise fields.ConfigError(
          f'The validation data (train_script.train.eval_data) does not fit the model: {e}'
      ) from e

  def _export_t5x(self, checkpoint_dir: str, step: int) -> None:
    """Writes MODEL_DIR/t5x/checkpoint_<step> from the saved `step` (process 0; the others
    wait for it); an existing export (a restarted finished run) is kept."""
    if jax.process_index() == 0:
      try:
        t5x_export.export(checkpoint_dir, os.path.join(self.config.model_dir, T5X_DIR), step=step)
      except t5x_export.AlreadyExported as e:
        log.info('T5X export kept: %s', e)
    host_states.wait_for_all_hosts('t5x export', EXPORT_TIMEOUT_SECONDS)

  def run(self, on_start: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Trains to `train_steps`, holding MODEL_DIR (run_lock.py) for the whole run.

    `on_start()` is called once the state is restored or initialized, before the first step
    (the entry point writes MODEL_DIR/config.gin then, so a failed start leaves it as it was).

    Returns {'history': logged train metrics, 'eval': final evaluation,
    'initial_eval': evaluation before the first step (eval_at_start), 'start_step',
    'state': the final TrainState, 'checkpoint': the directory of the latest saved step, None
    if none was (a new run that starts at `train_steps`), 'routing_health': an MoE run's
    routing-health row (`routing_health`; None for a dense model, or on processes other
    than 0)}.
    """
    cfg = self.config
    getattr(self.initializer, 'check_apart', lambda model_dir: None)(cfg.model_dir)
    with (run_lock.hold(cfg.model_dir),
          partitioning.activate(self.built.mesh, self.built.rules)):
      return self._run(cfg, on_start or (lambda: None))

  def _initial_state(self, manager: CheckpointManager, data: HostData
                     ) -> Tuple[TrainState, bool]:
    """(the state to train from, whether it was resumed): MODEL_DIR's latest good checkpoint
    (the data position set from it), else the initializer's state, else a random one."""
    built = self.built
    host_states.wait_for_all_hosts('restore')
    restored = resume.restore(manager, built.abstract, model_dir=self.config.model_dir,
                              on_optimizer_mismatch=self.config.on_optimizer_mismatch,
                              with_dataset=bool(data.get_state()))
    if restored is None:
      if self.initializer is None:
        return built.fresh_state(self.config.seed), False
      with report_file.kept_in(self.config.model_dir):   # the hook's report, every leaf
        state = self.initializer(built.abstract, built.optimizer,
                                 built.objective.model.config)
      positions = getattr(self.initializer, 'dataset_state', lambda: None)()
      if positions is not None:    # restore_dataset: read on where the source run stopped
        flag = fields.binding(self.initializer, 'restore_dataset')
        try:
          data.continue_stream(host_states.mine(positions, data.shards))
        except ValueError as e:
          raise fields.ConfigError(f'{flag}=True: {e} Or read the data from its beginning: '
                                   f'{flag} = False.') from e
        log.info('Reading the data on from the initial checkpoint\'s position: %s',
                 data.describe_position())
      host_states.wait_for_all_hosts('initialized')
      return state, False
    opt_state = restored.optimizer_state
    if opt_state is None:
      log.warning('The optimizer state of step %s does not fit this config\'s optimizer; it '
                  'starts fresh at that step (on_optimizer_mismatch=\'fresh\').', restored.step)
      opt_state = jax.jit(lambda p: counts.fresh(built.optimizer.init(p), restored.step),
                          out_shardings=built.shardings.opt_state)(restored.params)
    if restored.dataset_state is not None:
      try:
        data.set_state(host_states.mine(restored.dataset_state, data.shards))
      except ValueError as e:   # another seed, batch size or pipeline than the run's
        raise fields.ConfigError(f'{manager.directory}, step {restored.step}: {e}') from e
    log.info('Resuming from %s at step %s.', manager.directory, restored.step)
    step = jax.device_put(jnp.asarray(restored.step, jnp.int32), built.shardings.step)
    return TrainState(step, restored.params, opt_state), True

  def _check_tokenizer(self, manager: CheckpointManager) -> None:
    """Refuses (`tokenizer.TokenizerError`, one line) a tokenizer whose ids exceed the model's
    embedding, or that is not the one of the weights the run starts from: its own latest step
    when it resumes, else the initializer's checkpoints. Data without a tokenizer passes."""
    found = pretrained.data_tokenizer(self.train_data, self.built.objective.model.config)
    if found is None:
      return
    tok, binding = found
    latest = manager.latest_step()
    if latest is not None:
      pretrained.check_trained(
          tok, os.path.join(manager.directory, str(latest)), binding=binding, format='orbax',
          fix=f'resume with the tokenizer the run was trained with (TOKENIZER in '
          f'{self.config.model_dir}/config.gin), or train in a new MODEL_DIR.')
    else:
      getattr(self.initializer, 'check_tokenizer', lambda tok, binding: None)(tok, binding)

  def _run(self, cfg: TrainConfig, on_start: Callable[[], None]) -> Dict[str, Any]:
    built, data = self.built, self._host_data()
    watch = stall.Watch(('loss', 'grad_norm'), cfg.stall_warning_steps)
    manager = CheckpointManager(os.path.join(cfg.model_dir, CHECKPOINT_DIR),
                                keep=cfg.keep_checkpoints, async_save=cfg.async_checkpoints)
    try:
      self._check_tokenizer(manager)   # refused before anything says the run starts
      log.info(startup.summary(built.abstract.params, built.mesh,
                               os.path.join(cfg.model_dir, CHECKPOINT_DIR)))
      state, resumed = self._initial_state(manager, data)
      start = int(jax.device_get(state.step))
      if resumed and start > cfg.train_steps:   # before on_start: config.gin stays the run's
        raise fields.ConfigError(
            f'{manager.directory} is at step {start}, past TRAIN_STEPS = {cfg.train_steps} '
            f'(trainer.TrainConfig.train_steps): a run never goes back, so there is nothing to '
            f'train. Fix: --gin.TRAIN_STEPS={start} or more to evaluate or train on, or '
            f'another MODEL_DIR.')
      if self.eval_data is not None and start < cfg.train_steps:
        self._compile_eval_step(state.params)
      on_start()
      # Rows past the resumed step are from the stopped run's steps that are now redone.
      logger = MetricLogger(cfg.model_dir, cfg.train_steps, built.tokens_per_step,
                            tensorboard=cfg.tensorboard, resume_step=start if resumed else None)
    except BaseException:
      manager.close()   # else its background thread outlives the interpreter, with a traceback
      raise
    rng = jax.random.PRNGKey(cfg.seed + 1)
    history: List[Dict[str, float]] = []
    finite = jnp.array(True)
    eval_results, initial_eval = {}, {}
    saved = None   # the last step saved

    def checked(step: int) -> None:
      if not bool(jax.device_get(finite)):
        manager.wait()
        raise NonFiniteLossError(_non_finite_message(
            step, start=start, resumed=resumed, last=manager.latest_step(),
            directory=manager.directory))

    # The first row this attempt logs carries the expert spread of the params it starts from
    # (a new run's first row: of those it was initialized or upcycled to).
    at_start = {} if start >= cfg.train_steps else {
        f'moe/{layer}/expert_spread': v for layer, v in self._expert_spread(state.params).items()}

    def log_metrics(step, state, metrics):
      checked(step)
      logged = {**jax.device_get(metrics), 'train_flops_per_step': built.flops_per_step,
                **(at_start if step == start + 1 else {})}
      history.append({'step': step, **logger.write(step, logged)})
      for message, details in watch.warnings(step):
        logger.warn(step, message, **details)

    def save(step, state, metrics, force=False):
      nonlocal saved
      checked(step)
      logger.flush()
      manager.save(step, state.params, state.opt_state, host_states.gather(data.get_state()),
                   force=force)
      saved = step

    def evaluate(step, state, metrics):
      eval_results.update(self.evaluate(state.params))
      logger.write(step, eval_results, split='eval')
      if cfg.infer_eval:
        decoded = self.infer_evaluate(state.params)
        logger.write(step, {k: v for k, v in decoded.items() if not isinstance(v, str)},
                     split='infer_eval',
                     texts={k: v for k, v in decoded.items() if isinstance(v, str)})

    # (when, what) after each step, in this order.
    actions = [(cadence.every(cfg.log_every, last=cfg.train_steps, also=(start + 1,)),
                log_metrics),
               (cadence.every(cfg.checkpoint_every, last=cfg.train_steps), save)]
    if self.eval_data is not None:
      actions.append((cadence.every(cfg.eval_every, last=cfg.train_steps), evaluate))
    stopped = None
    try:
      host_states.wait_for_all_hosts('first step')
      if self.eval_data is not None and cfg.eval_at_start and manager.latest_step() is None:
        initial_eval = self.evaluate(state.params)
        logger.write(start, initial_eval, split='eval')
      with preemption.Watch() as sigterm:
        for step in range(start, cfg.train_steps):
          batch = evaluation.global_batch(next(data), built.mesh)
          state, metrics = built.train_step(state, batch, rng)
          manager.check()   # a failed background save stops the run at once
          finite = finite & jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
          watch.update(metrics)
          done = step + 1
          for when, action in actions:
            if when(done):
              action(done, state, metrics)
          if done < cfg.train_steps and sigterm.reached(done):   # save this step and stop
            if saved != done:
              save(done, state, metrics, force=True)
            stopped = done
            break
      if self.eval_data is not None and start >= cfg.train_steps:
        eval_results = self.evaluate(state.params)
      routing = None if stopped is not None else self._routing_health(
          logger, trained=start < cfg.train_steps, params=state.params)
    finally:
      manager.wait()
      latest = manager.latest_step()
      manager.close()
      logger.close()
    if stopped is not None:
      raise preemption.Stopped(stopped, manager.directory)
    if cfg.export_t5x and (resumed or start < cfg.train_steps):   # else no step was saved
      self._export_t5x(manager.directory, max(start, cfg.train_steps))
    checkpoint = None if latest is None else os.path.join(manager.directory, str(latest))
    return {'history': history, 'eval': eval_results, 'initial_eval': initial_eval,
            'start_step': start, 'state': state, 'checkpoint': checkpoint,
            'routing_health': routing}

  def _expert_spread(self, params) -> Dict[str, float]:
    """{layer: `routing_health.expert_spread`} of `params`, {} for a dense model; computed on
    every process (over the global params), one compilation for the run."""
    if not self._moe_layers:
      return {}
    return {layer: float(v) for layer, v in jax.device_get(self._spread(params)).items()}

  def _routing_health(self, logger: MetricLogger, trained: bool, params) -> Optional[dict]:
    """The run's routing-health row (`routing_health.health`, with the expert spread of the
    trained `params`), written to metrics.jsonl when this attempt trained a step (else the row
    an earlier attempt wrote); None for a dense model and on processes other than 0."""
    spread = self._expert_spread(params) if trained else {}
    rows = logger.rows()
    if not trained or not rows:
      return routing_health.of_run(rows)
    row = routing_health.health(
        rows, {layer: k.shape[-1] for layer, k in self._moe_layers.items()}, spread=spread)
    if row is not None:
      logger.record(row)
    return row
