"""Runs shared by the training tests."""

import os
import subprocess

import pytest

from tests.train.test_training import REPO, _train_command, run_t5

# One CPU device, XLA unoptimized: the subprocess runs of the resume tests.
RESUME_XLA_FLAGS = ('--xla_force_host_platform_device_count=1 '
                    '--xla_backend_optimization_level=0')


@pytest.fixture(scope='session')
def dense_t5_run(tmp_path_factory):
  """(model_dir, result) of 30 steps of a tiny dense T5; later tests start from its checkpoint."""
  model_dir = tmp_path_factory.mktemp('dense_t5')
  return model_dir, run_t5(model_dir)


@pytest.fixture(scope='session')
def straight_run(tmp_path_factory):
  """The model_dir of 12 uninterrupted steps of `_train_command`: the reference that killed
  and resumed runs (local and on GCS) must reproduce step by step."""
  model_dir = tmp_path_factory.mktemp('straight') / 'run'
  subprocess.run(_train_command(model_dir, 12), cwd=REPO, check=True, capture_output=True,
                 env={**os.environ, 'XLA_FLAGS': RESUME_XLA_FLAGS})
  return model_dir
