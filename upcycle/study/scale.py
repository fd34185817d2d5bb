"""How big the study is: steps, seeds, evaluation cadence (the full study and `--quick`)."""

import dataclasses
from typing import Tuple

OFFLINE_BATCH_SIZE = 16   # BATCH_SIZE of configs/data/offline_span_corruption.gin


@dataclasses.dataclass(frozen=True)
class Scale:
  """Step counts and seeds of one study.

  Attributes:
    t5_pretrain_steps: dense T5 pretraining (P); `moe_from_half` upcycles at P / 2.
    t5_extra_steps: steps after the upcycling point (X); the dense continuation gets the
      steps that cost the same training FLOPs as X MoE steps.
    vit_pretrain_steps, vit_extra_steps: the same for ViT. The dense ViT's schedule is
      defined over P + X, which the upcycled runs continue.
    seeds: one run of every arm per seed.
    num_experts: E of every MoE arm but the expert-count ones.
    expert_counts: E of the expert-count claim.
    eval_every, log_every, checkpoint_every: the trainer's cadence (checkpoints must land on
      P and P / 2).
    t5_batch_size: 0 keeps the offline default's (16); `t5_batch` is the batch the T5 runs
      train with. Every run reads the offline default's sequence lengths (T5: 128 inputs /
      32 targets; Llama: 128).
    final_window: a run's final value is the mean of its last `final_window` evaluations.
    trail_long_steps: the `trails` suite's long horizon after P.
    trail_late_upcycling_step: where its late upcycling starts (a multiple of
      checkpoint_every, between P and P + trail_long_steps).
    t5_eval_batches: batches of each T5 evaluation, drawn from the validation split shuffled
      by the run's seed (every arm of a seed sees the same sequences).
    regime_pretrain_steps: the `regime` suite's dense pretraining (its sunk cost), a multiple
      of checkpoint_every.
    regime_fractions: the extra compute, as fractions of the sunk cost, it compares at.
    plateau_window, plateau_tolerance: the dense pretraining has plateaued when its last
      `plateau_window` of steps lowered the validation loss by less than `plateau_tolerance`
      (relative).
    llama_pretrain_steps, llama_extra_steps: the `drop` suite's dense Llama pretraining (P)
      and the steps of every arm after it (X).
    llama_eval_every: its evaluation cadence (the curves' resolution).
    llama_eval_batches: batches of each of its evaluations, drawn from the validation split
      shuffled by the seed.
    llama_learning_rate: its peak learning rate (cosine to a tenth of it).
    llama_warmup_steps: the warmup of every run's schedule (the pretraining's and each arm's
      own).
    llama_batch_size: 0 keeps the offline default's (16).
    recipe_peaks: the peak learning rates the `recipe` suite sweeps (T5X's rsqrt schedule,
      base rate = peak x sqrt(recipe_warmup_steps)).
    recipe_warmup_steps: their warmup (WARMUP_STEPS).
    recipe_eval_batches: batches of 128 sequences of each sweep run's final evaluation of its
      last checkpoint (0: the whole validation split).
    recipe_seed_std: the seeds agree when the std of their final validation losses is at most
      this.
  """

  t5_pretrain_steps: int
  t5_extra_steps: int
  vit_pretrain_steps: int
  vit_extra_steps: int
  seeds: Tuple[int, ...]
  num_experts: int = 8
  expert_counts: Tuple[int, ...] = (4, 8, 16)
  eval_every: int = 50
  log_every: int = 10
  checkpoint_every: int = 100
  t5_batch_size: int = 0
  final_window: int = 1
  trail_long_steps: int = 1500
  trail_late_upcycling_step: int = 1000
  t5_eval_batches: int = 96
  regime_pretrain_steps: int = 1500
  regime_fractions: Tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)
  plateau_window: float = 0.2
  plateau_tolerance: float = 0.01
  llama_pretrain_steps: int = 400
  llama_extra_steps: int = 200
  llama_eval_every: int = 20
  llama_eval_batches: int = 16
  llama_learning_rate: float = 1e-3
  llama_warmup_steps: int = 20
  llama_batch_size: int = 0
  recipe_peaks: Tuple[float, ...] = (0.1, 0.032, 0.01)
  recipe_warmup_steps: int = 100
  recipe_eval_batches: int = 0
  recipe_seed_std: float = 0.05

  @property
  def t5_batch(self) -> int:
    return self.t5_batch_size or OFFLINE_BATCH_SIZE

  def family_bindings(self, family: str) -> Tuple[str, ...]:
    if family == 'llama':
      return ((f'BATCH_SIZE={self.llama_batch_size}',) if self.llama_batch_size else ()) + (
          f'trainer.TrainConfig.eval_every={self.llama_eval_every}',
          f'EVAL_STEPS={self.llama_eval_batches}', 'validation/lm.LmPipeline.shuffle=True',
          f'LEARNING_RATE={self.llama_learning_rate}',
          f'WARMUP_STEPS={self.llama_warmup_steps}',
          f'MIN_LEARNING_RATE={self.llama_learning_rate / 10}')
    if family != 't5':
      return ('trainer.TrainConfig.eval_batches=0',)   # the whole digits validation split
    return ((f'BATCH_SIZE={self.t5_batch_size}',) if self.t5_batch_size else ()) + (
        f'trainer.TrainConfig.eval_batches={self.t5_eval_batches}',
        'validation/text.TextPipeline.shuffle=True')


# The main job's setting (quickstart: tiny T5, batch 16, P = 200), with 3x its extra steps.
FULL = Scale(t5_pretrain_steps=200, t5_extra_steps=300, vit_pretrain_steps=200,
             vit_extra_steps=200, seeds=(0, 1, 2), final_window=3)

# A smoke run of every arm, one seed, a few steps of small batches (the test suite runs it) at
# the offline default's sequence lengths: the render counts an epoch of each corpus by reading
# it, and that read costs per sequence (4x the sequences at a quarter of the length, 4x the time).
QUICK = Scale(t5_pretrain_steps=4, t5_extra_steps=4, vit_pretrain_steps=4, vit_extra_steps=4,
              seeds=(0,), expert_counts=(4, 8), eval_every=4, log_every=2, checkpoint_every=2,
              t5_batch_size=4,
              trail_long_steps=8, trail_late_upcycling_step=8, t5_eval_batches=2,
              regime_pretrain_steps=4, llama_pretrain_steps=4, llama_extra_steps=4,
              llama_eval_every=4, llama_eval_batches=2, llama_batch_size=4, llama_warmup_steps=2,
              recipe_peaks=(0.1,),
              recipe_warmup_steps=2, recipe_eval_batches=2)
