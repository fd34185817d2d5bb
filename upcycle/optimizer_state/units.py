"""An optax state as units, one per (state branch, parameter), and back: the one walk over an
optimizer state, for any chain of optax transformations.

Every leaf of an optax state either belongs to a parameter or to none. A leaf belongs to the
parameter whose path its key path ends in (optax slot trees mirror the param tree;
`tree.split_param_path`). So a state is a dict `{Key: unit}` with `Key = (names, param)`:

  (names before the param path, param)   a param-shaped slot: Adam mu / nu, momentum (optax
                                         `ema` / `trace`), as an array
  (names of the Adafactor node, param)   a parameter's Adafactor second moment (and T5X's
                                         momentum) as `adafactor.ParamSlots`: T5X's slots as
                                         they are, optax `FactoredState`'s read in the
                                         heuristic layout (`adafactor.heuristic`)
  (the leaf's names, None)               a leaf of no parameter: counts, injected
                                         hyperparameters, `optax.MaskedNode`-free scalars

Parameters an `optax.masked` branch does not update have `optax.MaskedNode` slots: their
units are `optax.MaskedNode` and stay so.
"""

from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import optax

from upcycle import tree
from upcycle.optimizer_state import adafactor

Key = Tuple[Tuple[str, ...], Optional[str]]
_MOMENTS = ('v_row', 'v_col', 'v')


def _is_node(x: Any) -> bool:
  """A state node read whole: optax's Adafactor moments, T5X's slots of one parameter."""
  return isinstance(x, optax.FactoredState) or adafactor.is_slots(x)


def _nodes(state: Any, param_paths) -> list:
  """[(Key, node)] of `state`'s nodes and leaves in order; Adafactor moments as one node."""
  out = []
  for keypath, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_node)[0]:
    split = (None if isinstance(node, optax.FactoredState) else
             tree.split_param_path(keypath, param_paths))
    out.append(((tree.key_names(keypath), None) if split is None else split, node))
  return out


def flatten(state: Any, shapes: Mapping[str, Tuple[int, ...]]) -> Dict[Key, Any]:
  """`state` as `{Key: unit}` (module docstring).

  Args:
    state: an optax state (arrays, abstract or lazy leaves).
    shapes: `{param path: shape}` of the parameters the state belongs to. A source state may
      hold more (parameters nothing is made from): their slots in Adafactor nodes are left
      out, their other leaves are units of no parameter.
  """
  units: Dict[Key, Any] = {}
  for key, node in _nodes(state, shapes):
    if not isinstance(node, optax.FactoredState):
      units[key] = node
      continue
    names = key[0]
    units[(names + ('.count',), None)] = node.count
    moments = {k: tree.flatten(getattr(node, k)) for k in _MOMENTS}
    for path, v in moments['v'].items():
      if path not in shapes:
        continue
      if isinstance(v, optax.MaskedNode):
        units[(names, path)] = v
        continue
      units[(names, path)] = adafactor.heuristic(
          moments['v_row'][path], moments['v_col'][path], v, adafactor.UNUSED, shapes[path], path)
  return units


def unflatten(state: Any, units: Mapping[Key, Any]) -> Any:
  """`state`'s structure with every unit of `units` in its place (`flatten`'s inverse)."""
  out = []
  shapes = {path: () for _, path in units if path is not None}
  for key, node in _nodes(state, shapes):
    if not isinstance(node, optax.FactoredState):
      out.append(units[key])
      continue
    names = key[0]
    moments = {k: tree.flatten(getattr(node, k)) for k in _MOMENTS}
    for path in moments['v']:
      unit = units[(names, path)]
      for k in _MOMENTS:
        moments[k][path] = unit if isinstance(unit, optax.MaskedNode) else getattr(unit, k)
    out.append(optax.FactoredState(count=units[(names + ('.count',), None)],
                                   **{k: tree.unflatten(v) for k, v in moments.items()}))
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(state, is_leaf=_is_node), out)
