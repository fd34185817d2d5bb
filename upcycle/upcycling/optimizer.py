"""Optimizer-state upcycling: a dense optax state -> the MoE model's optax state.

The MoE state is built by `optimizer.init(moe_params)`, then every slot is
filled by path from the dense state with the weights' rule (`paths.classify`):

  slots of X/expert/Y  <- the dense slots of X/Y, tiled along a new expert axis
                          (whatever the expert initializer: Drop and Noise
                          experts get the dense moments too)
  slots of X/router/Z  <- fresh, as `optimizer.init` makes them
  slots of P           <- the dense slots of P
  other leaves         <- the dense leaves (step counts, injected
                          hyperparameters): training continues the dense
                          schedule. `keep_step=False` takes them fresh instead.

A state leaf belongs to a parameter when its key path ends in that
parameter's path (optax slot trees mirror the param tree), so any chain of
optax transformations (Adam mu/nu, momentum traces, EMAs, schedule counts)
is handled without knowing it. Adafactor's factored second moments
(`optax.FactoredState`, see `factored.py`) are handled per parameter as a
unit: their layout can differ between a dense `[d_model, d_ff]` kernel and
its `[E, d_model, d_ff]` experts.

`from_t5x_adafactor` converts a T5X Adafactor state into the optax state of
`optax.adafactor` for the same (dense) params, to be upcycled next.
"""

from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from upcycle.upcycling import factored
from upcycle.upcycling import paths

KeyPath = Tuple[Any, ...]


def _is_factored(x) -> bool:
  return isinstance(x, optax.FactoredState)


def _names(keypath: KeyPath) -> Tuple[str, ...]:
  """Key path -> hashable names: dict keys as is, attributes '.name', indices '[i]'."""
  out = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      out.append(f'.{k.name}')
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(f'[{k.idx}]')
    else:
      out.append(str(k))
  return tuple(out)


def _split(keypath: KeyPath, param_paths) -> Optional[Tuple[Tuple[str, ...], str]]:
  """(slot prefix names, param path) if the key path ends in a param path, else None.

  The longest such suffix wins, so a state nested in dicts (multi_transform,
  named_chain) keeps its own keys in the prefix.
  """
  for i in range(len(keypath)):
    suffix = keypath[i:]
    if all(isinstance(k, jax.tree_util.DictKey) for k in suffix):
      path = '/'.join(str(k.key) for k in suffix)
      if path in param_paths:
        return _names(keypath[:i]), path
  return None


def _render(names) -> str:
  return ''.join(n if n.startswith(('.', '[')) else f'/{n}' for n in names).lstrip('/') or '<root>'


def _concrete(params):
  """Unboxed params; zeros for abstract leaves (`optimizer.init` needs shapes and dtypes)."""
  flat = paths.flatten(params)
  return paths.unflatten({p: x if isinstance(x, (jax.Array, np.ndarray)) else
                          jnp.zeros(x.shape, x.dtype) for p, x in flat.items()})


class _Filler:
  """Fills one fresh MoE state leaf from the dense state."""

  def __init__(self, dense_state, roles, tile_moments: bool, keep_step: bool):
    self.roles = roles
    self.tile_moments = tile_moments
    self.keep_step = keep_step
    self.dense: Dict[Tuple[str, ...], Any] = {}
    leaves, _ = jax.tree_util.tree_flatten_with_path(dense_state, is_leaf=_is_factored)
    for keypath, leaf in leaves:
      self.dense[_names(keypath)] = leaf

  def lookup(self, names, what: str):
    if names not in self.dense:
      raise ValueError(
          f'Optimizer-state upcycling: {what} needs the dense slot {_render(names)}, which the '
          f'dense optimizer state does not have. Fix: the dense state must come from the same '
          f'optax optimizer (same chain and options) as the MoE one, or pass tile_moments=False.')
    return self.dense[names]

  def slot(self, prefix, path, fresh):
    """A param-shaped slot (mu, nu, momentum, ...) of MoE parameter `path`."""
    role = self.roles[path]
    if role.kind == 'router' or not self.tile_moments:
      return fresh
    where = f'slot {_render(prefix + tuple(path.split("/")))} {tuple(fresh.shape)}'
    dense = self.lookup(prefix + tuple(role.source.split('/')), where)
    return _fit(dense, fresh, role, where)

  def other(self, names, fresh):
    """A leaf that belongs to no parameter: step counts, hyperparameters."""
    if not self.keep_step:
      return fresh
    dense = self.lookup(names, f'leaf {_render(names)}')
    if tuple(np.shape(dense)) != tuple(np.shape(fresh)):
      raise ValueError(f'Optimizer-state upcycling: leaf {_render(names)} is '
                       f'{tuple(np.shape(dense))} in the dense state but {tuple(np.shape(fresh))} '
                       f'in the MoE state.')
    return jnp.asarray(dense, jnp.result_type(fresh))

  def factored_state(self, names, fresh: optax.FactoredState, param_shapes):
    dense = self.lookup(names, f'the Adafactor state {_render(names)}')
    count = jnp.asarray(dense.count, fresh.count.dtype) if self.keep_step else fresh.count
    if not self.tile_moments:
      return fresh._replace(count=count)
    out = {'v_row': {}, 'v_col': {}, 'v': {}}
    fresh_slots = {k: paths.flatten(getattr(fresh, k)) for k in out}
    dense_slots = {k: paths.flatten(getattr(dense, k)) for k in out}
    for path, shape in param_shapes.items():
      role = self.roles[path]
      slots = tuple(fresh_slots[k][path] for k in ('v_row', 'v_col', 'v'))
      if role.kind != 'router':
        source = tuple(dense_slots[k].get(role.source) for k in ('v_row', 'v_col', 'v'))
        if any(s is None for s in source):
          raise ValueError(f'Optimizer-state upcycling: the dense Adafactor state '
                           f'{_render(names)} has no second moments for {role.source}.')
        experts = shape[0] if role.kind == 'expert' else None
        slots = factored.upcycle_slots(source, slots, shape, experts, where=path)
      for k, value in zip(('v_row', 'v_col', 'v'), slots):
        out[k][path] = value
    return optax.FactoredState(count=count, **{k: paths.unflatten(v) for k, v in out.items()})


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
      f'(Granular).')


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
  moe_params = _concrete(moe_params)
  fresh = optimizer.init(moe_params)
  flat_params = paths.flatten(moe_params)
  roles = paths.classify(flat_params)
  shapes = {p: paths.shape_of(x) for p, x in flat_params.items()}
  filler = _Filler(dense_state, roles, tile_moments, keep_step)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(fresh, is_leaf=_is_factored)
  out = []
  for keypath, leaf in leaves:
    if _is_factored(leaf):
      out.append(filler.factored_state(_names(keypath), leaf, shapes))
      continue
    split = _split(keypath, roles)
    if split is None:
      out.append(filler.other(_names(keypath), leaf))
    else:
      out.append(filler.slot(split[0], split[1], leaf))
  return jax.tree_util.tree_unflatten(treedef, out)


def from_t5x_adafactor(t5x_state: Mapping[str, Any], params: Mapping[str, Any],
                       optimizer: optax.GradientTransformation) -> Any:
  """A T5X Adafactor state as the optax state of `optimizer` for the same params.

  T5X stores `{'step': [], 'param_states': {<param path>: {'v_row', 'v_col',
  'v', 'm'}}}` with `[1]` placeholders in unused slots. Its default
  (heuristic) factoring is optax's: for a parameter whose two largest axes
  are d1 (second) and d0 (largest), v_row drops d0 and v_col drops d1, so the
  factors are taken as they are. Where the layouts differ (other
  `min_dim_size_to_factor`, `factored`), the second moment is rebuilt as
  v_row x v_col / mean(v_row), the estimate both implementations precondition
  with, and refactored (see `factored.py`). T5X's momentum `m` (an EMA of the
  scaled update) is optax.adafactor's `ema`; the step fills every `count`.

  Args:
    t5x_state: the T5X optimizer `state` dict, as the T5X checkpoint reader
      returns it.
    params: the dense params (or their shapes), as the MoE-side code names them.
    optimizer: `optax.adafactor(...)` with the T5X run's hyperparameters.

  Returns:
    `optimizer.init(params)`'s structure filled from T5X; upcycle it with
    `upcycle_optimizer_state`.
  """
  if 'param_states' not in t5x_state:
    raise ValueError(f'T5X Adafactor state has keys {sorted(t5x_state)}; expected '
                     f"'param_states' and 'step' (the checkpoint's optimizer/state).")
  step = t5x_state.get('step', 0)
  flat = paths.flatten(t5x_state['param_states'])
  slots: Dict[str, Dict[str, Any]] = {}
  for path, leaf in flat.items():
    param, _, slot = path.rpartition('/')
    slots.setdefault(param, {})[slot] = leaf
  params = _concrete(params)
  flat_params = paths.flatten(params)
  missing = sorted(set(flat_params) - set(slots))
  if missing:
    raise ValueError(f'T5X Adafactor state has no param_states for {missing[0]} '
                     f'({len(missing)} params missing). Fix: pass the params of the same checkpoint.')
  fresh = optimizer.init(params)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(fresh, is_leaf=_is_factored)
  out = []
  for keypath, leaf in leaves:
    names = _names(keypath)
    if _is_factored(leaf):
      new = {'v_row': {}, 'v_col': {}, 'v': {}}
      fresh_slots = {k: paths.flatten(getattr(leaf, k)) for k in new}
      for path, x in flat_params.items():
        source = tuple(slots[path].get(k, np.zeros((1,), np.float32)) for k in new)
        target = tuple(fresh_slots[k][path] for k in new)
        made = factored.upcycle_slots(source, target, paths.shape_of(x), None, where=path)
        for k, value in zip(new, made):
          new[k][path] = value
      out.append(optax.FactoredState(count=jnp.asarray(step, leaf.count.dtype),
                                     **{k: paths.unflatten(v) for k, v in new.items()}))
      continue
    split = _split(keypath, flat_params)
    if split is None:
      out.append(jnp.asarray(step, leaf.dtype) if names[-1] == '.count' else leaf)
      continue
    prefix, path = split
    if prefix and prefix[-1] in ('.ema', '.trace'):
      m = slots[path].get('m')
      shape = paths.shape_of(flat_params[path])
      out.append(leaf if m is None or tuple(np.shape(m)) != shape else jnp.asarray(m, leaf.dtype))
      continue
    raise ValueError(
        f'T5X Adafactor has no slot for the optax state leaf {_render(names)}: T5X keeps '
        f'v_row, v_col, v and m only. Fix: convert with optimizer=optax.adafactor(...).')
  return jax.tree_util.tree_unflatten(treedef, out)
