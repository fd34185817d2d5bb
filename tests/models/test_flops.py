"""Training FLOPs per step against closed forms worked by hand (multiply-adds listed)."""

import dataclasses

import numpy as np

from upcycle.models import T5, ViT, flops
from upcycle.models.t5 import T5Config
from upcycle.models.vit import ViTConfig
from upcycle.moe import MoeConfig, capacity, grouping, routers
from upcycle.train import objectives

# d 8, heads x d_kv = 8, d_ff 12, vocab 32, 2 + 2 layers; batch 2, inputs 6, targets 4.
T5_TINY = T5Config(vocab_size=32, d_model=8, num_heads=2, d_kv=4, d_ff=12, num_encoder_layers=2,
                   num_decoder_layers=2)


def test_dense_t5_closed_form():
  # Per example, multiply-adds. Encoder layer: q,k,v,o 4*8*8*6 = 1536, MLP 3*8*12*6 = 1728,
  # scores and weighted sum 2*6*6*8 = 576 -> 3840. Decoder layer: self q,k,v,o 4*8*8*4 = 1024,
  # self scores 2*4*4*8 = 256, cross q,o 2*8*8*4 = 512, cross k,v on the inputs 2*8*8*6 = 768,
  # cross scores 2*4*6*8 = 384, MLP 3*8*12*4 = 1152 -> 4096. Logits 4*8*32 = 1024.
  macs = 2 * 3840 + 2 * 4096 + 1024
  assert T5_TINY.forward_flops(2, 6, 4) == 2 * 2 * macs == 67584
  assert flops.train_flops(67584) == 3 * 67584


def test_moe_blocks_count_capacity_slots_and_the_router():
  # Encoder layer 1: Expert Choice, one group per sequence (6 tokens), C = 2, E = 4:
  # capacity ceil(2 * 6 / 4) = 3 -> 2 groups x 4 experts x 3 slots = 24 expert MLPs (288
  # multiply-adds each) + router 12 tokens x 8 x 4, instead of 12 dense MLPs.
  # Decoder layer 1: Top-2, T5X capacity, max_group_size 4096 over 8 tokens: Flaxformer takes
  # max(8 // 4096, E) = 4 groups of 2; capacity min(max(round(1.25 * 2 / 4), 4), 2) = 2
  # -> 4 x 4 x 2 = 32 slots + router 8 x 8 x 4, instead of 8 dense MLPs.
  moe = dataclasses.replace(
      T5_TINY,
      encoder_moe=MoeConfig(num_experts=4, router=routers.ExpertsChoose(),
                            train_capacity_factor=2.0,
                            capacity_convention=capacity.Vmoe(multiple_of=1)),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2),
                            capacity_convention=capacity.T5X(), train_capacity_factor=1.25,
                            grouping=grouping.Flaxformer(max_group_size=4096)))
  encoder_extra = 24 * 288 + 12 * 8 * 4 - 12 * 288
  decoder_extra = 32 * 288 + 8 * 8 * 4 - 8 * 288
  assert (moe.forward_flops(2, 6, 4) - T5_TINY.forward_flops(2, 6, 4)
          == 2 * (encoder_extra + decoder_extra) == 2 * (3840 + 7168))


def test_vit_closed_form_and_objectives():
  cfg = ViTConfig(num_classes=5, image_size=(8, 8), patch_size=(4, 4), width=8, depth=2,
                  mlp_dim=12, num_heads=2)
  # Per image: patch embedding 4 patches x (4*4*3) x 8 = 1536; per block (5 tokens with cls):
  # q,k,v,o 4*8*8*5 = 1280, scores 2*5*5*8 = 400, MLP 2*8*12*5 = 960; head 8*5 = 40.
  macs = 1536 + 2 * (1280 + 400 + 960) + 40
  assert cfg.forward_flops(3) == 2 * 3 * macs == 41136
  images = np.zeros((3, 8, 8, 3), np.float32)
  seq2seq = objectives.Seq2Seq(T5(T5_TINY))
  batch = {'encoder_input_tokens': np.zeros((2, 6), np.int32),
           'decoder_input_tokens': np.zeros((2, 4), np.int32)}
  assert seq2seq.train_flops(batch) == 3 * 67584
  assert objectives.Classification(ViT(cfg)).train_flops({'image': images}) == 3 * 41136


def test_shared_expert_counts_on_every_token():
  # Encoder layer 1, shared d_ff 6: 12 tokens x 3*8*6 = 1728 multiply-adds; decoder layer 1, the
  # dense d_ff 12: 8 tokens x 3*8*12 = 2304. ViT block 1 (5 tokens, 3 images): 15 x 2*8*12.
  moe = MoeConfig(num_experts=4, router=routers.TopK(k=1))
  shared = dataclasses.replace(moe, shared_expert=True)
  t5 = lambda enc, dec: dataclasses.replace(T5_TINY, encoder_moe=enc, decoder_moe=dec)
  extra = (t5(dataclasses.replace(shared, shared_expert_d_ff=6), shared).forward_flops(2, 6, 4)
           - t5(moe, moe).forward_flops(2, 6, 4))
  assert extra == 2 * (1728 + 2304)
  vit = ViTConfig(num_classes=5, image_size=(8, 8), patch_size=(4, 4), width=8, depth=2,
                  mlp_dim=12, num_heads=2)
  assert (dataclasses.replace(vit, moe=shared).forward_flops(3)
          - dataclasses.replace(vit, moe=moe).forward_flops(3)) == 2 * 15 * 192
