"""Growing a trained MoE: E experts per block -> E' > E, every new expert a copy of an old one.

  X/expert/Y  [E, ...] -> [E', ...]   experts 0..E-1 as they were, expert E + j a copy of
                                      expert sources[j]
  X/router/Z  [d, E] -> [d, E']       router column E + j a copy of column sources[j]
  P                                   copied

The target (the grown model's abstract params) decides E' per block; the expert axis of a
leaf is the one axis whose size differs (axis 0 of `[E, ...]`, the last of the router kernel,
axis 1 of a scanned `[layers, E, ...]`). The sources of a block's new experts:

  'tile'         expert E + j copies expert j mod E: E' = m E gives every expert m - 1 copies
  'most_used'    the experts by usage, most used first (`usage`: {block: [E]}, e.g. the mean
                 router probability `router_usage` measures on batches), cycling when E' > 2 E
  'router_norm'  the experts by the norm of their router column, largest first (data-free)
  [s_0, ...]     explicit, the same for every block; {block: [...]} per block

Function preservation. The router is linear without a bias, so no router column puts a new
expert's logit below all others for every input; a copied column gives it exactly its source's
logit. The softmax over E' experts then divides every probability by 1 + r(x), r(x) the total
probability of the copied sources (counted once per copy):

  * Every expert copied m - 1 times ('tile', E' = m E): r = m - 1 for every token, every
    probability p / m. With Top-K and k' = m k each chosen expert comes with its m copies, whose
    weights p / m sum to p, in its priority order (so with the same slots per expert the same
    tokens are dropped); with Expert Choice and the same slots per expert each copy ranks tokens
    by p / m as its source by p and takes the same ones. The grown block computes the same
    function, combine weights normalized or not, up to float rounding of the softmax sum, with
    m times the expert work per token. Copies then get the gradients of their sources: they
    stay copies unless something tells them apart (expert dropout draws per expert).
  * Top-1 with normalized combine weights, any sources: every token goes to its expert or to an
    identical copy of it (`lax.top_k` gives ties to the lower index, the source), at weight 1,
    provided no token is dropped (capacity not binding). The copies get (next to) no tokens at
    the growth step; the load-balancing loss separates their router columns from their sources'.
  * Otherwise (unnormalized weights with uneven copies, Top-K with the same k > 1, Expert Choice
    with uneven copies) every weight shrinks by 1 / (1 + r(x)), or a copy joins its source's
    tokens: the function changes at the growth step.

Slots per expert shrink as E grows (`capacity.Vmoe`: K C S / E, `capacity.T5X`: C S / E, not
times K): scale the capacity factor by m for Expert Choice and for T5X-convention Top-K (V-MoE
convention Top-K keeps its slots when k and E both grow m times). Flaxformer's grouping
(`grouping.Flaxformer`) depends on E: exactness also needs the same groups.
"""

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from upcycle import tree
from upcycle.upcycling import execute
from upcycle.upcycling.growth import grown, source_indices, taken
from upcycle.upcycling.plan import Leaf, Plan

SOURCES = ('tile', 'most_used', 'router_norm')
Sources = Union[str, Sequence[int], Mapping[str, Union[str, Sequence[int]]]]

FIX = ('the grown model must be the checkpoint\'s architecture with more experts (the same '
       'config but num_experts, capacity factor or k, and the same MoE placement)')


def router_usage(logits: Mapping[str, Any],
                 token_mask: Optional[Mapping[str, Any]] = None) -> Dict[str, np.ndarray]:
  """Mean router probability of every expert over real tokens: {block: [E]}.

  Args:
    logits: {block: router logits `[..., E]`}, e.g. `upcycle.moe.router_logits(state)` of a
      model applied with `mutable=[ROUTER_LOGITS]`; several batches concatenated on axis 0.
    token_mask: {block: `[...]` bool}, False for padding; None counts every token.
  """
  out = {}
  for layer, x in logits.items():
    x = np.asarray(x, np.float64)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    mask = np.ones(probs.shape[:-1], bool) if token_mask is None else np.asarray(
        token_mask[layer], bool)
    out[layer] = probs[mask].mean(axis=0)
  return out


def _ranking(spec: str, layer: str, num_old: int, usage, router, binding: str) -> np.ndarray:
  if spec == 'most_used':
    if usage is None or layer not in usage:
      raise ValueError(
          f"{binding}='most_used' needs the usage of the experts of {layer}, which usage "
          f'{"is not given" if usage is None else f"lacks (it has {sorted(usage)})"}. Fix: pass '
          f'usage={{block: [E] usage}} (e.g. router_usage(router logits of a few batches)), or '
          f"{binding}='router_norm' / 'tile' / a list of expert indices.")
    values = np.asarray(usage[layer], np.float64)
    if values.shape != (num_old,):
      raise ValueError(f'usage[{layer!r}] has shape {values.shape}; the checkpoint block has '
                       f'{num_old} experts. Fix: measure usage on this checkpoint.')
  else:
    values = router()
  return np.argsort(-values, kind='stable')


def choose_sources(spec: Sources, layer: str, num_old: int, num_new: int, *,
                   usage: Optional[Mapping[str, Any]] = None, router=None,
                   binding: str = 'sources') -> Tuple[int, ...]:
  """The source expert of each of the `num_new - num_old` new experts of block `layer`.

  Args:
    spec: see the module docstring.
    layer: the block X.
    num_old, num_new: E and E'.
    usage: {block: [E]} for 'most_used'.
    router: () -> [E] router column norms, for 'router_norm'.
    binding: the name of `spec` in errors (a gin binding in the restore hook).
  """
  if isinstance(spec, Mapping):
    if layer not in spec:
      raise ValueError(f'{binding} has no entry for the MoE block {layer} (it has '
                       f'{sorted(spec)}). Fix: give every grown block its sources.')
    spec, binding = spec[layer], f'{binding}[{layer!r}]'
  count = num_new - num_old
  if isinstance(spec, str):
    if spec not in SOURCES:
      raise ValueError(f'{binding}={spec!r}: expected one of {SOURCES} or a list of expert '
                       f'indices.')
    if spec == 'tile':
      return tuple(j % num_old for j in range(count))
    ranking = _ranking(spec, layer, num_old, usage, router, binding)
    return tuple(int(ranking[j % num_old]) for j in range(count))
  return source_indices(
      spec, count=count, bound=num_old, binding=binding,
      expected=f'one of {SOURCES} or a list of expert indices',
      grows=f'{layer}, which grows from {num_old} to {num_new} experts',
      what='source indices (one per new expert)',
      fix='list one source per new expert, or grow the model by as many experts as listed')


def _expert_axis(path: str, leaf, source) -> Optional[int]:
  old, new = tree.shape_of(source), tree.shape_of(leaf)
  differ = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
  if len(old) != len(new) or len(differ) > 1:
    raise ValueError(f'Target leaf {path} has shape {new} but checkpoint leaf {path} has {old}: '
                     f'growing changes the expert axis only. Fix: {FIX}.')
  return differ[0] if differ else None   # dtypes: growth.taken checks them


def _block(layer: str, paths: Sequence[str], tgt, flat, roles, spec, usage, binding):
  """(leaves, note) of one MoE block."""
  missing = [p for p in paths if p not in flat]
  if missing:
    raise ValueError(f'Target leaf {missing[0]} has no checkpoint leaf to grow from. Fix: start '
                     f'from a checkpoint of an MoE with the same MoE blocks (a dense checkpoint '
                     f'is upcycled instead: upcycling.upcycle, modes.Upcycle); '
                     f'{FIX}.')
  axes = {p: _expert_axis(p, tgt[p], flat[p]) for p in paths}
  sizes = {(tree.shape_of(flat[p])[a], tree.shape_of(tgt[p])[a]) for p, a in axes.items()
           if a is not None}
  if not sizes:
    return [taken(p, tgt[p], p, flat[p], FIX) for p in paths], f'{layer}: unchanged'
  if len(sizes) > 1 or None in axes.values():
    detail = ', '.join(f'{p} {tree.shape_of(flat[p])} -> {tree.shape_of(tgt[p])}' for p in paths)
    raise ValueError(f'The leaves of the MoE block {layer} do not grow alike: {detail}. '
                     f'Fix: {FIX}.')
  (num_old, num_new), = sizes
  if num_new < num_old:
    raise ValueError(f'{layer} has {num_old} experts in the checkpoint and {num_new} in the '
                     f'target: growing only adds experts. Fix: {FIX}.')

  def router_norms():
    norms = np.zeros(num_old)
    for p in paths:
      if roles[p].kind == tree.ROUTER:
        x = np.moveaxis(np.asarray(flat[p], np.float64), axes[p], -1)
        norms += np.square(x.reshape(-1, num_old)).sum(axis=0)
    return np.sqrt(norms)

  sources = choose_sources(spec, layer, num_old, num_new, usage=usage, router=router_norms,
                           binding=binding)
  index = tuple(range(num_old)) + sources
  leaves = [taken(p, tgt[p], p, flat[p], FIX, axes[p], index) for p in paths]
  return leaves, (f'{layer}: {num_old} -> {num_new} experts, new experts '
                 f'{list(range(num_old, num_new))} copy {list(sources)}')


def plan(params: Mapping[str, Any], target: Mapping[str, Any], *, sources: Sources = 'tile',
         usage: Optional[Mapping[str, Any]] = None, step: int = 0,
         binding: str = 'sources') -> Plan:
  """The plan that grows `params` into `target`; reads only router kernels ('router_norm').

  Args:
    params: nested or flat dict of the trained MoE's leaves (arrays, lazy or abstract).
    target: nested dict of the grown model's abstract params; flax boxes are opened.
    sources: which experts the new ones copy (module docstring).
    usage: {block: [E]} for sources='most_used'.
    step: the step the grown model starts at.
    binding: the name of `sources` in errors.

  Raises:
    ValueError: naming the path for a target leaf without a checkpoint leaf, a change other
      than the expert axis, fewer experts, and the binding for bad sources.
  """
  flat, tgt = tree.flatten(params), tree.flatten(target)
  roles = tree.classify(tgt)
  leaves: Dict[str, Leaf] = {}
  blocks: Dict[str, list] = {}
  for path, role in roles.items():
    if role.kind == 'copy':
      leaves[path] = taken(path, tgt[path], path, flat.get(path), FIX)
    else:
      blocks.setdefault(role.layer, []).append(path)
  if not blocks:
    raise ValueError(f'The target has no MoE blocks (no X/{tree.EXPERT}/... leaves): nothing to '
                     f'grow. Fix: {FIX}.')
  if isinstance(sources, Mapping) and set(sources) - set(blocks):
    raise ValueError(f'{binding} names {sorted(set(sources) - set(blocks))}, which are not MoE '
                     f'blocks of the target (those are {sorted(blocks)}).')
  notes = []
  for layer, paths in sorted(blocks.items()):
    made, note = _block(layer, paths, tgt, flat, roles, sources, usage, binding)
    leaves.update({leaf.path: leaf for leaf in made})
    notes.append(note)
  return grown([leaves[p] for p in tgt], flat, notes, step)


def grow_experts(params: Mapping[str, Any], target: Mapping[str, Any], *,
                 sources: Sources = 'tile', usage: Optional[Mapping[str, Any]] = None
                 ) -> Tuple[Dict[str, Any], Plan]:
  """A trained MoE's params with more experts per block, shaped like `target`.

  Args:
    params: nested dict of the trained MoE's leaves (e.g. `Checkpoint.params`). Never modified.
    target: the grown model's abstract params, e.g. `models.abstract_params(grown_config)`.
    sources: which experts the new ones copy (module docstring).
    usage: {block: [E]} for sources='most_used' (e.g. `router_usage`).

  Returns:
    (params, plan): a nested dict like `target`, and the growth `Plan` (print it for the
    report). `optimizer_state.carry.carry_optimizer_state` grows the optimizer
    state alike.
  """
  growth = plan(params, target, sources=sources, usage=usage)
  return execute.run(growth, params, jax.random.PRNGKey(0)), growth
