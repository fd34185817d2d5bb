"""Routing groups: how the tokens of a batch are cut into the groups a router sees.

Three groupings, bound in gin as small configs (`from upcycle.moe import grouping`;
`encoder/moe.MoeConfig.grouping = @grouping.Flaxformer()`):
  PerExample()               each example (sequence / image) is one group;
  Fixed(size=S)              consecutive runs of S tokens of the flattened batch;
  Flaxformer(max_group_size=N, num_expert_replicas=R)
                             Flaxformer's rule (`flaxformer/architectures/moe/moe_layers.py`,
                             `_maybe_pad` and `_num_groups`).

A grouping is decided from static shapes only, before tracing, as a `GroupPlan`.
"""

import abc
import dataclasses
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from upcycle import fields

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


class Grouping(abc.ABC):
  """How a `[batch, length, d]` input is cut into routing groups."""

  @abc.abstractmethod
  def plan(self, batch: int, length: int, num_experts: int) -> GroupPlan:
    """The `GroupPlan` of a `[batch, length, d]` input routed over `num_experts`."""

  def even_over(self, plan: GroupPlan, shards: int, num_experts: int) -> str:
    """What to bind so that `plan`'s groups split evenly over `shards` batch shards."""
    del plan, num_experts
    return f'a grouping whose number of groups is a multiple of {shards}'


@dataclasses.dataclass(frozen=True)
class PerExample(Grouping):
  """Each example's tokens form one group (the ViT runs: one group per image)."""

  def plan(self, batch: int, length: int, num_experts: int) -> GroupPlan:
    del num_experts
    return GroupPlan(batch, length)

  def even_over(self, plan: GroupPlan, shards: int, num_experts: int) -> str:
    del num_experts
    return (f'fewer microbatches (each of the {plan.num_groups} examples is a group), or '
            f'@grouping.Fixed(size=S) with S dividing the '
            f'{plan.num_groups * plan.group_size // shards} tokens of one batch shard')


@dataclasses.dataclass(frozen=True)
class Fixed(Grouping):
  """Consecutive runs of `size` tokens of the flattened batch; batch * length must be a
  multiple of it."""

  size: int

  def __post_init__(self):
    fields.integer(self, 'size', 1)

  def plan(self, batch: int, length: int, num_experts: int) -> GroupPlan:
    del num_experts
    if (batch * length) % self.size:
      raise ValueError(
          f'{fields.binding(self, "size")} = {self.size} does not divide the {batch * length} '
          f'tokens of this batch ([batch={batch}, length={length}]). Choose a group size that '
          f'divides batch * length, @grouping.Flaxformer() for Flaxformer\'s rule (which '
          f'pads), or @grouping.PerExample() to route each example as one group.')
    return GroupPlan(batch * length // self.size, self.size)

  def even_over(self, plan: GroupPlan, shards: int, num_experts: int) -> str:
    del num_experts
    tokens = plan.num_groups * plan.group_size
    return (f'{fields.binding(self, "size")} dividing the {tokens // shards} tokens of one '
            f'batch shard')


@dataclasses.dataclass(frozen=True)
class Flaxformer(Grouping):
  """Flaxformer's grouping (T5X's GROUP_SIZE = 4096): groups span the examples of the batch;
  their number is the smallest n >= max(tokens // max_group_size, E * R) dividing the token
  count with n a multiple of E * R (`flaxformer_num_groups`); a token count that is not a
  multiple of E * R is first padded (masked padding, as Flaxformer's `_maybe_pad` places it).

  Attributes:
    max_group_size: N, Flaxformer's `max_group_size`.
    num_expert_replicas: R. Flaxformer infers it from the mesh as device_count //
      (num_expert_partitions * num_model_partitions), assuming a ['data', 'expert', 'model']
      mesh with experts replicated over 'data'; here it is explicit so that the groups (and so
      the routing) do not change with the number of devices. 1 = one copy of each expert
      (Flaxformer on a mesh with data * expert * model = E devices, or fewer).
  """

  max_group_size: int = 4096
  num_expert_replicas: int = 1

  def __post_init__(self):
    fields.integer(self, 'max_group_size', 1)
    fields.integer(self, 'num_expert_replicas', 1)

  def plan(self, batch: int, length: int, num_experts: int) -> GroupPlan:
    multiple = num_experts * self.num_expert_replicas
    pad_batch, pad_length = flaxformer_padding(batch, length, multiple)
    tokens = (batch + pad_batch) * (length + pad_length)
    groups = flaxformer_num_groups(tokens, self.max_group_size, num_experts,
                                   self.num_expert_replicas)
    return GroupPlan(groups, tokens // groups, pad_batch, pad_length)

  def even_over(self, plan: GroupPlan, shards: int, num_experts: int) -> str:
    """R such that E * R, which the number of groups is a multiple of, is one of `shards`."""
    del plan
    replicas = math.lcm(num_experts * self.num_expert_replicas, shards) // num_experts
    return f'{fields.binding(self, "num_expert_replicas")} = {replicas}'


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
