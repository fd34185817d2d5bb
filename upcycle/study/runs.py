"""The study's runs: every arm of every claim as a `python -m upcycle.train` command.

A `Run` is one training run of one arm and seed, in RUNS/<family>/<arm>/seed<seed>. Runs that
start from another run's checkpoint (`source`) wait for it; a run whose length depends on
another's measured FLOPs (dense continuation at equal extra compute) computes it when it starts.
"""

import dataclasses
import json
import math
import os
from typing import Callable, List, Optional, Tuple

from upcycle.study import curves
from upcycle.study.scale import Scale

T5_MODEL = 'models/t5_1_1/tiny.gin'
T5_DATA = 'data/offline_packages_span_corruption.gin'
# A run's final evaluation (`Run.final_eval_batches`): its directory and batch size.
FINAL_EVAL = 'final_eval'
FINAL_EVAL_BATCH_SIZE = 128
VIT_MODEL = 'models/vit/tiny.gin'
VIT_DATA = 'data/offline_digits.gin'
# {family: (model gin file, data gin file)}: the model first, the data after the run's files.
FAMILY_FILES = {'t5': (T5_MODEL, T5_DATA), 'vit': (VIT_MODEL, VIT_DATA),
                'llama': ('models/llama/tiny.gin', 'data/offline_packages_lm.gin')}
T5_MOE = ('moe/paper_t5.gin',)
VIT_MOE = ('moe/paper_vit.gin',)


@dataclasses.dataclass(frozen=True)
class Run:
  """One `python -m upcycle.train` run.

  Attributes:
    family: 't5', 'vit' or 'llama' (FAMILY_FILES).
    arm: the arm's name, e.g. 'moe' or 'drop_0.5'.
    seed: SEED (parameter init, data order, upcycling draws).
    gin_files: under configs/, after the model file and before the data file.
    bindings: extra `--gin.` bindings (without the prefix).
    steps: TRAIN_STEPS, or a function of the runs directory computing it when the run starts.
    source: (arm, step) whose checkpoint INITIAL_CHECKPOINT_PATH points at; None from scratch.
    after: arms (same family and seed) that must finish first, besides `source`.
    final_eval_batches: None, or after training its last checkpoint is evaluated on this many
      batches of FINAL_EVAL_BATCH_SIZE validation sequences (0: the whole split) by
      `python -m upcycle.eval` into <run>/final_eval (T5 only; `final_eval_command`).
  """

  family: str
  arm: str
  seed: int
  gin_files: Tuple[str, ...]
  bindings: Tuple[str, ...] = ()
  steps: object = 0
  source: Optional[Tuple[str, int]] = None
  after: Tuple[str, ...] = ()
  final_eval_batches: Optional[int] = None

  @property
  def name(self) -> str:
    return f'{self.family}/{self.arm}/seed{self.seed}'

  def directory(self, runs_dir: str, arm: Optional[str] = None) -> str:
    return os.path.join(runs_dir, self.family, arm or self.arm, f'seed{self.seed}')

  def dependencies(self) -> Tuple[str, ...]:
    arms = ((self.source[0],) if self.source else ()) + self.after
    return tuple(f'{self.family}/{arm}/seed{self.seed}' for arm in arms)

  def train_steps(self, runs_dir: str) -> int:
    return self.steps(self, runs_dir) if callable(self.steps) else self.steps

  def command(self, runs_dir: str, scale: Scale, python: str) -> List[str]:
    model, data = FAMILY_FILES[self.family]
    steps = self.train_steps(runs_dir)
    bindings = [f"MODEL_DIR='{self.directory(runs_dir)}'", f'TRAIN_STEPS={steps}',
                f'SEED={self.seed}', f'trainer.TrainConfig.eval_every={scale.eval_every}',
                f'trainer.TrainConfig.log_every={scale.log_every}',
                f'trainer.TrainConfig.checkpoint_every={scale.checkpoint_every}',
                'trainer.TrainConfig.eval_at_start=True']
    if self.source:   # read on from the source's data position: no example is seen twice
      arm, step = self.source
      path = os.path.join(self.directory(runs_dir, arm), 'checkpoints', str(step))
      bindings += [f"INITIAL_CHECKPOINT_PATH='{path}'", 'RESTORE_DATASET=True']
    # The run's own bindings over the family's over the common ones: one value per key, as
    # the command line takes them.
    chosen = {b.split('=', 1)[0]: b for b in (*bindings, *scale.family_bindings(self.family),
                                                *self.bindings)}
    return [python, '-m', 'upcycle.train', f'--gin_file={model}',
            *[f'--gin_file={f}' for f in self.gin_files], f'--gin_file={data}',
            *[f'--gin.{b}' for b in chosen.values()]]


  def final_eval_command(self, runs_dir: str, python: str) -> List[str]:
    """`python -m upcycle.eval` of the run's last checkpoint: loss and accuracy over
    `final_eval_batches` (0: all) unshuffled validation batches, no decoding, written to
    <run>/final_eval (eval_results.json)."""
    if self.family != 't5':
      raise ValueError(f'{self.name}: a final evaluation is built for T5 runs only.')
    model, data = FAMILY_FILES[self.family]
    run_dir = self.directory(runs_dir)
    steps = self.train_steps(runs_dir)
    return [python, '-m', 'upcycle.eval', f'--gin_file={model}', '--gin_file=runs/eval.gin',
            f'--gin_file={data}',
            f"--gin.CHECKPOINT_PATH='{os.path.join(run_dir, 'checkpoints', str(steps))}'",
            f"--gin.EVAL_OUTPUT_DIR='{os.path.join(run_dir, FINAL_EVAL)}'",
            f'--gin.BATCH_SIZE={FINAL_EVAL_BATCH_SIZE}',
            f'--gin.EVAL_BATCHES={self.final_eval_batches}',
            '--gin.evaluate.decode_data=None']


def final_eval(run_dir: str) -> dict:
  """What a run's final evaluation (`Run.final_eval_batches`) wrote: {'loss', 'accuracy',
  'loss_stderr', 'step', ...}."""
  path = os.path.join(run_dir, FINAL_EVAL, 'eval_results.json')
  if not os.path.exists(path):
    raise ValueError(f'{path} does not exist: the run\'s final evaluation has not run; run the '
                     f'study command again.')
  with open(path) as f:
    return json.load(f)


def last_logged(run_dir: str, split: str, key: str) -> float:
  """`key` of the last `split` row of a finished run's metrics.jsonl."""
  values = [r[key] for r in curves.read_rows(run_dir) if r.get('split') == split and key in r]
  if not values:
    raise ValueError(f'{run_dir}/metrics.jsonl has no {split} row with {key!r}.')
  return values[-1]


def flops_per_step(run: Run, runs_dir: str, arm: str) -> float:
  """The training FLOPs per step `arm` (same family and seed as `run`) logged."""
  return last_logged(run.directory(runs_dir, arm), 'train', 'train_flops_per_step')


def sunk_cost_steps(sunk_steps: int, fraction: float, rate_arm: str, *, start: int,
                    sunk_arm: str) -> Callable[[Run, str], int]:
  """TRAIN_STEPS spending `fraction` of the sunk cost (the FLOPs of `sunk_steps` steps of the
  `sunk_arm` run) after `start`, at the FLOPs per step of `rate_arm`: the fewest steps that
  spend at least that, so at most one `rate_arm` step more."""

  def steps(run: Run, runs_dir: str) -> int:
    sunk = sunk_steps * flops_per_step(run, runs_dir, sunk_arm)
    return start + int(math.ceil(fraction * sunk / flops_per_step(run, runs_dir, rate_arm)))

  return steps


def equal_flops_steps(start: int, extra: int, reference_arm: str) -> Callable[[Run, str], int]:
  """TRAIN_STEPS giving a dense continuation the extra FLOPs `reference_arm` spent in `extra`
  steps: extra * (its FLOPs/step) / (dense FLOPs/step, from the pretraining run)."""

  def steps(run: Run, runs_dir: str) -> int:
    moe, dense = (flops_per_step(run, runs_dir, arm) for arm in (reference_arm, 'pretrain'))
    return start + int(math.ceil(extra * moe / dense))

  return steps


# Switches beyond the papers' anchors, upcycled like `moe` otherwise: (gin files, bindings).
BEYOND_T5 = {
    'drop_layerwise': (('upcycling/drop_layerwise.gin',), ("DROP_RATIO='linear:0.25:0.75'",)),
    'partial': (('upcycling/partial.gin',), ('COPIED_EXPERTS=4',)),
    'load_balancing_pooled_batch': (('experiments/load_balancing_pooled_batch.gin',), ()),
    'shared_expert': (('moe/shared_expert.gin', 'upcycling/zero_output.gin'), ()),
}


# The beyond-the-anchors arms (their own suite): BEYOND_T5, depth upcycling, a grown MoE.
BEYOND_ARMS = (*BEYOND_T5, 'depth', 'grown')


def t5_runs(scale: Scale, seed: int) -> List[Run]:
  """The language runs of one seed (tiny T5 v1.1, span corruption over Python's docs)."""
  p, x = scale.t5_pretrain_steps, scale.t5_extra_steps
  e = f'NUM_EXPERTS={scale.num_experts}'
  run = lambda arm, files, bindings=(), **kw: Run('t5', arm, seed, tuple(files), tuple(bindings),
                                                  **kw)
  upcycle = lambda arm, files=(), bindings=(), source=('pretrain', p), steps=p + x: run(
      arm, (*T5_MOE, 'runs/upcycle.gin', *files), (e, *bindings), steps=steps, source=source)
  capacity = lambda c: (f'encoder/moe.MoeConfig.train_capacity_factor={c}',
                        f'encoder/moe.MoeConfig.eval_capacity_factor={c}')
  runs = [
      run('pretrain', ['runs/pretrain.gin'], steps=p),
      upcycle('moe'),
      run('dense', ['runs/continue_dense.gin'], steps=equal_flops_steps(p, x, 'moe'),
          source=('pretrain', p), after=('moe',)),
      run('scratch', [*T5_MOE, 'runs/pretrain.gin'], [e], steps=p + x),
      upcycle('moe_from_half', source=('pretrain', p // 2), steps=p // 2 + x),
      upcycle('top2_encoder', ['moe/tokens_choose_top2.gin']),
      upcycle('capacity_1', bindings=capacity(1.0)),
      upcycle('capacity_3', bindings=capacity(3.0)),
      *[upcycle(f'experts_{n}', bindings=(f'NUM_EXPERTS={n}',))
        for n in scale.expert_counts if n != scale.num_experts],
      upcycle('reuse_optimizer_state', ['upcycling/reuse_optimizer_state.gin']),
      upcycle('normalize_combine_weights', ['upcycling/normalize_combine_weights.gin']),
      upcycle('lr_restart', bindings=("restore.Restore.step='reset'",), steps=x),
      upcycle('placement_last_2', ['moe/placement/last_2.gin']),
      upcycle('placement_all', ['moe/placement/all.gin']),
      *[upcycle(f'drop_{r}', ['upcycling/drop.gin'], (f'DROP_RATIO={r}',)) for r in (0.5, 1.0)],
  ]
  runs += [upcycle(arm, files, bindings) for arm, (files, bindings) in BEYOND_T5.items()]
  # Grow an MoE: experts_4 trained on to `grown_at`, its 4 experts tiled to 8, trained to P + X.
  grown_at = p + max(scale.checkpoint_every, (x // 3) // scale.checkpoint_every *
                     scale.checkpoint_every)
  runs.append(upcycle('grown', ['upcycling/grow_experts.gin'], source=('experts_4', grown_at)))
  runs.append(run('depth', ['runs/continue_dense.gin', 'upcycling/grow_depth.gin'],
                  ['models.T5Config.num_encoder_layers=8', 'models.T5Config.num_decoder_layers=8'],
                  steps=p + x, source=('pretrain', p)))
  return runs


# The main job's MoE recipe, the quickstart's stage 3 (the file says what it binds).
MAIN_JOB_MOE = ('runs/upcycle_main_job.gin',)


TRAIL_ARMS = ('main_dense_long', 'main_moe_long', 'main_moe_late', 'main_dense_batch4x',
              'main_moe_batch4x')


def trail_runs(scale: Scale, seed: int) -> List[Run]:
  """Why the upcycled T5 trails the dense one: the main job's recipe against its dense
  continuation over a 5x longer horizon, upcycled later (from a dense model trained 5x
  longer), and with a 4x larger batch (4x the tokens per expert)."""
  p, x, long, late = (scale.t5_pretrain_steps, scale.t5_extra_steps, scale.trail_long_steps,
                      scale.trail_late_upcycling_step)
  e = f'NUM_EXPERTS={scale.num_experts}'
  batch = f'BATCH_SIZE={4 * scale.t5_batch}'
  run = lambda arm, files, bindings=(), **kw: Run('t5', arm, seed, tuple(files), tuple(bindings),
                                                  **kw)
  # dense_long keeps its checkpoints: main_moe_late upcycles its step `late`.
  keep = f'trainer.TrainConfig.keep_checkpoints={(p + long) // scale.checkpoint_every}'
  return [
      run('pretrain', ['runs/pretrain.gin'], steps=p),
      run('main_dense_long', ['runs/continue_dense.gin'], [keep], steps=p + long,
          source=('pretrain', p)),
      run('main_moe_long', MAIN_JOB_MOE, [e], steps=p + long, source=('pretrain', p)),
      run('main_moe_late', MAIN_JOB_MOE, [e], steps=late + x, source=('main_dense_long', late)),
      run('main_dense_batch4x', ['runs/continue_dense.gin'], [batch], steps=p + x,
          source=('pretrain', p)),
      run('main_moe_batch4x', MAIN_JOB_MOE, [e, batch], steps=p + x, source=('pretrain', p)),
  ]


REGIME_ARMS = ('regime_pretrain', 'regime_dense', 'regime_moe_paper', 'regime_moe_best',
               'regime_scratch')


def regime_runs(scale: Scale, seed: int) -> List[Run]:
  """The paper's headline experiment in its regime: a dense T5 pretrained to its plateau
  (`regime_pretrain_steps`, the sunk cost) on data it never repeats, then continued densely and
  upcycled (the paper's recipe and this study's best) for 100% of the sunk cost's FLOPs, each
  evaluated along the way (10%, 25%, 50% are points of the same runs: the rsqrt schedule does
  not depend on a run's length), and an MoE from scratch for the total of both. The MoE's
  FLOPs per step come from the claims suite's `moe` run (the same architecture and batch)."""
  p = scale.regime_pretrain_steps
  e = f'NUM_EXPERTS={scale.num_experts}'
  run = lambda arm, files, bindings=(), **kw: Run('t5', arm, seed, tuple(files), tuple(bindings),
                                                  **kw)
  # The pretraining keeps its checkpoints: the plateau criterion may be read at any of them.
  keep = f'trainer.TrainConfig.keep_checkpoints={p // scale.checkpoint_every}'
  sunk_cost = lambda fraction, start: sunk_cost_steps(p, fraction, 'moe', start=start,
                                                      sunk_arm='regime_pretrain')
  moe = lambda arm, files: run(arm, files, [e], steps=sunk_cost(1.0, p),
                               source=('regime_pretrain', p), after=('moe',))
  return [
      run('regime_pretrain', ['runs/pretrain.gin'], [keep], steps=p),
      run('regime_dense', ['runs/continue_dense.gin'], steps=2 * p,
          source=('regime_pretrain', p)),
      moe('regime_moe_paper', (*T5_MOE, 'runs/upcycle.gin')),
      moe('regime_moe_best', MAIN_JOB_MOE),
      run('regime_scratch', [*T5_MOE, 'runs/pretrain.gin'], [e],
          steps=sunk_cost(2.0, 0), after=('regime_pretrain', 'moe')),
  ]


def vit_runs(scale: Scale, seed: int) -> List[Run]:
  """The vision runs of one seed (tiny ViT, scikit-learn's digits)."""
  p, x = scale.vit_pretrain_steps, scale.vit_extra_steps
  e = f'NUM_EXPERTS={scale.num_experts}'
  run = lambda arm, files, bindings=(), **kw: Run('vit', arm, seed, tuple(files), tuple(bindings),
                                                  **kw)
  upcycle = lambda arm, files=(), bindings=(): run(
      arm, (*VIT_MOE, 'runs/vit_upcycle.gin', *files), (e, *bindings), steps=p + x,
      source=('pretrain', p))
  return [
      run('pretrain', ['runs/vit_pretrain.gin'], [f'SCHEDULE_STEPS={p + x}'], steps=p),
      upcycle('moe'),
      run('dense', ['runs/vit_continue_dense.gin'], steps=equal_flops_steps(p, x, 'moe'),
          source=('pretrain', p), after=('moe',)),
      run('scratch', [*VIT_MOE, 'runs/vit_pretrain.gin'], [e], steps=p + x),
      upcycle('top2', ['moe/tokens_choose_top2.gin']),
      upcycle('fresh_optimizer_state',
              bindings=('restore.Restore.reuse_optimizer_state=False',)),
      upcycle('unnormalized_combine_weights',
              bindings=('encoder/moe.MoeConfig.normalize_combine_weights=False',)),
  ]


DESCRIPTIONS = {
    't5': {
        'pretrain': 'dense pretraining, P steps',
        'moe': 'upcycled: paper T5 recipe (Expert Choice C=2 encoder, Top-2 decoder, T5X '
               'capacity, copied experts, fresh optimizer state, unnormalized)',
        'dense': 'dense continued for the extra FLOPs of `moe`',
        'scratch': '`moe`\'s architecture trained from scratch for P + X steps',
        'moe_from_half': 'upcycled at P/2',
        'top2_encoder': 'Top-2 with BPR in the encoder',
        'capacity_1': 'encoder C=1', 'capacity_3': 'encoder C=3',
        'experts_4': 'E=4', 'experts_16': 'E=16',
        'reuse_optimizer_state': 'dense optimizer state reused',
        'normalize_combine_weights': 'combine weights normalized',
        'lr_restart': 'step and learning-rate schedule restarted at 0',
        'placement_last_2': 'MoE in the last 2 layers', 'placement_all': 'MoE in every layer',
        'drop_0.5': 'Drop-Upcycling r=0.5', 'drop_1.0': 'Drop-Upcycling r=1.0',
        'drop_layerwise': 'Drop-Upcycling, r from 0.25 (first MoE layer) to 0.75 (last)',
        'partial': 'partial upcycling: 4 experts copied, 4 from scratch',
        'load_balancing_pooled_batch': 'load balancing over the batch, pooled over each '
                                       "stack's layers (HF Mixtral's loss)",
        'shared_expert': 'a shared expert copied from the dense MLP, routed experts with zero '
                         'output projections (function-preserving)',
        'depth': 'depth upcycling: the dense model tiled to 8+8 layers, trained densely',
        'main_dense_long': 'dense continued for 5x the extra steps (checkpoints kept)',
        'main_moe_long': "the main job's MoE (normalized, dense optimizer state reused) for 5x "
                         'the extra steps',
        'main_moe_late': "the main job's MoE upcycled from `main_dense_long` at its late "
                         'upcycling step, trained X steps',
        'main_dense_batch4x': 'dense continued with a 4x larger batch',
        'main_moe_batch4x': "the main job's MoE with a 4x larger batch",
        'regime_pretrain': 'dense pretraining to the plateau (the sunk cost)',
        'regime_dense': 'dense continued, data read on, for 100% of the sunk cost',
        'regime_moe_paper': "upcycled with the paper's T5 recipe (fresh optimizer state, "
                            'unnormalized), data read on, for 100% of the sunk cost',
        'regime_moe_best': 'upcycled with the best recipe here (normalized, dense optimizer '
                           'state reused), data read on, for 100% of the sunk cost',
        'regime_scratch': '`regime_moe_paper`\'s architecture from scratch for the FLOPs of the '
                          'dense pretraining and its continuation together',
        'grown': '`experts_4` grown to 8 experts (each copied once, router columns too; '
                 'optimizer state taken alike) a third of the way through X, trained on',
    },
    'vit': {
        'pretrain': 'dense pretraining, P steps (schedule over P + X)',
        'moe': 'upcycled: paper ViT recipe (Expert Choice C=2, normalized, optimizer state '
               'reused, schedule continued)',
        'dense': 'dense continued for the extra FLOPs of `moe`',
        'scratch': '`moe`\'s architecture trained from scratch for P + X steps',
        'top2': 'Top-2 with BPR',
        'fresh_optimizer_state': 'fresh optimizer state',
        'unnormalized_combine_weights': 'combine weights not normalized',
    },
}
