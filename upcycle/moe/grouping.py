"""Routing groups: how the tokens of a batch are cut into the groups a router sees.

Three conventions (`MoeConfig`):
  group_size=None, max_group_size=None  each example (sequence / image) is one group;
  group_size=S                          consecutive runs of S tokens of the flattened batch;
  max_group_size=N                      Flaxformer's rule (`flaxformer/architectures/moe/
                                        moe_layers.py`, `_maybe_pad` and `_num_groups`).

A grouping is decided from static shapes only, before tracing, as a `GroupPlan`.
"""

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GroupPlan:
  """How `[batch, length, d]` becomes `[num_groups, group_size, d]`.

  The batch is first padded with `pad_batch` examples or `pad_length` positions
  (at most one of them non-zero), then flattened and cut into equal groups.
  """

  num_groups: int
  group_size: int
  pad_batch: int = 0
  pad_length: int = 0


def flaxformer_padding(batch: int, length: int, multiple: int) -> Tuple[int, int]:
  """`(pad_batch, pad_length)` making batch * length a multiple of `multiple`.

  Flaxformer's `_maybe_pad`: the fewest whole examples or the fewest positions
  per example, whichever adds fewer tokens (positions on a tie); (0, 0) when
  batch * length is already a multiple.
  """
  tokens = batch * length
  if tokens % multiple == 0:
    return 0, 0
  pad_batch = next(b for b in range(1, multiple + 1) if (tokens + b * length) % multiple == 0)
  pad_length = next(s for s in range(1, multiple + 1) if (tokens + s * batch) % multiple == 0)
  if pad_length * batch > pad_batch * length:
    return pad_batch, 0
  return 0, pad_length


def flaxformer_num_groups(num_tokens: int, max_group_size: int, num_experts: int,
                          num_expert_replicas: int = 1) -> int:
  """Number of routing groups by Flaxformer's `_num_groups` rule.

  The smallest n >= max(num_tokens // max_group_size, E * R) that divides
  `num_tokens` and is a multiple of E * R (R = `num_expert_replicas`), so the
  groups can be split evenly over every expert copy. Note the floor, as in
  Flaxformer's code: when `max_group_size` does not divide `num_tokens`, a group
  can be larger than `max_group_size` (10000 tokens, N = 4096, E = 2: 2 groups
  of 5000).

  Args:
    num_tokens: tokens of the (global, padded) batch; a multiple of E * R.
    max_group_size: Flaxformer's `max_group_size` (T5X's GROUP_SIZE, 4096).
    num_experts: E.
    num_expert_replicas: R, copies of each expert over the device mesh.
  """
  multiple = num_experts * num_expert_replicas
  if num_tokens % multiple:
    raise ValueError(f'{num_tokens} tokens are not a multiple of num_experts * '
                     f'num_expert_replicas = {multiple}; pad them first (flaxformer_padding).')
  smallest = max(num_tokens // max_group_size, multiple)
  n = -(-smallest // multiple) * multiple
  while num_tokens % n:
    n += multiple
  return n


def plan_groups(batch: int, length: int, *, group_size: Optional[int],
                max_group_size: Optional[int], num_experts: int,
                num_expert_replicas: int = 1) -> GroupPlan:
  """The `GroupPlan` of a `[batch, length, d]` input under one grouping convention."""
  if max_group_size is not None:
    pad_batch, pad_length = flaxformer_padding(batch, length, num_experts * num_expert_replicas)
    tokens = (batch + pad_batch) * (length + pad_length)
    groups = flaxformer_num_groups(tokens, max_group_size, num_experts, num_expert_replicas)
    return GroupPlan(groups, tokens // groups, pad_batch, pad_length)
  if group_size is None:
    return GroupPlan(batch, length)
  if (batch * length) % group_size:
    raise ValueError(
        f'MoeConfig.group_size={group_size} does not divide the {batch * length} tokens of '
        f'this batch ([batch={batch}, length={length}]). Choose a group size that divides '
        f'batch * length, max_group_size=N for Flaxformer\'s rule (which pads), or '
        f'group_size=None to route each example as one group.')
  return GroupPlan(batch * length // group_size, group_size)


def group_tokens(x: Array, token_mask: Optional[Array],
                 plan: GroupPlan) -> Tuple[Array, Optional[Array]]:
  """`x [batch, length, d]`, mask `[batch, length]` -> `[G, S, d]`, `[G, S]`.

  Padding added by the plan is masked out (False): it claims no Top-K slot and
  is taken last by Expert Choice. The mask stays None when there is neither a
  mask nor padding.
  """
  batch, length, d = x.shape
  if plan.pad_batch or plan.pad_length:
    widths = ((0, plan.pad_batch), (0, plan.pad_length))
    x = jnp.pad(x, widths + ((0, 0),))
    real = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
    token_mask = jnp.pad(real, widths)
  grouped = x.reshape(plan.num_groups, plan.group_size, d)
  mask = None if token_mask is None else token_mask.reshape(plan.num_groups, plan.group_size)
  return grouped, mask


def ungroup_tokens(y: Array, batch: int, length: int, plan: GroupPlan) -> Array:
  """`[G, S, ...]` -> `[batch, length, ...]`, dropping the plan's padding."""
  padded = y.reshape(batch + plan.pad_batch, length + plan.pad_length, *y.shape[2:])
  return padded[:batch, :length]
