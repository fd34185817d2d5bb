"""The validation loss's standard error (`evaluation.ratio_stderr`) against closed forms, and
the trainer's cached validation batches against re-reading the split."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import CountingPipeline
from upcycle.train.evaluation import ratio_stderr


def test_equal_batches_give_the_standard_error_of_the_batch_means():
  rng = np.random.default_rng(0)
  means = rng.normal(2.5, 0.1, size=16)
  tokens = np.full(16, 250.0)
  expected = np.std(means, ddof=1) / math.sqrt(16)
  assert math.isclose(ratio_stderr(means * tokens, tokens), expected, rel_tol=1e-12)


def test_unequal_batches_use_the_ratio_estimator():
  # R = 9 / 4; residuals a - R w = -1.25, -0.25, 1.5; sqrt(3 / 2 * 3.875) / 4.
  assert math.isclose(ratio_stderr([1.0, 2.0, 6.0], [1.0, 1.0, 2.0]),
                      math.sqrt(1.5 * 3.875) / 4, rel_tol=1e-12)


def test_one_batch_has_no_standard_error():
  assert math.isnan(ratio_stderr([3.0], [2.0]))


@pytest.mark.slow
def test_cached_validation_batches_give_the_numbers_of_reading_the_split_again(tmp_path):
  from tests.train.helpers import TRAINING_T5, text   # pylint: disable=g-import-not-at-top
  from upcycle.models import T5   # pylint: disable=g-import-not-at-top
  from upcycle.train.objectives import Seq2Seq   # pylint: disable=g-import-not-at-top
  from upcycle.train.optimizers import Adafactor   # pylint: disable=g-import-not-at-top
  from upcycle.train.trainer import Trainer, TrainConfig   # pylint: disable=g-import-not-at-top

  def eval_step(params, batch):   # sums of the batch's token ids: any change of data shows
    targets = batch['decoder_target_tokens']
    return {'loss': jnp.sum(targets * params), 'z_loss': jnp.sum(batch['encoder_input_tokens']),
            'weight_sum': jnp.sum(targets > 0), 'correct': jnp.sum(targets % 7 == 0)}

  def evaluations(cache):
    validation = CountingPipeline(text('validation'))
    config = TrainConfig(str(tmp_path / str(cache)), train_steps=2, batch_size=8,
                         eval_batches=3, cache_eval_batches=cache)
    trainer = Trainer(Seq2Seq(T5(TRAINING_T5)), Adafactor(), config, text('train'), validation)
    trainer.built.__dict__['eval_step'] = eval_step   # the run's cached jitted step, replaced
    return [trainer.evaluate(params) for params in (1.0, 2.0, 1.0)], validation.reads

  cached, reads_cached = evaluations(True)
  fresh, reads_fresh = evaluations(False)
  assert cached == fresh and cached[0] == cached[2] != cached[1]
  assert cached[0]['batches'] == 3
  assert (reads_cached, reads_fresh) == (1, 3)


@pytest.mark.slow
def test_every_validation_example_counts_whatever_the_batch_size(tmp_path):
  """Batches of 16, 40 and 128 over the same split, and of 128 evaluated in 4 microbatches of
  32: the last partial batch is padded and masked, so loss and accuracy are the same and
  padding counts nowhere."""
  from tests.train.helpers import TRAINING_T5, text   # pylint: disable=g-import-not-at-top
  from upcycle.models import T5   # pylint: disable=g-import-not-at-top
  from upcycle import partitioning   # pylint: disable=g-import-not-at-top
  from upcycle.train import evaluation   # pylint: disable=g-import-not-at-top
  from upcycle.train.objectives import Seq2Seq, init_params   # pylint: disable=g-import-not-at-top
  from upcycle.train.step import make_eval_step   # pylint: disable=g-import-not-at-top
  import jax   # pylint: disable=g-import-not-at-top
  objective = Seq2Seq(T5(TRAINING_T5))
  validation = text('validation')
  examples = sum(int(b[evaluation.EXAMPLE_MASK].sum())
                 for b in evaluation.host_batches(validation, 16, 0, 0))
  assert examples % 16 and examples % 40 and examples % 128   # partial last batches
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  batch = next(evaluation.host_batches(validation, 16, 1, 0))
  params = jax.tree.map(lambda x: x.value if hasattr(x, 'value') else x,
                        init_params(objective, jax.random.PRNGKey(0), batch))
  step = jax.jit(make_eval_step(objective))
  results = {size: evaluation.evaluate(step, params, validation, batch_size=size, mesh=mesh)
             for size in (16, 40, 128)}
  assert {s: r['batches'] for s, r in results.items()} == {
      s: -(-examples // s) for s in (16, 40, 128)}
  results['128 / 4'] = evaluation.evaluate(jax.jit(make_eval_step(objective, 4)), params,
                                           validation, batch_size=128, mesh=mesh)
  assert results['128 / 4']['batches'] == results[128]['batches']
  for size in (40, 128, '128 / 4'):
    assert math.isclose(results[size]['loss'], results[16]['loss'], rel_tol=1e-5)
    assert math.isclose(results[size]['accuracy'], results[16]['accuracy'], rel_tol=1e-5)
  last = list(evaluation.host_batches(validation, 128, 0, 0))[-1]
  real = examples % 128
  assert last[evaluation.EXAMPLE_MASK].tolist() == [1.0] * real + [0.0] * (128 - real)
  assert not last['decoder_loss_weights'][real:].any()


def test_input_use_is_the_loss_with_another_rows_input_minus_its_own():
  """A step whose loss pairs a number of each row's targets with one of its input (their
  tokens' sums mod 97): the swapped pass pairs it with the row before's (numpy's roll), over
  the same batches."""
  from tests.train.helpers import text   # pylint: disable=g-import-not-at-top
  from upcycle import partitioning   # pylint: disable=g-import-not-at-top
  from upcycle.train import evaluation   # pylint: disable=g-import-not-at-top
  import jax   # pylint: disable=g-import-not-at-top

  def first_tokens(batch):
    return batch['decoder_target_tokens'].sum(1) % 97, batch['encoder_input_tokens'].sum(1) % 97

  @jax.jit
  def eval_step(params, batch):
    targets, inputs = (x.astype(jnp.float32) for x in first_tokens(batch))
    return {'loss': params * jnp.sum((targets - inputs) ** 2), 'z_loss': jnp.zeros(()),
            'weight_sum': jnp.sum(batch['decoder_target_tokens'] > 0),
            'correct': jnp.sum(targets == inputs)}

  validation = text('validation')
  mesh = partitioning.make_mesh(devices=jax.devices()[:1])
  got = evaluation.input_use(eval_step, 1.0, validation, batch_size=16, mesh=mesh,
                             max_batches=3)
  own, other, weights = [], [], []
  for batch in evaluation.host_batches(validation, 16, 3, 0):
    targets, inputs = first_tokens(batch)
    own.append(np.sum((targets - inputs) ** 2))
    other.append(np.sum((targets - np.roll(inputs, 1)) ** 2))
    weights.append(np.sum(batch['decoder_target_tokens'] > 0))
  own, other, weights = map(np.array, (own, other, weights))
  assert len(own) == 3 and not np.allclose(own, other)
  assert got['loss'] == pytest.approx(own.sum() / weights.sum(), rel=1e-6)   # evaluate's, too
  assert got['other_row_inputs/loss'] == pytest.approx(other.sum() / weights.sum(), rel=1e-6)
  assert got['input_use'] == pytest.approx((other - own).sum() / weights.sum(), rel=1e-6)
  assert got['input_use_stderr'] == pytest.approx(ratio_stderr(other - own, weights), rel=1e-5)


def test_input_use_of_a_model_without_an_encoder_is_refused_in_one_line():
  from upcycle import eval as eval_main, fields   # pylint: disable=g-import-not-at-top
  from upcycle.models.llama import Llama   # pylint: disable=g-import-not-at-top
  from upcycle.train.objectives import CausalLm   # pylint: disable=g-import-not-at-top
  with pytest.raises(fields.ConfigError, match=r'^eval_script\.evaluate\.other_row_inputs = '
                     r'True swaps encoder inputs between rows; CausalLm has no encoder\. Fix: '
                     r'set it False \(a seq2seq objective only\)\.$'):
    eval_main.evaluate(objective=CausalLm(Llama(None)), eval_data=None, checkpoint_path='/none',
                       batch_size=8, other_row_inputs=True)
