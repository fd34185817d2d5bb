"""Runs shared by the training tests."""

import os
import subprocess

import pytest

from tests.helpers import REPO
from tests.train.helpers import ONE_DEVICE_XLA_FLAGS, run_t5, train_command


@pytest.fixture(scope='session')
def dense_t5_run(tmp_path_factory):
  """(model_dir, result) of 30 steps of a tiny dense T5; later tests start from its checkpoint."""
  model_dir = tmp_path_factory.mktemp('dense_t5')
  return model_dir, run_t5(model_dir)


@pytest.fixture(scope='session')
def straight_run(tmp_path_factory):
  """The model_dir of 12 uninterrupted steps of `train_command`: the reference that killed
  and resumed runs (local and on GCS) must reproduce step by step."""
  model_dir = tmp_path_factory.mktemp('straight') / 'run'
  subprocess.run(train_command(model_dir, 12), cwd=REPO, check=True, capture_output=True,
                 env={**os.environ, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS})
  return model_dir
