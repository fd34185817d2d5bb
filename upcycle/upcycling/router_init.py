"""Router initializers: the fresh `X/router/...` leaves of an MoE block.

A router initializer gets the abstract router leaves of one block, keyed
relative to `router/` ('router_weights/w/kernel' -> `[d_model, E]`, float32),
and returns arrays of those shapes and dtypes. Leaves named 'kernel' get the
initializer's distribution, leaves named 'bias' get zeros.

Names for entry points: 'normal' (the default, N(0, 0.02); `Normal(std='width_scaled')`
draws at the std `moe.MoeConfig.router_init = 'width_scaled'` gives a fresh MoE), 'uniform',
'zeros' (see `get`). `FromData` needs hidden states: pass an instance.
"""

import abc
import dataclasses
import math
from typing import Any, Dict, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from upcycle.router_scale import check_router_init, router_init_std
from upcycle.tree import shape_of
from upcycle.upcycling.base import Array, from_registry, key_for

__all__ = ['RouterInit', 'Normal', 'Uniform', 'Zeros', 'FromData', 'ROUTER_INITS', 'get']


class RouterInit(abc.ABC):
  """Makes the router leaves of one MoE block."""

  @abc.abstractmethod
  def kernel(self, rng: Array, shape, dtype, layer: str) -> Array:
    """The kernel `[d_model, experts]` of the router of block `layer`."""

  def __call__(self, router: Mapping[str, Any], rng: Array, *, layer: str = '') -> Dict[str, Array]:
    """`{name: abstract leaf}` -> `{name: array}` for the router of block `layer`."""
    out = {}
    for name, leaf in sorted(router.items()):
      kind = name.split('/')[-1]
      shape, dtype = shape_of(leaf), leaf.dtype
      if kind == 'kernel':
        out[name] = jnp.asarray(self.kernel(key_for(rng, name), shape, dtype, layer), dtype)
      elif kind == 'bias':
        out[name] = jnp.zeros(shape, dtype)
      else:
        raise ValueError(
            f'Router leaf {layer}/router/{name} {shape} is neither a kernel nor a bias; '
            f'{type(self).__name__} does not know how to initialize it.')
    return out


@dataclasses.dataclass(frozen=True)
class Normal(RouterInit):
  """N(0, std^2) kernel: the Sparse Upcycling default (std 0.02).

  `std`: a number, or a name of `moe.MoeConfig.router_init` ('constant': 0.02, 'width_scaled':
  0.02 * sqrt(768 / d_model) for a kernel `[d_model, E]`), the std a fresh MoE's router gets
  with that setting (`router_scale.router_init_std`)."""

  std: Union[float, str] = 0.02

  def __post_init__(self):
    check_router_init(self.std, 'router_init.Normal.std')

  def kernel(self, rng, shape, dtype, layer):
    return router_init_std(self.std, shape[0]) * jax.random.normal(rng, shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Uniform(RouterInit):
  """Zero-mean uniform kernel with standard deviation `std` (U(-a, a), a = std * sqrt(3))."""

  std: float = 0.02

  def kernel(self, rng, shape, dtype, layer):
    bound = self.std * math.sqrt(3.0)
    return jax.random.uniform(rng, shape, jnp.float32, -bound, bound)


@dataclasses.dataclass(frozen=True)
class Zeros(RouterInit):
  """All-zero kernel: uniform routing probabilities at step 0."""

  def kernel(self, rng, shape, dtype, layer):
    return jnp.zeros(shape, jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class FromData(RouterInit):
  """Router column e = the normalized mean MLP input of the data meant for expert e.

  UpIT initializes each expert's router row from the data that expert handles
  best. With u_e = m_e / |m_e|, the mean input m_e of expert e's data scores
  m_e . u_e = |m_e| >= m_e . u_f (Cauchy-Schwarz), so at step 0 each expert's
  data has its highest mean router logit at that expert.

  Attributes:
    hidden: {MLP path ('encoder/layers_1/mlp'): per expert an array
      `[..., d_model]` of MLP inputs (any leading token axes), or one
      `[experts, tokens, d_model]` array}. `capture.mlp_inputs` collects them
      from a dense model.
    scale: norm of every router column.
  """

  hidden: Mapping[str, Union[Sequence[Any], Any]]
  scale: float = 1.0

  def __repr__(self):
    return f'FromData({len(self.hidden)} layers, scale={self.scale})'

  def kernel(self, rng, shape, dtype, layer):
    del rng
    if layer not in self.hidden:
      raise ValueError(
          f'FromData: no hidden states for the MoE block at {layer}; have '
          f'{sorted(self.hidden)}. Fix: capture MLP inputs for every MoE layer '
          f'(upcycle.upcycling.capture.mlp_inputs) with the MoE placement of the target.')
    if len(shape) != 2:
      raise ValueError(f'FromData: the router kernel of {layer} is {tuple(shape)}; expected '
                       f'[d_model, experts].')
    batches = list(self.hidden[layer])
    d_model, num_experts = shape
    if len(batches) != num_experts:
      raise ValueError(
          f'FromData: {len(batches)} batches of hidden states for {layer} but its router '
          f'kernel {tuple(shape)} has {num_experts} experts. Fix: one batch per expert.')
    columns = []
    for e, batch in enumerate(batches):
      x = np.asarray(batch, np.float32)
      if x.shape[-1] != d_model:
        raise ValueError(
            f'FromData: hidden states of expert {e} at {layer} have shape {x.shape}; the router '
            f'kernel {tuple(shape)} needs d_model={d_model} on the last axis.')
      mean = x.reshape(-1, d_model).mean(0)
      columns.append(self.scale * mean / max(float(np.linalg.norm(mean)), 1e-30))
    return jnp.asarray(np.stack(columns, axis=1))


ROUTER_INITS = {'normal': Normal, 'uniform': Uniform, 'zeros': Zeros}


def get(init: Union[str, RouterInit]) -> RouterInit:
  """A router initializer from a name (with defaults) or an instance."""
  return from_registry(init, RouterInit, ROUTER_INITS, 'router',
                       'FromData needs hidden states: pass an instance.')
