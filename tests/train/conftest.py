"""Runs shared by the training tests."""

import pytest

from tests.train.test_training import run_t5


@pytest.fixture(scope='session')
def dense_t5_run(tmp_path_factory):
  """(model_dir, result) of 30 steps of a tiny dense T5; later tests start from its checkpoint."""
  model_dir = tmp_path_factory.mktemp('dense_t5')
  return model_dir, run_t5(model_dir)
