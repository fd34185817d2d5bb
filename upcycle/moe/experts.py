"""The experts of the dropless dispatch: a dense MLP module whose projections are grouped
matmuls over rows sorted by expert, each row by its own expert's kernel.

`grouped_experts(expert, ...)` builds the dense MLP module `expert` (`layers.GatedMlp`,
`layers.Mlp`) with `GroupedDense` as its projections: the same parameter names as the vmapped
experts of the slot dispatches (`expert/wi_0/kernel [E, d_model, d_ff]`), on the logical axis
'expert', each expert's drawn on its own as `nn.vmap` over experts draws them. The base layers
know nothing of experts.
"""

import functools
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from upcycle import layers, tree
from upcycle.grouped_kernels import GROUPED_KERNELS

Array = jax.Array


def grouped_matmul(rows: Array, kernel: Array, group_sizes: Array,
                   bias: Optional[Array] = None, grouped_kernel: str = 'ragged_dot') -> Array:
  """Each row by its expert's kernel: rows `[R, d_in]` sorted by expert, kernel
  `[E, d_in, d_out]`, bias `[E, d_out]` -> `[R, d_out]`, rows past the groups 0. One grouped
  matmul per shard, by `GROUPED_KERNELS[grouped_kernel]`.

  group_sizes `[shards, E]`: each batch shard's rows per expert
  (`upcycle.moe.ragged.sort_by_expert`), every kernel on every shard. Or `[shards, E / n]`:
  rows already exchanged over the n devices of the expert axes (`upcycle.moe.exchange`),
  each device multiplying by its own experts' kernels."""
  def local(rows, kernel, group_sizes, *bias):
    sizes = group_sizes[0]
    out = GROUPED_KERNELS[grouped_kernel](rows, kernel, sizes)
    if bias:
      expert = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=rows.shape[0])
      counted = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
      out = out + jnp.where(counted[:, None], bias[0][expert], 0).astype(out.dtype)
    return (out,)

  args = (rows, kernel, group_sizes) + (() if bias is None else (bias,))
  kernels = 'expert' if group_sizes.shape[1] != kernel.shape[0] else False
  batched = (True, kernels, True, kernels)[:len(args)]
  return layers.per_batch_shard(local, batched, (True,))(*args)[0]


def _per_expert(initializer: layers.Initializer, num_experts: int) -> layers.Initializer:
  """`initializer` drawn for each expert on its own, as under `nn.vmap` over experts."""
  return lambda rng, shape, dtype: jax.vmap(lambda r: initializer(r, shape[1:], dtype))(
      jax.random.split(rng, num_experts))


class GroupedDense(nn.Module):
  """E experts' projections of rows sorted by expert: x `[R, d_in]`, `group_sizes` of them
  each (`[shards, E]` or, exchanged, `[shards, E / n]`: `grouped_matmul`) -> `[R, features]`.
  Kernels `[E, d_in, features]` and biases `[E, features]` on the logical axis 'expert'.
  Constructed as `layers.DenseGeneral` is, so a dense MLP module takes it as its `dense`."""

  features: int
  kernel_axes: layers.Axes
  num_experts: int
  group_sizes: Array
  grouped_kernel: str
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: layers.Initializer = layers.default_kernel_init
  bias_init: layers.Initializer = nn.initializers.zeros

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel_shape: Tuple[int, int] = (x.shape[-1], self.features)
    init = layers.matrix_init(self.kernel_init, kernel_shape[:1], kernel_shape[1:])
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(_per_expert(init, self.num_experts),
                                               ('expert',) + tuple(self.kernel_axes)),
        (self.num_experts,) + kernel_shape, self.param_dtype)
    bias = None
    if self.use_bias:
      bias_axes = ('expert',) + tuple(self.kernel_axes[1:])
      bias = self.param(
          'bias', nn.with_logical_partitioning(_per_expert(self.bias_init, self.num_experts),
                                               bias_axes),
          (self.num_experts, self.features), self.param_dtype)
      bias = jnp.asarray(bias, self.dtype)
    return grouped_matmul(jnp.asarray(x, self.dtype), jnp.asarray(kernel, self.dtype),
                          self.group_sizes, bias, self.grouped_kernel)


def grouped_experts(expert: Callable[..., nn.Module], *, num_experts: int,
                    grouped_kernel: str, group_sizes: Array) -> nn.Module:
  """The E experts of the dense MLP module factory `expert` over rows sorted by expert,
  `group_sizes` of them each: a module `(rows [R, d], deterministic) -> [R, d]` named
  'expert' (built inside the MoE layer, so its parameters are the layer's)."""
  dense = functools.partial(GroupedDense, num_experts=num_experts, group_sizes=group_sizes,
                            grouped_kernel=grouped_kernel)
  return expert(intermediate_axes=None, dense=dense, name=tree.EXPERT)
