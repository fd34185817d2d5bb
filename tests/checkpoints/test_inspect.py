"""`python -m upcycle.inspect` and the model descriptions it prints."""

import dataclasses
import json

from tests.checkpoints import helpers, t5x_writer
from upcycle import inspect, tree
from upcycle.checkpoints import describe
from upcycle.models import abstract_params
from upcycle.moe.config import MoeConfig


def test_json_summary_of_a_t5x_checkpoint(tmp_path, capsys):
  params = helpers.random_params(helpers.TINY_T5)
  t5x_writer.write(str(tmp_path), 6, params, t5x_writer.adafactor_states(params))
  assert inspect.main([str(tmp_path), '--json']) == 0
  info = json.loads(capsys.readouterr().out)
  assert info['format'] == 't5x' and info['step'] == 6 and info['optimizer_state']
  assert info['num_parameters'] == sum(p.size for p in tree.flatten(params).values())
  assert info['num_bytes'] == 4 * info['num_parameters']
  assert {'path': 'token_embedder/embedding', 'shape': [32, 8], 'dtype': 'float32'} in info[
      'params']
  assert info['model'] == ('T5 v1.1: 2+2 layers, d_model 8, 2 heads (d_kv 4), d_ff 12, '
                           'vocab 32, dense')


def test_text_output_and_errors(tmp_path, capsys):
  assert inspect.main([helpers.T5X_FIXTURE]) == 0
  out = capsys.readouterr().out
  assert 'format:          t5x' in out and 'step:            1' in out
  assert 'optimizer state: yes' in out
  assert inspect.main([str(tmp_path)]) == 1
  assert 'unknown checkpoint format' in capsys.readouterr().err


def test_describes_moe_layers():
  config = dataclasses.replace(
      helpers.TINY_T5, num_encoder_layers=4, num_decoder_layers=4,
      encoder_moe=MoeConfig(num_experts=4),
      decoder_moe=MoeConfig(num_experts=4, router='tokens_choose'))
  text = describe.describe(abstract_params(config))
  assert text == ('T5 v1.1: 4+4 layers, d_model 8, 2 heads (d_kv 4), d_ff 12, vocab 32, '
                  'MoE at encoder 1,3; decoder 1,3, E=4')
  vit = dataclasses.replace(helpers.TINY_VIT, depth=4, moe=MoeConfig(num_experts=8))
  assert describe.describe(abstract_params(vit)) == (
      'ViT: depth 4, width 8, 2 heads, mlp 12, patch 4x4, 4 tokens (2x2), pool token, '
      '5 classes, MoE at 1,3, E=8')
