"""Loss, schedules and the few-shot probe against closed-form / numpy / scikit-learn references."""

import jax
import numpy as np
import pytest
from sklearn.linear_model import Ridge

from upcycle import fields
from upcycle.train import fewshot, losses, optimizers


def numpy_cross_entropy(logits, targets, weights, z_loss, smoothing):
  vocab = logits.shape[-1]
  log_z = np.log(np.exp(logits).sum(-1))
  log_p = logits - log_z[..., None]
  soft = np.full(logits.shape, smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1 - smoothing, axis=-1)
  entropy = -(soft * np.log(soft)).sum(-1) if smoothing else 0.0
  per_token = -(soft * log_p).sum(-1) - entropy + z_loss * log_z ** 2
  return (per_token * weights).sum()


@pytest.mark.parametrize('z_loss,smoothing', [(0.0, 0.0), (1e-4, 0.0), (1e-4, 0.1)])
def test_cross_entropy_against_numpy(z_loss, smoothing):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
  targets = rng.integers(0, 7, (2, 5))
  weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
  out = losses.cross_entropy(logits, targets, weights, z_loss, smoothing)
  np.testing.assert_allclose(out['loss'], numpy_cross_entropy(logits, targets, weights, z_loss,
                                                              smoothing), rtol=1e-5)
  np.testing.assert_allclose(out['weight_sum'], weights.sum())
  np.testing.assert_allclose(out['correct'],
                             ((logits.argmax(-1) == targets) * weights).sum())


def _logits_products(jaxpr, vocab: int) -> int:
  """The products in `jaxpr`, and every jaxpr inside it, whose output is a `[batch, n, vocab]`
  block of logits."""
  from jax.extend import core  # pylint: disable=g-import-not-at-top
  here = sum(1 for eqn in jaxpr.eqns if eqn.primitive.name == 'dot_general'
             and eqn.outvars[0].aval.ndim == 3 and eqn.outvars[0].aval.shape[-1] == vocab)
  return here + sum(_logits_products(sub, vocab) for sub in core.subjaxprs(jaxpr))


@pytest.mark.parametrize('z_loss,smoothing', [(0.0, 0.0), (1e-4, 0.1)])
def test_chunked_cross_entropy_equals_numpy_and_the_whole_loss_gradients(z_loss, smoothing):
  """Four slices of the sequence at a time: the numpy loss of the whole logits, and the
  gradients of the whole loss with respect to the features and the output kernel (computed
  in the forward pass, scaled by the loss's cotangent in the backward: here 1, and 0.25)."""
  rng = np.random.default_rng(1)
  features = rng.normal(size=(2, 8, 6)).astype(np.float32)
  kernel = rng.normal(size=(6, 11)).astype(np.float32)
  targets = rng.integers(0, 11, (2, 8))
  weights = (rng.random((2, 8)) > 0.3).astype(np.float32)
  chunked = lambda f, k: losses.chunked_cross_entropy(
      f, lambda head, x: x @ head, k, targets, weights, num_chunks=4, z_loss=z_loss,
      label_smoothing=smoothing)
  whole = lambda f, k: losses.cross_entropy(f @ k, targets, weights, z_loss, smoothing)
  out = chunked(features, kernel)
  np.testing.assert_allclose(out['loss'], numpy_cross_entropy(
      features @ kernel, targets, weights, z_loss, smoothing), rtol=1e-5)
  for name in ('z_loss', 'correct', 'weight_sum'):
    np.testing.assert_allclose(out[name], whole(features, kernel)[name], rtol=1e-5)
  for scale in (1.0, 0.25):
    grad = lambda fn: jax.grad(lambda f, k: scale * fn(f, k)['loss'], argnums=(0, 1))(
        features, kernel)
    for got, want in zip(grad(chunked), grad(whole)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The logits are computed once, in the forward pass's loop over slices: the backward has
  # nothing to compute again.
  differentiated = jax.make_jaxpr(jax.grad(lambda f, k: chunked(f, k)['loss'], argnums=(0, 1)))
  assert _logits_products(differentiated(features, kernel).jaxpr, vocab=11) == 1
  with pytest.raises(ValueError, match='num_chunks=3 does not divide the sequence length 8'):
    losses.chunked_cross_entropy(features, lambda head, x: x @ head, kernel, targets,
                                 num_chunks=3)


def test_label_smoothed_loss_is_zero_at_the_smoothed_target():
  vocab, smoothing = 4, 0.2
  target_probs = np.array([1 - smoothing] + [smoothing / 3] * 3)
  out = losses.cross_entropy(np.log(target_probs)[None], np.array([0]), None, 0.0, smoothing)
  np.testing.assert_allclose(out['loss'], 0.0, atol=1e-6)


def test_rsqrt_schedule_is_t5x_inverse_square_root():
  schedule = optimizers.rsqrt_schedule(1.0, warmup_steps=10_000)
  np.testing.assert_allclose([schedule(0), schedule(10_000), schedule(40_000)],
                             [0.01, 0.01, 0.005], rtol=1e-6)


def test_warmup_cosine_and_linear_decay():
  cosine = optimizers.warmup_decay_schedule(1.0, 10, 110, 'cosine')
  linear = optimizers.warmup_decay_schedule(1.0, 10, 110, 'linear')
  np.testing.assert_allclose([cosine(0), cosine(5), cosine(10), cosine(60), cosine(110)],
                             [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
  np.testing.assert_allclose([linear(5), linear(60), linear(110)], [0.5, 0.5, 0.0], atol=1e-6)


def test_adafactor_has_t5x_defaults():
  adafactor = optimizers.Adafactor()
  assert (adafactor.decay_rate, adafactor.clipping_threshold, adafactor.factored,
          adafactor.multiply_by_parameter_scale, adafactor.momentum) == (0.8, 1.0, True, True, None)


def test_ridge_regression_matches_scikit_learn():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 6))
  labels = rng.integers(0, 3, 40)
  w, b = fewshot.ridge_fit(x, labels, 3, l2_reg=2.5)
  reference = Ridge(alpha=2.5, fit_intercept=True).fit(x, 2 * np.eye(3)[labels] - 1)
  np.testing.assert_allclose(w, reference.coef_.T, atol=1e-10)
  np.testing.assert_allclose(b, reference.intercept_, atol=1e-10)


def test_fewshot_probe_separates_separable_classes_and_counts_shots():
  rng = np.random.default_rng(1)
  centers = np.eye(4, 8) * 10
  labels = np.repeat(np.arange(4), 20)
  x = centers[labels] + rng.normal(size=(80, 8))
  assert fewshot.fewshot_accuracy(x, labels, x, labels, shots=5, num_classes=4,
                                  l2_reg=1.0) == 1.0
  index = fewshot.select_shots(labels, 5, 4)
  assert np.bincount(labels[index]).tolist() == [5, 5, 5, 5]
  with pytest.raises(ValueError, match='only 20'):
    fewshot.select_shots(labels, 25, 4)


@pytest.mark.parametrize('build, error', [
    (lambda: optimizers.warmup_decay_schedule('1e-3', 10, 100),
     "optimizers.warmup_decay_schedule.peak_learning_rate (LEARNING_RATE) = '1e-3': expected a "
     'number >= 0.0.'),
    (lambda: optimizers.warmup_decay_schedule(1e-3, 10.5, 100),
     'optimizers.warmup_decay_schedule.warmup_steps (WARMUP_STEPS) = 10.5: expected an integer '
     '>= 0.'),
    (lambda: optimizers.constant_schedule(None),
     'optimizers.constant_schedule.learning_rate = None: expected a number >= 0.0.'),
    (lambda: optimizers.rsqrt_schedule(-1.0),
     'optimizers.rsqrt_schedule.base_learning_rate = -1.0: expected a number >= 0.0.'),
    (lambda: optimizers.BigVisionAdafactor(optimizers.constant_schedule(), learning_rate='1'),
     "optimizers.BigVisionAdafactor.learning_rate = '1': expected a number >= 0.0."),
])
def test_a_learning_rate_or_steps_of_the_wrong_type_are_refused_naming_the_binding(build, error):
  with pytest.raises(fields.ConfigError) as refused:
    build()
  assert str(refused.value) == error
