"""A step's FLOPs and bytes per device with every layer and microbatch counted, from shallow
copies of the run that the compiler takes.

The TPU compiler's cost analysis counts a loop's body once, whatever its trip count (a scan of
4 and of 8 matmuls of 256×512×512: 135.4 and 136.4 MFLOP), so a step over scanned layers, or
accumulating microbatches, is counted as one period of layers, one microbatch. A copy with
every loop unrolled counts them all, but holds every layer's activations at once: for
Llama-3.2-1B at 128 × 4096 tokens on a v4-64 it needs 133 GiB of temporaries and is refused.

So the step is compiled as copies of the same run with the model cut to few layers (the
config's `with_depths`: unscanned, MoE blocks where they were) and the loss's scan over
sequence chunks (`CausalLm.loss_chunks`) unrolled: one with one period of layers in every
stack (`scan_layout`: the layers after which the MoE placement repeats), and, for each stack
of more than one period, one with two periods in that stack. Counts are affine in each
stack's number of periods n_s, so

  c(n) = c(1, ..., 1) + Σ_s (n_s - 1) · (c(1, .., 2 in stack s, .., 1) - c(1, ..., 1))

The M microbatches' accumulation is unrolled whole in each copy where M ≤ 3. Beyond, each copy
is compiled twice with the accumulation a loop (counted once) of one and of two microbatches per
iteration (jax unrolls the remainder M mod 2 after the loop): the counts F + I and
F + (2 + M mod 2) I give the fixed part F and one microbatch's I, and the step is F + M I
(`extrapolate_microbatches`). The copies then hold two microbatches, not M: for the 8×8B
Mixtral at 16 microbatches, the whole unrolled copies needed more than this machine's 24 GiB.
Measured on the TPU compiler (tiny.gin's Mixtral, 8 microbatches, v4-8): FLOPs within 2e-5
of the whole unrolled copies', bytes 1.6% fewer (each iteration reads its microbatch from the
loop's input where the unrolled copy slices all of them), at half the compiling process's
memory (3.8 against 7.3 GB).

The copies are compiled with the TPU compiler's windowed einsums off (`aot.COUNTING_OPTIONS`):
it otherwise turns a matmul over fully sharded parameters into a loop over the shards, counted
once as well; a copy that still loops is reported, not counted (`Uncountable`). Measured on the
TPU compiler (a T5 MoE of 8 + 8 layers on a v4-8): FLOPs equal those of the whole model
compiled unscanned to 1e-6, bytes accessed to 0.13%; `tests/fit/test_step_count.py` checks
the same on XLA's CPU compiler.
"""

import dataclasses
import re
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

from upcycle.models import scan_layout

Counts = Tuple[float, float]   # (FLOPs, bytes accessed) per device and call


class Uncountable(Exception):
  """A shallow copy's compiled program still loops over matmuls, so its count is not every
  iteration's."""


_HEADER = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$')
_CALLED = re.compile(r'(?:calls|to_apply|body|condition)=%([\w.\-]+)'
                     r'|(?:branch_computations|called_computations)=\{([^}]*)\}')
_WHILE = re.compile(r'\bwhile\(.*?body=%([\w.\-]+)(?:.*?op_name="([^"]*)")?')
# A matmul, a convolution or a Pallas (Mosaic) kernel; other custom calls are annotations.
_WORK = re.compile(r'\b(?:dot|convolution)\(|custom_call_target="tpu_custom_call"')


def loops_over_matmuls(hlo: str) -> List[str]:
  """Where (op name, else body name) the compiled HLO text `hlo` has a while loop whose body,
  with every computation it calls, holds a matmul, a convolution or a Pallas kernel:
  work the cost analysis counts once. Loops of integer compares (`jnp.searchsorted`'s binary
  search, which megablox's kernels run) hold no FLOPs to speak of and are left out."""
  computations: Dict[str, List[str]] = {}
  name = None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(1)
      computations[name] = []
    elif line == '}':
      name = None
    elif name is not None:
      computations[name].append(line)

  def works(computation: str, seen: Set[str]) -> bool:
    if computation in seen or computation not in computations:
      return False
    seen.add(computation)
    for line in computations[computation]:
      if _WORK.search(line):
        return True
      for called in _CALLED.finditer(line):
        names = ([called.group(1)] if called.group(1) else
                 [n.strip().lstrip('%') for n in called.group(2).split(',')])
        if any(works(n, seen) for n in names):
          return True
    return False

  return [loop.group(2) or loop.group(1) for lines in computations.values() for line in lines
          for loop in [_WHILE.search(line)] if loop and works(loop.group(1), set())]


def periods(model_config: Any) -> Tuple[int, ...]:
  """Each stack's number of periods of layers, in `layer_stacks()` order."""
  return tuple(num_layers // scan_layout.period(sparse, num_layers)
               for _, _, _, num_layers, sparse in model_config.layer_stacks())


def loss_loops(objective: Any) -> bool:
  """Whether `objective` computes its loss in a loop (`CausalLm.loss_chunks` > 1)."""
  return getattr(objective, 'loss_chunks', 1) > 1


def shallow(objective: Any, stack_periods: Sequence[int]) -> Any:
  """`objective` with its model cut to `stack_periods[s]` periods of layers in stack s, and
  its loss's loop over chunks unrolled (`loss_loops`)."""
  config = objective.model.config
  depths = [scan_layout.period(sparse, num_layers) * k for (_, _, _, num_layers, sparse), k
            in zip(config.layer_stacks(), stack_periods)]
  unrolled = {'unroll_loss_chunks': True} if loss_loops(objective) else {}
  return dataclasses.replace(
      objective, model=objective.model.clone(config=config.with_depths(depths)), **unrolled)


def extrapolate(count_at: Callable[[Tuple[int, ...]], Counts],
                full_periods: Sequence[int]) -> Counts:
  """The count of the model with `full_periods`, from `count_at(stack periods)` of shallow
  copies: one call at one period per stack, one more per stack of more than one period."""
  ones = tuple(1 for _ in full_periods)
  base = count_at(ones)
  flops, accessed = base
  for s, n in enumerate(full_periods):
    if n > 1:
      two = count_at(ones[:s] + (2,) + ones[s + 1:])
      flops += (n - 1) * (two[0] - base[0])
      accessed += (n - 1) * (two[1] - base[1])
  return flops, accessed


# Above this many microbatches a copy's accumulation is counted from two loops
# (`extrapolate_microbatches`) instead of unrolled whole.
UNROLLED_MICROBATCHES = 3


def extrapolate_microbatches(count_with_unroll: Callable[[int], Counts],
                             microbatches: int) -> Counts:
  """The count of a step accumulating `microbatches` (M > `UNROLLED_MICROBATCHES`)
  microbatches, from `count_with_unroll(u)`: the copy compiled with its accumulation a loop of
  u microbatches per iteration, whose body the compiler counts once (F + u I, plus the M mod u
  that jax unrolls after the loop): F + M I."""
  one, two = count_with_unroll(1), count_with_unroll(2)
  per = [(b - a) / (1 + microbatches % 2) for a, b in zip(one, two)]
  return tuple(a + (microbatches - 1) * i for a, i in zip(one, per))
