"""The one-line model description of a parameter tree (`upcycle.checkpoints.describe`), as
`python -m upcycle.describe` prints it."""

import dataclasses

import numpy as np

from tests.checkpoints import helpers
from upcycle.checkpoints import describe
from upcycle.models.families import abstract_params
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


def test_summary_counts_parameters_and_expert_blocks():
  """The phrase restore errors quote: a decoder stack alone is a Llama; 4 experts of 3 x 5
  kernels in two blocks plus a 7 x 3 embedding: 2 x 4 x 15 + 21 = 141 parameters."""
  expert = {'expert': {'wi_0': {'kernel': np.zeros((4, 3, 5))}}}
  moe = {'token_embedder': {'embedding': np.zeros((7, 3))},
         'decoder': {'layers_0': {'mlp': expert}, 'layers_1': {'mlp': expert}}}
  assert describe.model_kind(moe) == 'llama'
  assert describe.summary(moe) == (
      'a Llama model, 141 parameters, an MoE with 4 experts in 2 blocks')
  assert describe.summary({'encoder': {'layers_0': {'x': np.zeros((1000, 1000))}}}) == (
      'a T5 model, 1.0M parameters, dense (no expert leaves)')


def test_names_of_no_family_are_described_as_unknown():
  params = {'dense': {'kernel': np.zeros((2, 3))}}
  assert describe.model_kind(params) is None
  assert describe.describe(params) == (
      'unknown model (1 parameters, none with T5, Llama or ViT names)')
  assert describe.summary(params) == 'a unknown model, 6 parameters, dense (no expert leaves)'
