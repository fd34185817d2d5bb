"""`upcycle.checkpoints.load`: format detection, model checks, and errors that write nothing."""

import dataclasses
import os

import numpy as np
import pytest

from tests.checkpoints import helpers, t5x_writer
from upcycle import checkpoints, pretrained, tree
from upcycle.checkpoints import CheckpointError, orbax


@pytest.fixture(scope='module')
def t5x_dir(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp('t5x_model'))
  t5x_writer.write(model_dir, 3, helpers.random_params(helpers.CHECKPOINT_T5))
  return model_dir


def test_detects_every_format(hf_t5, hf_vit, t5x_dir, tmp_path):
  params = helpers.random_params(helpers.CHECKPOINT_VIT)
  np.savez(tmp_path / 'bv.npz', **tree.flatten(params))
  with orbax.CheckpointManager(str(tmp_path / 'run')) as manager:
    manager.save(4, params)
  cases = {hf_t5[0]: 'hf', hf_vit[0]: 'hf', t5x_dir: 't5x',
           os.path.join(t5x_dir, 'checkpoint_3'): 't5x',
           os.path.join(t5x_dir, 'checkpoint_3', 'checkpoint'): 't5x',
           helpers.T5X_FIXTURE: 't5x', str(tmp_path / 'bv.npz'): 'big_vision',
           str(tmp_path / 'run'): 'orbax', str(tmp_path / 'run' / '4'): 'orbax'}
  for path, kind in cases.items():
    assert checkpoints.detect_format(path) == kind, path
    assert checkpoints.load(path).format == kind, path
  assert pretrained.load(hf_vit[0]).model_config.num_classes == 5
  # The reader alone describes the model without building it (checkpoints never import models).
  assert checkpoints.load(hf_vit[0]).description['num_classes'] == 5
  assert checkpoints.load(hf_vit[0]).model_config is None


def test_unknown_format_lists_what_was_looked_for(tmp_path):
  (tmp_path / 'weights.bin').write_bytes(b'\0' * 16)
  before = helpers.snapshot(str(tmp_path))
  with pytest.raises(CheckpointError) as e:
    checkpoints.load(str(tmp_path))
  message = str(e.value)
  assert message.startswith(f'{tmp_path}: unknown checkpoint format')
  for looked_for in ("'checkpoint' msgpack", "'state/_METADATA'", '_CHECKPOINT_METADATA',
                     'config.json', '.npz', "found ['weights.bin']"):
    assert looked_for in message
  assert helpers.snapshot(str(tmp_path)) == before


def test_vit_checkpoint_given_for_a_t5_model(hf_vit):
  before = helpers.snapshot(hf_vit[0])
  with pytest.raises(CheckpointError) as e:
    pretrained.load(hf_vit[0], model_config=helpers.CHECKPOINT_T5)
  message = str(e.value)
  assert message.startswith(hf_vit[0]) and 'holds a VIT, the model is a T5' in message
  assert 'missing: decoder/' in message and 'unexpected: Transformer/' in message
  assert helpers.snapshot(hf_vit[0]) == before


def test_shape_that_does_not_fit_the_model_config(t5x_dir):
  config = dataclasses.replace(helpers.CHECKPOINT_T5, d_ff=16)
  before = helpers.snapshot(t5x_dir)
  with pytest.raises(CheckpointError) as e:
    pretrained.load(t5x_dir, model_config=config)
  message = str(e.value)
  assert 'checkpoint_3' in message
  assert "parameter 'decoder/layers_0/mlp/wi_0/kernel'" in message
  assert 'Expected (8, 16), found (8, 12)' in message
  assert helpers.snapshot(t5x_dir) == before
  pretrained.load(t5x_dir, model_config=helpers.CHECKPOINT_T5)  # The right config passes.


def test_bad_format_argument(t5x_dir):
  for load in (checkpoints.load, pretrained.load):
    with pytest.raises(CheckpointError, match=rf"^{t5x_dir}: unknown format argument\. Expected "
                       r"\('t5x', 't5x_orbax', 'orbax', 'hf', 'vit_jax', 'big_vision'\), found "
                       r"'tf'\. Pass one of them, or None to detect it\.$"):
      load(t5x_dir, format='tf')
