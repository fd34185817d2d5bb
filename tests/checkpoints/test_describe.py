"""The one-line model description of a parameter tree (`upcycle.checkpoints.describe`), as
`python -m upcycle.inspect` prints it."""

import dataclasses

from tests.checkpoints import helpers
from upcycle.checkpoints import describe
from upcycle.families import abstract_params
from upcycle.moe import routers
from upcycle.moe.config import MoeConfig


def test_describes_moe_layers():
  config = dataclasses.replace(
      helpers.CHECKPOINT_T5, num_encoder_layers=4, num_decoder_layers=4,
      encoder_moe=MoeConfig(num_experts=4),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK()))
  text = describe.describe(abstract_params(config))
  assert text == ('T5 v1.1: 4+4 layers, d_model 8, 2 heads (d_kv 4), d_ff 12, vocab 32, '
                  'MoE at encoder 1,3; decoder 1,3, E=4')
  vit = dataclasses.replace(helpers.CHECKPOINT_VIT, depth=4, moe=MoeConfig(num_experts=8))
  assert describe.describe(abstract_params(vit)) == (
      'ViT: depth 4, width 8, 2 heads, mlp 12, patch 4x4, 4 tokens (2x2), pool token, '
      '5 classes, MoE at 1,3, E=8')
