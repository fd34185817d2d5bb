"""A step's FLOPs and bytes with every layer counted, extrapolated from shallow copies of the
model (`upcycle/fit/step_count.py`), against the compiler's count of the whole model with
its layers unrolled (XLA's cost analysis on CPU; `tests/test_aot.py` runs it on libtpu's)."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import models, tree
from upcycle.moe import routers
from upcycle.moe.config import MoeConfig
from upcycle.fit import step_count

EVERY_OTHER = MoeConfig(num_experts=4, router=routers.TopK(k=2))
# 4 encoder layers (2 periods of 2) and 6 decoder layers (3 periods), so both stacks vary.
T5_MOE = models.T5Config(vocab_size=128, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                         num_encoder_layers=4, num_decoder_layers=6, encoder_moe=EVERY_OTHER,
                         decoder_moe=EVERY_OTHER, scan_layers=True)
LLAMA_MOE = models.LlamaConfig(vocab_size=128, d_model=32, d_ff=64, num_heads=2, num_kv_heads=1,
                               head_dim=16, num_layers=3, scan_layers=True,
                               moe=EVERY_OTHER, moe_layers='all')
TOKENS = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 127 + 1


@dataclasses.dataclass(frozen=True)
class Forward:
  """The smallest objective `step_count.shallow` cuts: a model."""
  model: Any


def compiled_counts(program) -> step_count.Counts:
  """(FLOPs, bytes accessed) XLA counts for the compiled `program` (a count it lacks fails
  here, where `upcycle.aot.compiled_counts` reads it as 0)."""
  cost = program.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost['flops']), float(cost['bytes accessed'])


def gradient_counts(objective: Forward) -> step_count.Counts:
  """(FLOPs, bytes accessed) the compiler counts for the gradient of the model's summed
  output, the backward pass included."""
  model = objective.model
  inputs = (TOKENS, TOKENS) if isinstance(model, models.T5) else (TOKENS,)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *inputs))

  def loss(p):
    out = model.apply(p, *inputs)
    return jnp.sum(out[0] if isinstance(out, tuple) else out)

  return compiled_counts(jax.jit(jax.grad(loss)).lower(params).compile())


@pytest.mark.parametrize('config', [T5_MOE, LLAMA_MOE], ids=['t5_every_other', 'llama_all'])
def test_shallow_copies_extrapolate_to_the_whole_models_count(config):
  objective = Forward(type_of(config)(config))
  full_periods = step_count.periods(config)
  extrapolated = step_count.extrapolate(
      lambda p: gradient_counts(step_count.shallow(objective, p)), full_periods)
  unrolled = gradient_counts(Forward(type_of(config)(dataclasses.replace(
      config, scan_layers=False))))
  scanned = gradient_counts(objective)
  np.testing.assert_allclose(extrapolated[0], unrolled[0], rtol=1e-6)
  np.testing.assert_allclose(extrapolated[1], unrolled[1], rtol=1e-6)
  # Why: the scanned model is counted with its loop body once.
  assert scanned[0] < 0.8 * unrolled[0]


def type_of(config):
  return models.T5 if isinstance(config, models.T5Config) else models.Llama


def test_periods_and_shallow_copies_keep_the_moe_blocks_in_place():
  assert step_count.periods(T5_MOE) == (2, 3) and step_count.periods(LLAMA_MOE) == (3,)
  cut = step_count.shallow(Forward(models.T5(T5_MOE)), (1, 2)).model.config
  assert (cut.num_encoder_layers, cut.num_decoder_layers, cut.scan_layers) == (2, 4, False)
  assert cut.sparse_layers('encoder') == (1,) and cut.sparse_layers('decoder') == (1, 3)
  listed = dataclasses.replace(T5_MOE, encoder_moe_layers=(0, 2))   # MoE first in each period
  cut = step_count.shallow(Forward(models.T5(listed)), (1, 1)).model.config
  assert cut.sparse_layers('encoder') == (0,) and cut.sparse_layers('decoder') == (1,)
  cut = step_count.shallow(Forward(models.Llama(LLAMA_MOE)), (1,)).model.config
  assert (cut.num_layers, cut.sparse_layers()) == (1, (0,))


def test_extrapolation_of_an_affine_count_is_exact_and_compiles_one_copy_per_stack():
  """count(n) = c + Σ_s b_s n_s: one copy at one period everywhere, one per stack of more
  than one period."""
  calls = []

  def count_at(periods):
    calls.append(periods)
    return 5.0 + 3.0 * periods[0] + 7.0 * periods[1] + 11.0 * periods[2], 2.0 * periods[0]

  assert step_count.extrapolate(count_at, (6, 1, 4)) == (5.0 + 18 + 7 + 44, 12.0)
  assert calls == [(1, 1, 1), (2, 1, 1), (1, 1, 2)]


def test_loops_over_matmuls_are_found_in_compiled_hlo_and_binary_searches_are_not():
  """A copy whose compiled program still loops over matmuls would be counted once per loop
  (`upcycle.aot` then gives no roofline); `jnp.searchsorted`'s binary search, which
  megablox's kernels run, is a loop of integer compares and is left out."""
  def scanned(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

  hlo = lambda fn, *shapes: jax.jit(fn).lower(*[jnp.ones(s) for s in shapes]).compile().as_text()
  assert step_count.loops_over_matmuls(hlo(scanned, (3, 8, 8), (4, 8))) == [
      'jit(scanned)/while']
  unrolled = lambda w, x: x @ w[0] @ w[1] @ w[2]
  assert step_count.loops_over_matmuls(hlo(unrolled, (3, 8, 8), (4, 8))) == []
  search = hlo(jnp.searchsorted, (100,), (9,))
  assert 'while(' in search and step_count.loops_over_matmuls(search) == []


def test_a_chunked_loss_is_counted_whole_in_the_shallow_copy():
  """`CausalLm.loss_chunks`: the compiler counts the loss's loop over chunks once (less than
  the whole-logits loss); the counting copy unrolls it, so it counts the whole-logits loss's
  FLOPs, and not one more projection forward (2 B L d V: no chunk's logits are computed
  again in the backward, `losses.chunked_cross_entropy`), and its program has no loop over
  matmuls left."""
  from upcycle.train import objectives  # pylint: disable=g-import-not-at-top
  config = models.LlamaConfig(vocab_size=512, d_model=32, d_ff=64, num_heads=2, num_kv_heads=1,
                              head_dim=16, num_layers=2)
  batch = {'decoder_input_tokens': TOKENS, 'decoder_target_tokens': TOKENS,
           'decoder_loss_weights': np.ones(TOKENS.shape, np.float32)}

  def compiled(objective):
    params = jax.eval_shape(lambda: objective.model.init(jax.random.PRNGKey(0), TOKENS))
    loss = lambda p: objective.forward(p['params'], batch, train=False)[0]['loss']
    return jax.jit(jax.grad(loss)).lower(params).compile()

  def flops(program):
    return compiled_counts(program)[0]

  whole = flops(compiled(objectives.CausalLm(models.Llama(config))))
  chunked = objectives.CausalLm(models.Llama(config), loss_chunks=4)
  looped = compiled(chunked)
  assert step_count.loss_loops(chunked) and flops(looped) < whole
  assert step_count.loops_over_matmuls(looped.as_text())
  copy = compiled(step_count.shallow(chunked, step_count.periods(config)))
  assert not step_count.loops_over_matmuls(copy.as_text())
  projection = 2 * TOKENS.size * config.d_model * config.vocab_size
  assert abs(flops(copy) - whole) < projection / 4, (flops(copy), whole, projection)


def test_microbatches_counted_from_two_loops_equal_the_unrolled_accumulation():
  """Five microbatches of a Llama MoE's train step (AdamW): the compiler's counts of the
  accumulation as a loop of one and of two microbatches per iteration (the remainder unrolled
  by jax) give the count of all five unrolled, FLOPs and bytes (XLA's CPU compiler; TPU's in
  tests/test_aot.py)."""
  import optax  # pylint: disable=g-import-not-at-top
  from upcycle.train import objectives, step  # pylint: disable=g-import-not-at-top
  from upcycle.train_state import TrainState  # pylint: disable=g-import-not-at-top
  microbatches = 5
  objective = objectives.CausalLm(models.Llama(dataclasses.replace(LLAMA_MOE, scan_layers=False)))
  tokens = np.tile(TOKENS, (2 * microbatches, 1))   # 4 rows of 16 per microbatch
  batch = {'decoder_input_tokens': tokens, 'decoder_target_tokens': tokens,
           'decoder_loss_weights': np.ones(tokens.shape, np.float32),
           'decoder_segment_ids': np.ones(tokens.shape, np.int32),
           'decoder_positions': np.tile(np.arange(16, dtype=np.int32), (4 * microbatches, 1))}
  optimizer = optax.adamw(1e-3)
  params = tree.unbox(jax.eval_shape(
      lambda: objectives.init_params(objective, jax.random.PRNGKey(0), batch)))
  train_state = TrainState(jnp.zeros((), jnp.int32), params,
                           jax.eval_shape(optimizer.init, params))

  def compiled(unroll):
    train_step = step.make_train_step(objective, optimizer, lambda s: 1e-3,
                                      num_microbatches=microbatches, microbatch_unroll=unroll)
    return jax.jit(train_step).lower(train_state, batch, jax.random.PRNGKey(1)).compile()

  programs = {unroll: compiled(unroll) for unroll in (1, 2, microbatches)}
  assert len(step_count.loops_over_matmuls(programs[1].as_text())) == 1
  assert len(step_count.loops_over_matmuls(programs[2].as_text())) == 1
  assert not step_count.loops_over_matmuls(programs[microbatches].as_text())
  extrapolated = step_count.extrapolate_microbatches(lambda u: compiled_counts(programs[u]),
                                                         microbatches)
  unrolled = compiled_counts(programs[microbatches])
  # Within 1% (one microbatch is 20%): the unrolled copy shares what a loop iteration redoes.
  # Its first accumulation adds to zeros, which XLA folds away; XLA's CPU backend copies each
  # attention kernel transposed for its backward product once there, in every iteration of the
  # loop (which the extrapolation counts, as the loop runs); each iteration folds its index
  # into the key.
  np.testing.assert_allclose(extrapolated, unrolled, rtol=1e-2)
  assert compiled_counts(programs[1])[0] < 0.5 * unrolled[0]   # why: the loop's body counted once
