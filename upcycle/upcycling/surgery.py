"""Dense param tree + abstract MoE param tree -> MoE param tree (a pure function).

One rule for T5 and ViT (DESIGN.md, "the naming contract"):

  X/expert/Y  <- experts(dense X/Y), a new leading expert axis of size E
  X/router/Z  <- router initializer (float32, fresh)
  P           <- dense P, copied

The target decides everything: which layers are MoE, E (the leading axis of
its expert leaves), shapes and dtypes. Dtypes must match exactly unless
`cast=True`, which casts dense values to the target's dtypes (e.g. a bfloat16
checkpoint into a float32 model); a silent cast would hide a wrong model
config. Dense leaves nothing was made from are reported, not an error: the
target is the specification, and e.g. a dense head that the MoE model does not
have is harmless. Inputs are never modified.
"""

import difflib
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from upcycle.upcycling import experts as experts_lib
from upcycle.upcycling import paths
from upcycle.upcycling import routers as routers_lib
from upcycle.upcycling.base import ExpertInit, as_array, key_for
from upcycle.upcycling.report import COPIED, EXPERTS, ROUTER, Entry, UpcycleReport
from upcycle.upcycling.sources import MultiSource

Params = Dict[str, Any]


_UPCYCLE_FIX = ('the MoE model must be the dense architecture with MoE blocks (same config and '
                'parameter names as the checkpoint)')
_CONTINUE_FIX = ('the model must be the architecture the checkpoint was trained with (same '
                 'config, MoE blocks included, and parameter names)')


def _missing_leaf_error(path: str, leaf, dense: Mapping[str, Any], why: str,
                        fix: str = _UPCYCLE_FIX) -> ValueError:
  close = difflib.get_close_matches(path, list(dense), n=3, cutoff=0.6)
  hint = f' Closest dense leaves: {", ".join(close)}.' if close else ''
  root = path.split('/')[0]
  if root not in {p.split('/')[0] for p in dense}:
    roots = sorted({p.split('/')[0] for p in dense})
    hint += (f' The dense tree has top-level keys {roots} and no {root!r}: pass both trees '
             f'at the same level (e.g. target["params"] for a flax variables dict).')
  return ValueError(
      f'Target leaf {path} {paths.shape_of(leaf)} {leaf.dtype} matches nothing: {why}.{hint} '
      f'Fix: {fix}.')


def _check_dtype(path: str, target_dtype, source_path: str, source_dtype, cast: bool) -> str:
  if jnp.dtype(target_dtype) == jnp.dtype(source_dtype):
    return ''
  if not cast:
    raise ValueError(
        f'Target leaf {path} has dtype {jnp.dtype(target_dtype).name} but dense leaf '
        f'{source_path} is {jnp.dtype(source_dtype).name}. Fix: pass cast=True to cast dense '
        f'values to the target dtypes, or build the MoE model with param dtype '
        f'{jnp.dtype(source_dtype).name}.')
  return f'cast {jnp.dtype(source_dtype).name} -> {jnp.dtype(target_dtype).name}'


def _copy(path, leaf, dense, cast, label, upcycling=True):
  if path not in dense:
    why = f'there is no dense leaf {path}'
    if upcycling:
      raise _missing_leaf_error(path, leaf, dense, f'{why}, and it is not under X/expert/ or '
                                f'X/router/ of an MoE block')
    raise _missing_leaf_error(path, leaf, dense, why.replace('dense', 'checkpoint'),
                              _CONTINUE_FIX)
  source = dense[path]
  if paths.shape_of(source) != paths.shape_of(leaf):
    fix = ('the MoE model config must match the dense one in everything but its MoE blocks '
           '(d_model, heads, vocab, classes, ...)' if upcycling else _CONTINUE_FIX)
    kind = 'dense' if upcycling else 'checkpoint'
    raise ValueError(
        f'Target leaf {path} has shape {paths.shape_of(leaf)} but {kind} leaf {path} has shape '
        f'{paths.shape_of(source)}. Fix: {fix}.')
  note = _check_dtype(path, leaf.dtype, path, source.dtype, cast)
  value = as_array(source).astype(leaf.dtype)
  entry = Entry(path, COPIED, paths.shape_of(leaf), jnp.dtype(leaf.dtype).name, path, label, note)
  return value, entry


def _experts(layer, names, tgt, dense, init: ExpertInit, rng, cast):
  """Expert leaves of the block at `layer`: {target path: array}, entries, E."""
  target_paths = {name: paths.join(layer, paths.EXPERT, name) for name in names}
  sizes = {paths.shape_of(tgt[p])[0] if paths.shape_of(tgt[p]) else None
           for p in target_paths.values()}
  if len(sizes) != 1 or None in sizes:
    detail = ', '.join(f'{p} {paths.shape_of(tgt[p])}' for p in target_paths.values())
    raise ValueError(f'The expert leaves of the MoE block at {layer} disagree on the number of '
                     f'experts (leading axis): {detail}.')
  num_experts = sizes.pop()
  mlp = {}
  for name, path in target_paths.items():
    source = paths.join(layer, name)
    if source not in dense:
      under = sorted(p for p in dense if p.startswith(layer + '/'))
      raise _missing_leaf_error(path, tgt[path], dense, f'expert leaves are made from the dense '
                                f'leaf {source}, which does not exist (dense leaves under '
                                f'{layer}: {under or "none"})')
    mlp[name] = dense[source]
  dense_shapes = {name: paths.shape_of(x) for name, x in mlp.items()}
  expected = init.expert_shapes(dense_shapes, num_experts, layer)
  notes = {}
  for name, path in target_paths.items():
    want = paths.shape_of(tgt[path])
    if tuple(expected[name]) != want:
      raise ValueError(
          f'Target leaf {path} has shape {want} but {init!r} makes {tuple(expected[name])} from '
          f'dense leaf {paths.join(layer, name)} {dense_shapes[name]} with {num_experts} experts. '
          f'Fix: the experts must have the dense MLP shape (d_model, d_ff) behind the expert '
          f'axis; for experts of d_ff / G use Granular(G).')
    notes[name] = _check_dtype(path, tgt[path].dtype, paths.join(layer, name), mlp[name].dtype, cast)
  made = init(mlp, num_experts, rng, layer=layer)
  out, entries = {}, []
  for name, path in target_paths.items():
    value, leaf = made.get(name), tgt[path]
    if value is None or paths.shape_of(value) != paths.shape_of(leaf):
      got = None if value is None else paths.shape_of(value)
      raise ValueError(f'{init!r} returned {got} for {path}; the target wants '
                       f'{paths.shape_of(leaf)}. This is a bug in the initializer.')
    out[path] = jnp.asarray(value).astype(leaf.dtype)
    entries.append(Entry(path, EXPERTS, paths.shape_of(leaf), jnp.dtype(leaf.dtype).name,
                         paths.join(layer, name), repr(init), notes[name]))
  return out, entries, num_experts


def _router(layer, names, tgt, router_init, expert_init, rng):
  target_paths = {name: paths.join(layer, paths.ROUTER, name) for name in names}
  abstract = {name: tgt[path] for name, path in target_paths.items()}
  made = expert_init.tie_router(router_init(abstract, rng, layer=layer), layer=layer)
  out, entries = {}, []
  for name, path in target_paths.items():
    leaf = tgt[path]
    value = made[name]
    if paths.shape_of(value) != paths.shape_of(leaf):
      raise ValueError(f'{router_init!r} returned {paths.shape_of(value)} for {path}; the '
                       f'target wants {paths.shape_of(leaf)}.')
    out[path] = jnp.asarray(value, leaf.dtype)
    entries.append(Entry(path, ROUTER, paths.shape_of(leaf), jnp.dtype(leaf.dtype).name, '',
                         repr(router_init)))
  return out, entries


def _upcycle(dense_params, target, experts, router, rng, cast, label):
  if isinstance(rng, int):
    rng = jax.random.PRNGKey(rng)
  expert_init = experts_lib.get(experts)
  router_init = routers_lib.get(router)
  dense = paths.flatten(dense_params)
  tgt = paths.flatten(target)
  roles = paths.classify(tgt)
  if not any(role.kind == 'expert' for role in roles.values()):
    raise ValueError(
        f'The target has no MoE blocks (no X/{paths.EXPERT}/... leaves), so the expert rule '
        f'matches nothing. Fix: build the target from the MoE model (T5Config.encoder_moe / '
        f'decoder_moe or ViTConfig.moe set, placement not "none"); to continue training a '
        f'checkpoint of the model\'s own architecture, use copy_params '
        f'(restore.ContinueFromCheckpoint).')
  expert_rng, router_rng = jax.random.split(rng)

  by_layer: Dict[Tuple[str, str], list] = {}
  for path, role in roles.items():
    if role.kind != 'copy':
      by_layer.setdefault((role.kind, role.layer), []).append(role.name)

  values, entries, num_experts, used = {}, [], {}, set()
  for path, role in roles.items():
    if role.kind == 'copy':
      values[path], entry = _copy(path, tgt[path], dense, cast, label)
      entries.append(entry)
      used.add(path)
  for (kind, layer), names in sorted(by_layer.items()):
    if kind == 'expert':
      out, made, num_experts[layer] = _experts(
          layer, names, tgt, dense, expert_init, key_for(expert_rng, layer), cast)
      used.update(paths.join(layer, name) for name in names)
    else:
      if ('expert', layer) not in by_layer:
        raise AssertionError(f'router without experts at {layer}')
      out, made = _router(layer, names, tgt, router_init, expert_init, key_for(router_rng, layer))
    values.update(out)
    entries.extend(made)

  order = {path: i for i, path in enumerate(tgt)}
  entries.sort(key=lambda e: order[e.path])
  report = UpcycleReport(tuple(entries), tuple(p for p in dense if p not in used), num_experts)
  return paths.unflatten({path: values[path] for path in tgt}), report


def upcycle(dense_params: Mapping[str, Any], target: Mapping[str, Any], *,
            experts: Union[str, ExpertInit] = 'copy',
            router: Union[str, routers_lib.RouterInit] = 'normal',
            rng: Union[jax.Array, int], cast: bool = False) -> Tuple[Params, UpcycleReport]:
  """Builds MoE params from dense params, shaped like `target`.

  Args:
    dense_params: nested dict of dense leaves (arrays, numpy or lazily read
      arrays), e.g. `Checkpoint.params`. Never modified.
    target: nested dict of the MoE model's abstract params, e.g.
      `jax.eval_shape(moe_model.init, ...)['params']`; flax partitioning
      boxes are unboxed.
    experts: expert initializer, or one of 'copy', 'drop', 'noise', 'random'.
    router: router initializer, or one of 'normal', 'uniform', 'zeros'.
    rng: key (or int seed). Each layer's draws depend only on the key and the
      layer's path.
    cast: cast dense values to the target dtypes instead of failing on a
      dtype mismatch.

  Returns:
    (params, report): a nested dict like `target` with jax arrays (experts
    `[E, ...]`), and the `UpcycleReport` of what was done to every leaf.

  Raises:
    ValueError: naming the path and both shapes/dtypes for a target leaf that
      matches no dense leaf, a shape or dtype mismatch, or an initializer
      that cannot handle the block.
  """
  if isinstance(experts, MultiSource):
    raise ValueError(f'{type(experts).__name__} also decides the non-expert params: call '
                     f'upcycle_from_checkpoints(experts, target, ...) instead.')
  return _upcycle(dense_params, target, experts, router, rng, cast, 'copy')


def upcycle_from_checkpoints(experts: MultiSource, target: Mapping[str, Any], *,
                             router: Union[str, routers_lib.RouterInit] = 'normal',
                             rng: Union[jax.Array, int],
                             cast: bool = False) -> Tuple[Params, UpcycleReport]:
  """Upcycles several dense checkpoints (Branch-Train-MiX, UpIT) into one MoE.

  Experts come from `experts` (FromCheckpoints or Merge); every other leaf
  from `experts.shared_params()` (the mean of the sources, or source `base`).
  Otherwise exactly `upcycle`.
  """
  if not isinstance(experts, MultiSource):
    raise ValueError(f'upcycle_from_checkpoints needs FromCheckpoints or Merge, got {experts!r}.')
  return _upcycle(experts.shared_params(), target, experts, router, rng, cast,
                  experts.describe_shared())


def copy_params(params: Mapping[str, Any], target: Mapping[str, Any], *,
                cast: bool = False) -> Tuple[Params, UpcycleReport]:
  """Every target leaf copied from the leaf at the same path: no upcycling rule at all.

  For continuing training from a checkpoint of the target's own architecture:
  a dense model from a dense checkpoint, or an MoE model from an MoE checkpoint
  (e.g. one written by `python -m upcycle.convert`), whose `expert/` leaves
  are then copied as they are. Shape and dtype checks and the report are
  those of `upcycle`.

  Returns:
    (params, report): a nested dict like `target`, and the report (every
    entry 'copied'; `unused` lists source leaves the target does not have).
  """
  source = paths.flatten(params)
  values, entries = {}, []
  for path, leaf in paths.flatten(target).items():
    values[path], entry = _copy(path, leaf, source, cast, 'copy', upcycling=False)
    entries.append(entry)
  report = UpcycleReport(tuple(entries), tuple(p for p in source if p not in values), {})
  return paths.unflatten(values), report
