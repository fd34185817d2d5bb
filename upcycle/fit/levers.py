"""The memory levers of a run: which it has set, and which of the others would help.

Read from the run's own configuration (model, optimizer, mesh, batch), not from a fixed list:
a lever already set is named as set and never advised. The rest are advised by what the
compile says dominates a device's memory:

  activations (temporaries) over parameters + optimizer state: REMAT_POLICY = 'full',
      SCAN_LAYERS = True, for the eval step `eval_microbatches` (the eval step a microbatch
      of the train step's size at a time, where the train step has microbatches), LOSS_CHUNKS
      (a causal LM whose float32 logits over the whole vocabulary are a quarter of the
      temporaries or more: the loss a slice of the sequence at a time,
      `objectives.CausalLm.loss_chunks`), then a smaller BATCH_SIZE (`batch_fit`: the largest
      that fits);
  parameters + optimizer state over activations: the most expert partitions the experts and
      devices allow, LOGICAL_AXIS_RULES = 'fsdp' (when the mesh has a data axis to split
      over), and a factored optimizer when the state is as large as the parameters or more
      (full-size second moments: AdamW, or factored = False).

Gradient accumulation (`num_microbatches`) is not advised: it adds a float32 accumulator the
size of the parameters to the step, and in the fit table it cost memory (T5 XL MoE on a
v4-32, mesh 1x8x2: 33.09 GiB, 36.68 GiB with 2 microbatches). Compile with it to measure.
"""

import dataclasses
import math
from typing import Any, List, Mapping, Optional

from upcycle.fit import batch_fit
from upcycle.moe.config import MoeConfig
from upcycle import partitioning

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run has set of the memory levers.

  `mesh`: {'data', 'expert', 'model'} sizes; `num_experts`: the most experts of its MoE
  blocks (0: dense); `factored`: the optimizer's `factored` field, None where it has none
  (AdamW: full-size moments; big_vision's Adafactor: always factored); `num_microbatches`,
  `eval_microbatches`: the train and eval steps' (`TrainConfig`); `loss_chunks`: the
  objective's (`CausalLm.loss_chunks`), None where its loss has no chunks; `sequence_length`
  and `vocab_size`: the rows' length and the model's vocabulary (`logit_bytes`).
  """

  scan_layers: bool
  remat_policy: str
  fsdp: bool
  mesh: Mapping[str, int]
  num_experts: int
  optimizer: str
  factored: Optional[bool]
  num_microbatches: int
  batch_size: int
  eval_microbatches: int = 1
  loss_chunks: Optional[int] = None
  sequence_length: int = 0
  vocab_size: int = 0

  def most_expert_partitions(self) -> int:
    """The most expert partitions the experts allow over the devices not in 'model'."""
    return math.gcd(self.num_experts, self.mesh['data'] * self.mesh['expert'])

  def batch_multiple(self) -> int:
    """What BATCH_SIZE must be a multiple of: every microbatch of both steps split over
    data x expert."""
    return (self.mesh['data'] * self.mesh['expert']
            * math.lcm(self.num_microbatches, self.eval_microbatches))

  def logit_bytes(self, rows: int) -> int:
    """The float32 logits of `rows` rows over the whole vocabulary (rows x length x
    vocabulary x 4); 0 where the loss has no chunks."""
    return 0 if self.loss_chunks is None else rows * self.sequence_length * self.vocab_size * 4

  def rows_per_device(self, step: str) -> int:
    """Rows a device holds at once in `step`: a microbatch of the 'train_step' or the
    'eval_step'."""
    microbatches = {'train_step': self.num_microbatches,
                    'eval_step': self.eval_microbatches}[step]
    return max(1, self.batch_size // (self.mesh['data'] * self.mesh['expert'] * microbatches))


def read(*, config: Any, objective: Any, optimizer: Any, mesh: Any,
         sequence_length: int) -> Settings:
  """The settings of a run from its TrainConfig, objective, optimizer config, mesh and the
  length of its training rows."""
  model_config = objective.model.config
  moes = [v for v in vars(model_config).values() if isinstance(v, MoeConfig)]
  loss_chunks = getattr(objective, 'loss_chunks', None)
  return Settings(
      scan_layers=bool(getattr(model_config, 'scan_layers', False)),
      remat_policy=getattr(model_config, 'remat_policy', 'none'),
      fsdp=tuple(config.logical_axis_rules) == partitioning.RULE_SETS['fsdp'],
      mesh={name: int(size) for name, size in mesh.shape.items()},
      num_experts=max((moe.num_experts for moe in moes), default=0),
      optimizer=type(optimizer).__name__, factored=getattr(optimizer, 'factored', None),
      num_microbatches=config.num_microbatches, batch_size=config.batch_size,
      eval_microbatches=config.eval_microbatches, loss_chunks=loss_chunks,
      sequence_length=sequence_length, vocab_size=getattr(model_config, 'vocab_size', 0))


def already_set(s: Settings) -> List[str]:
  """The levers `s` has set, as the bindings that set them."""
  out = []
  if s.scan_layers:
    out.append('SCAN_LAYERS = True')
  if s.remat_policy != 'none':
    out.append(f'REMAT_POLICY = {s.remat_policy!r}')
  if s.mesh['expert'] > 1:
    most = s.most_expert_partitions()
    out.append(f'num_expert_partitions = {s.mesh["expert"]}'
               + (f' (the most: E = {s.num_experts} over {s.mesh["data"] * s.mesh["expert"]} '
                  f'devices)' if s.mesh['expert'] == most else ''))
  if s.mesh['model'] > 1:
    out.append(f'num_model_partitions = {s.mesh["model"]}')
  if s.fsdp:
    out.append("LOGICAL_AXIS_RULES = 'fsdp'")
  if s.factored:
    out.append(f'{s.optimizer}.factored = True')
  if s.num_microbatches > 1:
    out.append(f'num_microbatches = {s.num_microbatches}')
  if s.eval_microbatches > 1:
    out.append(f'eval_microbatches = {s.eval_microbatches}')
  if s.loss_chunks and s.loss_chunks > 1:
    out.append(f'LOSS_CHUNKS = {s.loss_chunks}')
  return out


def advise(s: Settings, *, parameters: int, optimizer_state: int, temp: int,
           search: Optional[batch_fit.BatchSearch] = None, step: str = '') -> List[str]:
  """The levers `s` has not set that would shrink what dominates: activations (`temp`) or
  the state (`parameters` + `optimizer_state`, bytes per device). `search`: --find_batch's
  (`batch_fit`), when searched; `step`: 'train_step' or 'eval_step' for those functions,
  whose rows per device set their logits' bytes ('' for another)."""
  if temp >= parameters + optimizer_state:
    return _activation_levers(s, search, step=step, temp=temp)
  return _state_levers(s, parameters, optimizer_state)


def loss_chunks_for(sequence_length: int) -> int:
  """The LOSS_CHUNKS to advise: 8 (MaxText's vocabulary tiling in the fit table: the 1B's
  step in half the temporaries), else the largest of 4 and 2 that divides the length; 1
  where none does."""
  return next((n for n in (8, 4, 2) if sequence_length % n == 0), 1)


def _activation_levers(s: Settings, search: Optional[batch_fit.BatchSearch], *, step: str,
                       temp: int) -> List[str]:
  out = []
  logits = s.logit_bytes(s.rows_per_device(step)) if step else 0
  if s.remat_policy != 'full':
    out.append(f"REMAT_POLICY = 'full' (is {s.remat_policy!r}: recompute every block's "
               f'activations in the backward pass)')
  if not s.scan_layers:
    out.append('SCAN_LAYERS = True (the layer stack under nn.scan: with remat, one input per '
               'layer is kept)')
  if step == 'eval_step' and s.eval_microbatches < s.num_microbatches:
    out.append(f'trainer.TrainConfig.eval_microbatches = {s.num_microbatches} (is '
               f'{s.eval_microbatches}: the eval step holds {s.rows_per_device(step)} rows per '
               f'device at once, the train step '
               f'{s.rows_per_device("train_step")})')
  chunks = loss_chunks_for(s.sequence_length)
  if s.loss_chunks == 1 and chunks > 1 and 4 * logits >= temp:
    out.append(f'LOSS_CHUNKS = {chunks} (is 1: the float32 logits over the whole vocabulary '
               f'are {logits / GIB:.2f} GiB per device; the loss {chunks} slices of the '
               f'sequence at a time)')
  if search is None:
    out.append(f'a smaller BATCH_SIZE (is {s.batch_size}; --find_batch predicts the largest '
               f'that fits)')
  elif search.lever():
    out.append(search.lever())
  return out


def _state_levers(s: Settings, parameters: int, optimizer_state: int) -> List[str]:
  out = []
  most = s.most_expert_partitions()
  if s.num_experts and s.mesh['expert'] < most:
    out.append(f'trainer.TrainConfig.num_expert_partitions = {most} (is {s.mesh["expert"]}: '
               f'the experts split {most} ways)')
  if not s.fsdp and s.mesh['data'] * s.mesh['expert'] > 1:
    out.append(f"LOGICAL_AXIS_RULES = 'fsdp' (parameters and optimizer state split "
               f"{s.mesh['data'] * s.mesh['expert']} ways over the data-parallel devices)")
  if optimizer_state >= parameters and not s.factored:   # full-size second moments
    out.append(f'{s.optimizer}.factored = True' if s.factored is False else
               f'a factored optimizer (optimizers.T5XAdafactor, optimizers.Adafactor) in place '
               f'of {s.optimizer}')
  return out


def summary(s: Settings, *, parameters: int, optimizer_state: int, temp: int,
            search: Optional[batch_fit.BatchSearch] = None, larger_slice: str = '',
            step: str = '') -> str:
  """What dominates and the levers not set that would shrink it, in one clause;
  `larger_slice`: the slice to advise when no batch fits (`batch_fit.larger_slice`); `step`:
  `advise`'s."""
  state = parameters + optimizer_state
  part = (f'activations (temp {temp / GIB:.2f} GiB) dominate parameters + optimizer state '
          f'({state / GIB:.2f} GiB)' if temp >= state else
          f'parameters + optimizer state ({state / GIB:.2f} GiB) dominate activations (temp '
          f'{temp / GIB:.2f} GiB)')
  levers = advise(s, parameters=parameters, optimizer_state=optimizer_state, temp=temp,
                  search=search, step=step) + ([larger_slice] if larger_slice else [])
  return (f'{part}; levers not set: {"; ".join(levers)}' if levers else
          f'{part}; every lever for them is set: a larger slice')
