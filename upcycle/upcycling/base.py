"""The expert-initializer interface and helpers shared by its implementations."""

import abc
import functools
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def key_for(rng: Array, *names: str) -> Array:
  """A key for `names` that does not depend on which other layers exist.

  Folding in a CRC of the layer path (rather than splitting in tree order)
  keeps a layer's draws fixed when placement or other layers change.
  """
  for name in names:
    rng = jax.random.fold_in(rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
  return rng


def tile(x, num_experts: int) -> Array:
  """`[...] -> [experts, ...]`, every expert an exact copy."""
  x = jnp.asarray(x)
  return jnp.broadcast_to(x[None], (num_experts,) + x.shape)


def draw(rng: Array, shapes: Sequence[Tuple[int, ...]], sampler=jax.random.normal,
         dtype=jnp.float32) -> List[Array]:
  """Samples for several shapes from one sampler call, split in order.

  One compiled call per layer instead of one random kernel per leaf shape:
  compiling threefry dominates the cost of upcycling small models.
  """
  return _draw(rng, tuple(tuple(int(d) for d in s) for s in shapes), sampler, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(rng, shapes, sampler, dtype):
  sizes = [int(np.prod(shape)) for shape in shapes]
  flat = sampler(rng, (sum(sizes),), dtype)
  out, start = [], 0
  for shape, size in zip(shapes, sizes):
    out.append(flat[start:start + size].reshape(shape))
    start += size
  return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def unit_mask(rng: Array, shape: Tuple[int, ...], count: int) -> Array:
  """bool `[..., n]`: in every row exactly `count` of the n entries, uniformly drawn."""
  u = jax.random.uniform(rng, shape)
  ranks = jnp.argsort(jnp.argsort(u, axis=-1), axis=-1)   # a uniform permutation per row
  return ranks < count


def as_array(x) -> Array:
  """Dense leaves may be numpy or lazily read arrays; read them once here."""
  return x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x))


class ExpertInit(abc.ABC):
  """Makes the experts of one MoE block from the dense MLP it replaces.

  An initializer sees the whole MLP of one layer at once, because some
  (Drop-Upcycling, granular slicing) must act on the same intermediate units
  of wi_0, wi_1 and wo together.

  Subclasses are frozen dataclasses so that entry points (gin) can bind them.

  `traceable`: whether the initializer runs under `jax.jit` on its inputs alone (the
  restore hook's sharded executor); initializers that read their own sources on the host
  (Branch-Train-MiX, UpIT) set it False and are run eagerly.
  """

  traceable = True

  def expert_shapes(self, mlp_shapes: Mapping[str, Tuple[int, ...]],
                    num_experts: int, layer: str = '') -> Dict[str, Tuple[int, ...]]:
    """Shapes this initializer produces: `[experts, *dense shape]` by default."""
    del layer
    return {name: (num_experts,) + tuple(shape) for name, shape in mlp_shapes.items()}

  @abc.abstractmethod
  def __call__(self, mlp: Mapping[str, Array], num_experts: int, rng: Array, *,
               layer: str = '') -> Dict[str, Array]:
    """Expert leaves of one MoE block.

    Args:
      mlp: the dense MLP leaves, keyed relative to the MLP ('wi_0/kernel' ->
        `[d_model, d_ff]`). Never modified.
      num_experts: E, taken from the target's expert leaves.
      rng: a key for this layer only.
      layer: path of the MLP ('encoder/layers_1/mlp'), for errors and for
        initializers that look the layer up elsewhere (FromCheckpoints).

    Returns:
      {same names: `[E, ...]` arrays} in the dense leaves' dtypes.
    """

  def for_layers(self, positions: Mapping[str, Optional[Tuple[str, int]]]) -> 'ExpertInit':
    """This initializer for a plan whose MoE blocks are the keys of `positions` (all of them),
    each at (stack, layer index), or None where that is not known; self by default.

    The plan calls it once, before anything is read, so that an initializer whose values
    depend on where a layer sits among the MoE layers (Drop's 'linear' ratio) learns them,
    and rejects a layer it cannot make early.
    """
    del positions
    return self

  def for_key(self, rng: Array) -> 'ExpertInit':
    """This initializer for the experts' key `rng` of a run of the plan (every MoE block's
    own is `key_for(rng, layer)`); self by default.

    The executor calls it before each block, so that an initializer whose block depends on
    the other blocks' draws (`sources.Merge(pair_scope='model')`) can make them.
    """
    del rng
    return self

  def tie_router(self, router: Mapping[str, Array], layer: str = '') -> Dict[str, Array]:
    """Constrains the freshly made router of the block; identity by default.

    Granular upcycling needs the G experts of one virtual group to share one
    router column, so it overrides this.
    """
    del layer
    return dict(router)


def from_registry(init: Any, kind: type, registry: Mapping[str, Callable[[], Any]], flag: str,
                  hint: str) -> Any:
  """`init` if it is a `kind`, else `registry[init]()`: the one lookup of `experts.get`,
  `router_init.get` and convert's --experts / --router (so they accept the same names)."""
  if isinstance(init, kind):
    return init
  if isinstance(init, str) and init in registry:
    return registry[init]()
  raise ValueError(f'{flag}={init!r}: expected a {kind.__name__} instance or one of '
                   f'{tuple(registry)}. {hint}')


def check_choice(value: str, choices: Sequence[str], what: str):
  if value not in choices:
    raise ValueError(f'{what}={value!r}: expected one of {tuple(choices)}.')
