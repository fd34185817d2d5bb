"""Optimizer-state upcycling: a dense optax state -> the MoE model's optax state.

The MoE state is built by `optimizer.init(moe_params)`, then every slot is
filled by path from the dense state with the weights' rule (`tree.classify`):

  slots of X/expert/Y  <- the dense slots of X/Y, tiled along a new expert axis
                          (whatever the expert initializer: Drop and Noise
                          experts get the dense moments too)
  slots of X/router/Z  <- fresh, as `optimizer.init` makes them
  slots of X/shared_expert/Y <- the dense slots of X/Y (a shared expert of the
                          dense shape; a narrower one cannot reuse them)
  slots of P           <- the dense slots of P
  other leaves         <- the dense leaves (step counts, injected
                          hyperparameters): training continues the dense
                          schedule. `keep_step=False` takes them fresh instead.

A state leaf belongs to a parameter when its key path ends in that
parameter's path (optax slot trees mirror the param tree), so any chain of
optax transformations (Adam mu/nu, momentum traces, EMAs, schedule counts)
is handled without knowing it, inside `optax.masked` and `optax.multi_transform` too (a
parameter a branch does not update has `optax.MaskedNode` slots there, kept as they are).
Adafactor's factored second moments
(`optax.FactoredState`, see `factored.py`) are handled per parameter as a
unit: their layout can differ between a dense `[d_model, d_ff]` kernel and
its `[E, d_model, d_ff]` experts.

T5X Adafactor slots (`adafactor_state.ParamSlots`, the state of
`upcycle.train.t5x_adafactor`) are handled per parameter too; they carry their layout, so
expert slots factored with the expert axis as a batch axis are the dense slots tiled
(`adafactor_state.upcycle`). A T5X-written Adafactor state is first converted into the run's
optimizer state (`upcycle.checkpoints.optimizer_state.from_t5x_adafactor`), then upcycled here.
"""

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle import tree
from upcycle.checkpoints import adafactor_state, factored, slots


class _Filler(slots.FromState):
  """Fills one fresh MoE state node from the dense state."""

  def __init__(self, dense_state, roles, shapes, tile_moments: bool, keep_step: bool):
    super().__init__(dense_state)
    self.roles = roles
    self.shapes = shapes
    self.tile_moments = tile_moments
    self.keep_step = keep_step

  def missing(self, names, what):
    return (f'Optimizer-state upcycling: {what} needs the dense slot {tree.render(names)}, which '
            f'the dense optimizer state does not have. Fix: the dense state must come from the '
            f'same optax optimizer (same chain and options) as the MoE one, or pass '
            f'tile_moments=False.')

  def slot(self, prefix, path, fresh):
    """A param-shaped slot (mu, nu, momentum, ...) of MoE parameter `path`."""
    role = self.roles[path]
    if role.kind == 'router' or not self.tile_moments:
      return fresh
    where = f'slot {tree.render(prefix + tuple(path.split("/")))} {tuple(fresh.shape)}'
    dense = self.lookup(prefix + tuple(role.source.split('/')), where)
    return _fit(dense, fresh, role, where)

  def t5x(self, prefix, path, fresh: adafactor_state.ParamSlots):
    """T5X Adafactor slots of MoE parameter `path`."""
    role = self.roles[path]
    if role.kind == 'router' or not self.tile_moments:
      return fresh
    where = f'slots {tree.render(prefix + tuple(path.split("/")))}'
    dense = self.lookup(prefix + tuple(role.source.split('/')), where)
    if not adafactor_state.is_slots(dense):
      raise ValueError(f'Optimizer-state upcycling: {where} need T5X Adafactor slots of '
                       f'{role.source}; the dense state has {type(dense).__name__}. Fix: the '
                       f'dense run must use the same optimizer (T5XAdafactor).')
    experts = self.shapes[path][0] if role.kind == 'expert' else None
    return adafactor_state.upcycle(dense, fresh, experts, where)

  def other(self, names, fresh):
    """A leaf that belongs to no parameter: step counts, hyperparameters."""
    if not self.keep_step:
      return fresh
    dense = self.lookup(names, f'leaf {tree.render(names)}')
    if tuple(np.shape(dense)) != tuple(np.shape(fresh)):
      raise ValueError(f'Optimizer-state upcycling: leaf {tree.render(names)} is '
                       f'{tuple(np.shape(dense))} in the dense state but {tuple(np.shape(fresh))} '
                       f'in the MoE state.')
    return jnp.asarray(dense, jnp.result_type(fresh))

  def factored(self, names, fresh: optax.FactoredState):
    dense = self.lookup(names, f'the Adafactor state {tree.render(names)}')
    count = jnp.asarray(dense.count, fresh.count.dtype) if self.keep_step else fresh.count
    if not self.tile_moments:
      return fresh._replace(count=count)
    out = {'v_row': {}, 'v_col': {}, 'v': {}}
    fresh_slots = {k: tree.flatten(getattr(fresh, k)) for k in out}
    dense_slots = {k: tree.flatten(getattr(dense, k)) for k in out}
    for path, shape in self.shapes.items():
      role = self.roles[path]
      slots = tuple(fresh_slots[k][path] for k in ('v_row', 'v_col', 'v'))
      # optax.masked / multi_transform: a parameter this Adafactor does not update has
      # MaskedNode slots, kept as they are.
      masked = any(isinstance(x, optax.MaskedNode) for x in slots)
      if role.kind != 'router' and not masked:
        source = tuple(dense_slots[k].get(role.source) for k in ('v_row', 'v_col', 'v'))
        if any(s is None for s in source):
          raise ValueError(f'Optimizer-state upcycling: the dense Adafactor state '
                           f'{tree.render(names)} has no second moments for {role.source}.')
        experts = shape[0] if role.kind == 'expert' else None
        try:
          slots = factored.upcycle_slots(source, slots, shape, experts, where=path)
        except ValueError as e:
          raise ValueError(f'Optimizer-state upcycling: {e} Fix: pass tile_moments=False for '
                           f'parameters not of the dense shape (Granular experts, a shared '
                           f'expert narrower than the dense MLP).') from e
      for k, value in zip(('v_row', 'v_col', 'v'), slots):
        out[k][path] = value
    return optax.FactoredState(count=count, **{k: tree.unflatten(v) for k, v in out.items()})


def _fit(dense, fresh, role, where):
  """Dense slot -> MoE slot: the same for copies, tiled for experts."""
  dense_shape, fresh_shape = tuple(np.shape(dense)), tuple(fresh.shape)
  if dense_shape == fresh_shape:
    return jnp.asarray(dense, fresh.dtype)
  if role.kind == 'expert' and fresh_shape == (fresh_shape[0],) + dense_shape:
    x = jnp.asarray(dense, fresh.dtype)
    return jnp.broadcast_to(x[None], fresh_shape)
  raise ValueError(
      f'Optimizer-state upcycling: {where} cannot be made from the dense slot of {role.source} '
      f'{dense_shape}: only copies and experts of the dense shape ([E, *dense]) can reuse dense '
      f'moments. Fix: pass tile_moments=False for expert initializers that change shapes '
      f'(Granular) or a shared expert narrower than the dense MLP.')


def _check_shapes(made, fresh) -> None:
  """Raises unless every node of `made` has the shapes `optimizer.init` gave in `fresh`."""
  made_nodes = jax.tree_util.tree_leaves(made, is_leaf=slots.is_unit)
  fresh_nodes = jax.tree_util.tree_flatten_with_path(fresh, is_leaf=slots.is_unit)[0]
  for node, (keypath, fresh_node) in zip(made_nodes, fresh_nodes):
    got, want = ([tuple(np.shape(x)) for x in jax.tree.leaves(t)] for t in (node, fresh_node))
    if got != want:
      raise ValueError(
          f'Optimizer-state upcycling: {tree.key_path(keypath)} came out with shapes {got} '
          f'but the MoE state needs {want}: only copies and experts of the dense shape can '
          f'reuse dense moments. Fix: pass tile_moments=False for expert initializers that '
          f'change shapes (Granular) or a shared expert narrower than the dense MLP.')


def upcycle_optimizer_state(dense_state: Any, moe_params: Mapping[str, Any],
                            optimizer: optax.GradientTransformation, *,
                            tile_moments: bool = True, keep_step: bool = True) -> Any:
  """The MoE optimizer state, reusing the dense one.

  Args:
    dense_state: the dense model's optax state (e.g. `from_t5x_adafactor`).
      Never modified.
    moe_params: the MoE params (from `surgery.upcycle`) or their abstract
      shapes. flax boxes are unboxed: the state is that of the plain tree.
    optimizer: the MoE run's optax optimizer, the same chain as the dense run's.
    tile_moments: reuse the dense moments (tiled for experts); False starts
      every moment fresh.
    keep_step: carry over step counts and other non-parameter leaves, so the
      schedule continues from the dense step; False resets them.

  Returns:
    A state of the structure `optimizer.init(moe_params)` returns.
  """
  moe_params = tree.zeros_for(moe_params)
  fresh = optimizer.init(moe_params)
  flat_params = tree.flatten(moe_params)
  roles = tree.classify(flat_params)
  shapes = {p: tree.shape_of(x) for p, x in flat_params.items()}
  made = slots.fill(fresh, roles, _Filler(dense_state, roles, shapes, tile_moments, keep_step))
  _check_shapes(made, fresh)
  return made
