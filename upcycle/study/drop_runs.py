"""The `drop` suite's runs: Drop-Upcycling in its own setting, a tiny Llama upcycled into a
Mixtral (E = 8, Top-2, every layer, dropless, SwiGLU experts, the load-balancing loss of
transformers pooled over the layers with weight 0.02: `moe/mixtral.gin`).

Per seed: the dense Llama pretrained for P steps (its own warmup and cosine schedule), then
from its last checkpoint, each reading the data on from where it stopped (no training
sequence is read twice), X steps of every arm with a schedule of its own (warmup, cosine over
X: `step = 'reset'`, fresh AdamW state, as the paper trains its MoEs): naive upcycling, Drop
at r in {0.25, 0.5, 0.75, 1.0} with the paper's shared indices and r = 0.5 with the official
code's per-matrix redraw, random noise upcycling, the dense model continued, and the MoE from
scratch for the same X steps. Controls and ablations: a constant learning rate after warmup
for naive and Drop r = 0.5; the router initialized N(0, 0.02) and N(0, 0.2887) against the
default U(-0.0346, 0.0346); the load-balancing loss per layer instead of pooled, for naive and
Drop r = 0.5.

The precondition (`upcycle.study.precondition`): the Mixtral from scratch
(`PRECONDITION_SCRATCH`) for the training FLOPs of the dense pretraining's P steps, with its
own warmup and one cosine over its own steps, against the dense pretraining itself. `pretrain`
serves as the dense arm because it is a whole dense run from scratch with one schedule over
its own length (warmup, cosine over P), and so is compared at its own budget, P dense steps;
the budget P + X would need a dense run from scratch of P + X steps, since `dense` (a second,
rewarmed cosine over X from P's checkpoint) is no run from scratch, and P + X steps cost as
much as the suite's pretraining again while asking the same question: does this MoE beat
this dense model at equal compute at this scale. The MoE's steps are the fewest whose FLOPs
reach P dense steps' (`runs.sunk_cost_steps`: the FLOPs per step each run logged, the MoE's
from `moe`, the same Mixtral at the same batch), so it spends at most one MoE step more.
"""

from typing import List

from upcycle.study.runs import Run, sunk_cost_steps
from upcycle.study.scale import Scale

MIXTRAL = ('moe/mixtral.gin', 'runs/llm_upcycle.gin')
RESET = "restore.Restore.step='reset'"
DROP_RATIOS = (0.25, 0.5, 0.75, 1.0)
PER_MATRIX = "experts.Drop.index_sharing='per_matrix'"
# mixtral.gin's load-balancing loss (its weight and scope 'batch'), each layer its own.
LAYERWISE = 'moe/balance_per_layer.gin'
PRECONDITION_SCRATCH = 'precondition_scratch'


def llama_runs(scale: Scale, seed: int) -> List[Run]:
  """The Llama runs of one seed: the `drop` suite's and the precondition's (module docstring)."""
  p, x = scale.llama_pretrain_steps, scale.llama_extra_steps
  constant = f'MIN_LEARNING_RATE={scale.llama_learning_rate}'
  run = lambda arm, files, bindings=(), **kw: Run('llama', arm, seed, tuple(files),
                                                  tuple(bindings), **kw)
  upcycle = lambda arm, files=(), bindings=(): run(
      arm, (*MIXTRAL, *files), (RESET, *bindings), steps=x, source=('pretrain', p))
  drop = lambda r: (('upcycling/drop.gin',), (f'DROP_RATIO={r}',))
  router = lambda std: (('upcycling/router_normal.gin',), (f'ROUTER_STD={std}',))
  return [
      run('pretrain', ['runs/llm_pretrain.gin'], steps=p),
      upcycle('moe'),
      *[upcycle(f'drop_{r}', *drop(r)) for r in DROP_RATIOS],
      upcycle('drop_0.5_per_matrix', drop(0.5)[0], (*drop(0.5)[1], PER_MATRIX)),
      upcycle('noise', ['upcycling/noise.gin']),
      run('dense', ['runs/llm_continue.gin'],
          ["restore.Restore.step='reset'", 'REUSE_OPTIMIZER_STATE=False'],
          steps=x, source=('pretrain', p)),
      run('scratch', ['moe/mixtral.gin', 'runs/llm_pretrain.gin'], steps=x),
      run(PRECONDITION_SCRATCH, ['moe/mixtral.gin', 'runs/llm_pretrain.gin'],
          steps=sunk_cost_steps(p, 1.0, 'moe', start=0, sunk_arm='pretrain'),
          after=('pretrain', 'moe')),
      upcycle('moe_constant_lr', bindings=(constant,)),
      upcycle('drop_0.5_constant_lr', drop(0.5)[0], (*drop(0.5)[1], constant)),
      upcycle('router_normal', *router(0.02)),
      upcycle('router_normal_wide', *router(0.2887)),
      upcycle('moe_layerwise_balance', [LAYERWISE]),
      upcycle('drop_0.5_layerwise_balance', (*drop(0.5)[0], LAYERWISE), drop(0.5)[1]),
  ]


QUICK_ARMS = ('pretrain', 'moe', 'drop_0.5', 'dense', PRECONDITION_SCRATCH)

DESCRIPTIONS = {
    'pretrain': 'dense Llama pretraining, P steps (warmup, cosine over P)',
    'moe': 'naive upcycling: every expert a copy of the dense MLP, router U(-0.0346, 0.0346)',
    **{f'drop_{r}': f'Drop-Upcycling r={r} (indices shared across the three matrices, as the '
                    'paper writes)' for r in DROP_RATIOS},
    'drop_0.5_per_matrix': 'Drop-Upcycling r=0.5, indices drawn per matrix (as the official '
                           'code does)',
    'noise': 'random noise upcycling: N(0, 0.02) added to half the d_ff units of each expert',
    'dense': 'the dense Llama continued for X steps (its own schedule, fresh AdamW state)',
    'scratch': "the MoE's architecture from scratch for X steps",
    PRECONDITION_SCRATCH: "the MoE's architecture from scratch for the training FLOPs of "
                          '`pretrain` (warmup, cosine over its own steps)',
    'moe_constant_lr': 'naive upcycling, constant learning rate after warmup',
    'drop_0.5_constant_lr': 'Drop r=0.5, constant learning rate after warmup',
    'router_normal': 'naive upcycling, router N(0, 0.02)',
    'router_normal_wide': 'naive upcycling, router N(0, 0.2887)',
    'moe_layerwise_balance': 'naive upcycling, load-balancing loss per layer (not pooled)',
    'drop_0.5_layerwise_balance': 'Drop r=0.5, load-balancing loss per layer (not pooled)',
}
