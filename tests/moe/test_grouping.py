"""Capacity conventions and routing groups against values worked out by hand.

't5x' (Flaxformer's MoeLayer): max(round(C * S / E), min_expert_capacity), no K.
'vmoe': ceil(K * C * S / E) rounded up to `capacity_multiple_of`.
Groups by Flaxformer's rule: the smallest n >= max(T // N, E * R) with T % n == 0 and
n % (E * R) == 0, after padding T to a multiple of E * R.
"""

import pytest

from upcycle.moe import MoeConfig, capacity, grouping, routers


@pytest.mark.parametrize('router,factor,tokens,experts,t5x,vmoe', [
    # Top-2, C = 1.25, S = 4096, E = 32: 1.25 * 4096 / 32 = 160 (t5x) vs 2 * 160 = 320 (vmoe).
    (routers.TopK(k=2), 1.25, 4096, 32, 160, 320),
    # 1.25 * 16 / 32 = 0.625 -> 1 -> the minimum 4; vmoe: ceil(1.25) = 2 -> multiple of 4.
    (routers.TopK(k=2), 1.25, 16, 32, 4, 4),
    # 1.25 * 72 / 8 = 11.25 -> 11; vmoe: ceil(22.5) = 23 -> 24.
    (routers.TopK(k=2), 1.25, 72, 8, 11, 24),
    # Top-1, 1.0 * 100 / 8 = 12.5 -> 12 (Python's round, half to even); vmoe: 13 -> 16.
    (routers.TopK(k=1), 1.0, 100, 8, 12, 16),
    # Expert Choice counts K = 1 in both: 2 * 64 / 32 = 4.
    (routers.ExpertsChoose(), 2.0, 64, 32, 4, 4),
    # 2 * 200 / 16 = 25; vmoe rounds up to 28.
    (routers.ExpertsChoose(), 2.0, 200, 16, 25, 28),
    # Capped at the group size: t5x max(round(2 * 2 / 2), 4) = 4 -> 2; vmoe 4 -> 2.
    (routers.TopK(k=2), 2.0, 2, 2, 2, 2),
])
def test_capacity_conventions(router, factor, tokens, experts, t5x, vmoe):
  for convention, expected in ((capacity.T5X(), t5x), (capacity.Vmoe(), vmoe)):
    config = MoeConfig(num_experts=experts, router=router, train_capacity_factor=factor,
                       capacity_convention=convention)
    assert config.capacity(tokens, deterministic=False) == expected, convention


def test_t5x_min_expert_capacity_and_eval_factor():
  config = MoeConfig(num_experts=8, router=routers.TopK(k=2), train_capacity_factor=1.0,
                     eval_capacity_factor=2.0, capacity_convention=capacity.T5X(minimum=6))
  assert config.capacity(32, deterministic=False) == 6    # round(4.0) = 4 < 6
  assert config.capacity(32, deterministic=True) == 8     # round(8.0) = 8


@pytest.mark.parametrize('batch,length,max_group,experts,replicas,groups,size,pad', [
    (16, 128, 4096, 32, 1, 32, 64, (0, 0)),      # 2048 tokens: at least E groups
    (16, 128, 4096, 32, 2, 64, 32, (0, 0)),      # two copies of each expert: 2E groups
    (24, 512, 4096, 2, 1, 4, 3072, (0, 0)),      # 12288 // 4096 = 3 -> next multiple of 2
    (4, 9, 5, 4, 1, 12, 3, (0, 0)),              # 36 // 5 = 7 -> 8 (36 % 8 != 0) -> 12
    (10, 1000, 4096, 2, 1, 2, 5000, (0, 0)),     # the floor: 10000 // 4096 = 2 groups of 5000
    (6, 10, 16, 8, 1, 8, 9, (0, 2)),             # 60 tokens: +2 positions (12) < +2 rows (20)
    (3, 5, 4096, 4, 1, 4, 5, (1, 0)),            # 15 tokens: +1 row (5) < +3 positions (9)
])
def test_flaxformer_groups(batch, length, max_group, experts, replicas, groups, size, pad):
  flaxformer = grouping.Flaxformer(max_group_size=max_group, num_expert_replicas=replicas)
  plan = MoeConfig(num_experts=experts, grouping=flaxformer).group_plan(batch, length)
  assert (plan.num_groups, plan.group_size, (plan.pad_batch, plan.pad_length)) == (
      groups, size, pad)
