"""The validation loss's standard error (`evaluation.ratio_stderr`) against closed forms."""

import math

import numpy as np

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
