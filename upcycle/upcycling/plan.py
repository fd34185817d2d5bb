"""The upcycling plan: what every target leaf is made from, decided once, before any data.

One rule for T5 and ViT (`upcycle.tree`, "the naming rule"):

  X/expert/Y         <- experts(dense X/Y), a new leading expert axis of size E
  X/router/Z         <- router initializer (float32, fresh)
  X/shared_expert/Y  <- dense X/Y, copied; a shared expert of smaller d_ff takes the first
                        d_ff units (columns of the input projections and their biases, rows
                        of the output projection; `ffn.D_FF_AXES`), a larger one is refused
  P                  <- dense P, copied

A shared expert copied whole makes the upcycled block routed(x) + dense(x): the dense MLP
exactly only if the routed experts' output starts at zero (`experts.ZeroOutput`); copied
experts with normalized combine weights give 2 x dense(x) for every routed token.

The target decides everything: which layers are MoE, E (the leading axis of its expert
leaves), shapes and dtypes. A dtype that holds every source value (a bfloat16 checkpoint into
a float32 model) is cast and noted in the report ('cast bfloat16 -> float32 (exact)'); one that
would round them (float32 into bfloat16) needs `cast=True` and is noted as rounding. Dense leaves
nothing is made from are reported, not an error: the target is the specification, and e.g. a dense
head that the MoE model does not have is harmless.

Growing a trained checkpoint is a plan too (`expert_growth.py`, `depth_growth.py`): it has no
MoE blocks to initialize, and each leaf is taken from one checkpoint leaf, whole or along one
axis (`Leaf.op`, a `leaf_ops.Take`: new experts copy old ones, new layers copy old layers).

A plan is built from shapes and dtypes only, so every check runs before anything is read.
It prints as the report. Three executors run it (`execute.py`): eagerly on the host,
inside one sharded `jax.jit` (the training restore hooks), and block by block to disk
(`stream.py`, `python -m upcycle.convert`).
"""

import dataclasses
import difflib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import leaf_ops, tree
from upcycle.upcycling import ffn
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.report import (COPIED, EXPERTS, ROUTER, SHARED, TAKEN, Entry,
                                      UpcycleReport)
from upcycle.upcycling.router_init import RouterInit

UPCYCLE_FIX = ('the MoE model must be the dense architecture with MoE blocks (same config and '
               'parameter names as the checkpoint)')
CONTINUE_FIX = ('the model must be the architecture the checkpoint was trained with (same '
                'config, MoE blocks included, and parameter names)')


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One target leaf and what it is made from.

  Attributes:
    path: the target path.
    shape: the target shape.
    dtype: the target dtype (numpy name).
    source: the dense path it is made from ('' for routers).
    source_shape: the dense leaf's shape (() for routers).
    note: e.g. 'cast bfloat16 -> float32'.
    op: how the leaf is made from its source (`leaf_ops`): `Copy`, or `Take` along one axis
      (grown experts and layers, a narrower shared expert's first d_ff units). Experts
      (`Block.experts`) are made by the plan's expert initializer, routers by its router
      initializer.
  """

  path: str
  shape: Tuple[int, ...]
  dtype: str
  source: str = ''
  source_shape: Tuple[int, ...] = ()
  note: str = ''
  op: leaf_ops.Op = leaf_ops.COPY


@dataclasses.dataclass(frozen=True)
class Block:
  """One MoE block X: its expert and shared-expert leaves (from the dense MLP X/...) and
  router leaves.

  `experts`, `router` and `shared` map the name below X/expert/, X/router/ or
  X/shared_expert/ to the target leaf (`shared` is empty without a shared expert).
  """

  layer: str
  num_experts: int
  experts: Mapping[str, Leaf]
  router: Mapping[str, Leaf]
  shared: Mapping[str, Leaf]

  @property
  def leaves(self) -> Tuple[Leaf, ...]:
    return (tuple(self.experts.values()) + tuple(self.router.values())
            + tuple(self.shared.values()))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every target leaf's origin, the initializers, and the start step.

  Attributes:
    copies: leaves copied from the dense leaf at `source` (the same path when upcycling;
      growth takes them from other paths or along an axis).
    blocks: the MoE blocks, in path order (none when growing).
    unused: dense leaves nothing is made from.
    experts: the expert initializer (its class decides where experts come from:
      one dense MLP, or several checkpoints for Branch-Train-MiX / UpIT), given
      the plan's MoE layers (`ExpertInit.for_layers`); None without blocks.
    router: the router initializer; None without blocks.
    shared: where copies come from, for the report ('copy', 'mean of 3 sources').
    order: target paths in target order.
    step: the step the upcycled model starts at.
    notes: one line per grown MoE block or layer stack, for the report.
  """

  copies: Tuple[Leaf, ...]
  blocks: Tuple[Block, ...]
  unused: Tuple[str, ...]
  experts: Optional[ExpertInit]
  router: Optional[RouterInit]
  shared: str
  order: Tuple[str, ...]
  step: int = 0
  notes: Tuple[str, ...] = ()

  def report(self) -> UpcycleReport:
    entries = [Entry(c.path, COPIED if c.op == leaf_ops.COPY and c.source == c.path else TAKEN,
                     c.shape,
                     c.dtype, c.source, self.shared, _take_note(c)) for c in self.copies]
    for block in self.blocks:
      entries += [Entry(e.path, EXPERTS, e.shape, e.dtype, e.source, repr(self.experts), e.note)
                  for e in block.experts.values()]
      entries += [Entry(r.path, ROUTER, r.shape, r.dtype, '', repr(self.router))
                  for r in block.router.values()]
      entries += [Entry(s.path, SHARED, s.shape, s.dtype, s.source, self.shared, s.note)
                  for s in block.shared.values()]
    rank = {path: i for i, path in enumerate(self.order)}
    entries.sort(key=lambda e: rank[e.path])
    return UpcycleReport(tuple(entries), self.unused,
                         {b.layer: b.num_experts for b in self.blocks}, self.notes)

  def __str__(self) -> str:
    return str(self.report())

  def ops(self) -> Dict[str, Tuple[str, leaf_ops.Op]]:
    """{target path: (source path, op)} for every target leaf, the leaf ops its optimizer
    slots are carried by: experts `Tile` the dense MLP's (whatever the expert initializer:
    Drop and Noise experts get the dense moments too), routers are `Fresh`."""
    ops = {leaf.path: (leaf.source, leaf.op) for leaf in self.copies}
    for block in self.blocks:
      ops.update({e.path: (e.source, leaf_ops.Tile(block.num_experts))
                  for e in block.experts.values()})
      ops.update({r.path: ('', leaf_ops.FRESH) for r in block.router.values()})
      ops.update({s.path: (s.source, s.op) for s in block.shared.values()})
    return ops


def _take_note(leaf: Leaf) -> str:
  return ', '.join(n for n in (leaf.op.note(), leaf.note) if n)


def _missing_leaf_error(path: str, leaf, dense: Mapping[str, Any], why: str,
                        fix: str = UPCYCLE_FIX) -> ValueError:
  close = difflib.get_close_matches(path, list(dense), n=3, cutoff=0.6)
  hint = f' Closest dense leaves: {", ".join(close)}.' if close else ''
  root = path.split('/')[0]
  if root not in {p.split('/')[0] for p in dense}:
    roots = sorted({p.split('/')[0] for p in dense})
    hint += (f' The dense tree has top-level keys {roots} and no {root!r}: pass both trees '
             f'at the same level (e.g. target["params"] for a flax variables dict).')
  return ValueError(
      f'Target leaf {path} {tree.shape_of(leaf)} {leaf.dtype} matches nothing: {why}.{hint} '
      f'Fix: {fix}.')


def _cast_note(path: str, target_dtype, source_path: str, source_dtype, cast: bool) -> str:
  """The report's note of a leaf whose dtype changes: a cast that keeps every value (a
  bfloat16 checkpoint into a float32 model, as every published Llama trains) always, one that
  rounds them (float32 into bfloat16) only with `cast`, named as such."""
  target, source = jnp.dtype(target_dtype), jnp.dtype(source_dtype)
  if target == source:
    return ''
  if jnp.promote_types(source, target) == target:
    return f'cast {source.name} -> {target.name} (exact)'
  if not cast:
    raise ValueError(
        f'Target leaf {path} has dtype {target.name} but dense leaf {source_path} is '
        f'{source.name}: casting would round its values. Fix: allow it (the restore hook\'s '
        f'cast = True in gin, e.g. --gin.modes.Upcycle.cast=True; python -m '
        f'upcycle.convert --cast), or build the model with param dtype {source.name}.')
  return f'cast {source.name} -> {target.name} (rounds values)'


def _leaf(path, target_leaf, source='', source_leaf=None, cast=False) -> Leaf:
  note = '' if source_leaf is None else _cast_note(path, target_leaf.dtype, source,
                                                  source_leaf.dtype, cast)
  return Leaf(path, tree.shape_of(target_leaf), jnp.dtype(target_leaf.dtype).name, source,
              () if source_leaf is None else tree.shape_of(source_leaf), note)


def _copy(path, leaf, dense, cast, upcycling) -> Leaf:
  kind = 'dense' if upcycling else 'checkpoint'
  if path not in dense:
    why = f'there is no {kind} leaf {path}'
    if upcycling:
      raise _missing_leaf_error(path, leaf, dense, f'{why}, and it is not under X/expert/ or '
                                f'X/router/ of an MoE block')
    raise _missing_leaf_error(path, leaf, dense, why, CONTINUE_FIX)
  if tree.shape_of(dense[path]) != tree.shape_of(leaf):
    fix = ('the MoE model config must match the dense one in everything but its MoE blocks '
           '(d_model, heads, vocab, classes, ...)' if upcycling else CONTINUE_FIX)
    raise ValueError(
        f'Target leaf {path} has shape {tree.shape_of(leaf)} but {kind} leaf {path} has shape '
        f'{tree.shape_of(dense[path])}. Fix: {fix}.')
  return _leaf(path, leaf, path, dense[path], cast)


def _source(path: str, source: str, tgt, dense, layer: str) -> None:
  """Raises unless the dense MLP leaf `source` that target leaf `path` is made from exists."""
  if source not in dense:
    under = sorted(p for p in dense if p.startswith(layer + '/'))
    raise _missing_leaf_error(path, tgt[path], dense, f'it is made from the dense leaf '
                              f'{source}, which does not exist (dense leaves under {layer}: '
                              f'{under or "none"})')


def _shared(layer: str, name: str, tgt, dense, cast: bool) -> Leaf:
  """The shared-expert leaf X/shared_expert/`name`: dense X/`name`, or its first d_ff units."""
  path, source = tree.join(layer, tree.SHARED_EXPERT, name), tree.join(layer, name)
  _source(path, source, tgt, dense, layer)
  leaf = _leaf(path, tgt[path], source, dense[source], cast)
  if leaf.shape == leaf.source_shape:
    return leaf
  axis = ffn.d_ff_axis(name, layer)
  narrow = list(leaf.source_shape)
  if axis is not None and len(leaf.shape) == len(narrow):
    narrow[axis] = leaf.shape[axis]
  if axis is None or tuple(narrow) != leaf.shape or leaf.shape[axis] > leaf.source_shape[axis]:
    raise ValueError(
        f'Target leaf {path} has shape {leaf.shape} but dense leaf {source} has shape '
        f'{leaf.source_shape}: a shared expert is the dense MLP or its first d_ff units, so '
        f'only its d_ff axis may differ, and be smaller. Fix: MoeConfig.shared_expert_d_ff <= '
        f'the dense d_ff (None: the dense d_ff, the function-preserving choice).')
  units = f'first {leaf.shape[axis]} of {leaf.source_shape[axis]} d_ff units'
  return dataclasses.replace(leaf, note=', '.join(n for n in (units, leaf.note) if n),
                             op=leaf_ops.Take(axis, tuple(range(leaf.shape[axis]))))


def _block(layer: str, names: List[str], router_names: List[str], shared_names: List[str],
           tgt, dense, init: ExpertInit, cast: bool) -> Block:
  paths = {name: tree.join(layer, tree.EXPERT, name) for name in names}
  sizes = {tree.shape_of(tgt[p])[:1] for p in paths.values()}
  if len(sizes) != 1 or () in sizes:
    detail = ', '.join(f'{p} {tree.shape_of(tgt[p])}' for p in paths.values())
    raise ValueError(f'The expert leaves of the MoE block at {layer} disagree on the number of '
                     f'experts (leading axis): {detail}.')
  (num_experts,), = sizes
  mlp = {}
  for name, path in paths.items():
    source = tree.join(layer, name)
    _source(path, source, tgt, dense, layer)
    mlp[name] = tree.shape_of(dense[source])
  expected = init.expert_shapes(mlp, num_experts, layer)
  for name, path in paths.items():
    if tuple(expected[name]) != tree.shape_of(tgt[path]):
      raise ValueError(
          f'Target leaf {path} has shape {tree.shape_of(tgt[path])} but {init!r} makes '
          f'{tuple(expected[name])} from dense leaf {tree.join(layer, name)} {mlp[name]} with '
          f'{num_experts} experts. Fix: the experts must have the dense MLP shape (d_model, '
          f'd_ff) behind the expert axis; for experts of d_ff / G use Granular(G).')
  experts = {name: _leaf(path, tgt[path], tree.join(layer, name), dense[tree.join(layer, name)],
                         cast) for name, path in paths.items()}
  router = {name: _leaf(tree.join(layer, tree.ROUTER, name), tgt[tree.join(layer, tree.ROUTER,
                                                                             name)])
            for name in router_names}
  shared = {name: _shared(layer, name, tgt, dense, cast) for name in shared_names}
  return Block(layer, num_experts, experts, router, shared)


def _positions(blocks: Tuple[Block, ...], layers: Optional[Mapping[str, Tuple[str, int]]]
               ) -> Dict[str, Optional[Tuple[str, int]]]:
  """Every block's (stack, layer index): from `layers` (the model config's), which must hold
  exactly the target's MoE blocks, or from the names."""
  moe = [block.layer for block in blocks]
  if layers is None:
    return tree.layer_positions(moe)
  if set(layers) != set(moe):
    raise ValueError(
        f'The model config places MoE blocks at {sorted(layers)}, but the target has them at '
        f'{sorted(moe)}. Fix: build the target from the same config whose moe_positions() are '
        f'passed as layers=.')
  return {layer: layers[layer] for layer in moe}


def make(dense: Mapping[str, Any], target: Mapping[str, Any], experts: ExpertInit,
         router: RouterInit, *, cast: bool = False, shared: str = 'copy', step: int = 0,
         layers: Optional[Mapping[str, Tuple[str, int]]] = None) -> Plan:
  """The plan for `target` from `dense`; nothing is read (leaves need `.shape`, `.dtype`).

  Args:
    dense: nested or flat dict of the dense leaves (arrays, lazy or abstract).
    target: nested dict of the MoE model's abstract params; flax boxes are opened.
    experts, router: the initializers; the plan keeps `experts.for_layers(its MoE layers)`.
    cast: allow dtype casts (listed in the report) instead of failing.
    shared: where copies come from, for the report.
    step: the start step.
    layers: {MLP path: (stack, layer index)} of the model's MoE blocks, from its config
      (`T5Config.moe_positions()`); None reads them from the names (`tree.layer_positions`).
      Initializers that depend on a layer's place (Drop's ramp) get them (`for_layers`).

  Raises:
    ValueError: naming the path and both shapes/dtypes for a target leaf that
      matches no dense leaf, a shape or dtype mismatch, or an initializer that
      cannot make the block.
  """
  flat_dense, tgt = tree.flatten(dense), tree.flatten(target)
  roles = tree.classify(tgt)
  if not any(role.kind == tree.EXPERT for role in roles.values()):
    raise ValueError(
        f'The target has no MoE blocks (no X/{tree.EXPERT}/... leaves), so the expert rule '
        f'matches nothing. Fix: build the target from the MoE model (T5Config.encoder_moe / '
        f'decoder_moe or ViTConfig.moe set, placement not "none"); to continue training a '
        f'checkpoint of the model\'s own architecture, use copy_params '
        f'(the restore hook\'s modes.Continue).')
  members: Dict[str, Dict[str, List[str]]] = {}
  for role in roles.values():
    if role.kind != 'copy':
      members.setdefault(role.layer, {tree.EXPERT: [], tree.ROUTER: [], tree.SHARED_EXPERT: []}
                         )[role.kind].append(role.name)
  copies = tuple(_copy(p, tgt[p], flat_dense, cast, upcycling=True)
                 for p, role in roles.items() if role.kind == 'copy')
  blocks = tuple(_block(layer, names[tree.EXPERT], names[tree.ROUTER],
                        names[tree.SHARED_EXPERT], tgt, flat_dense, experts, cast)
                 for layer, names in sorted(members.items()))
  used = {leaf.source for leaf in copies} | {
      leaf.source for b in blocks for leaf in b.leaves if leaf.source}
  return Plan(copies, blocks, tuple(p for p in flat_dense if p not in used),
              experts.for_layers(_positions(blocks, layers)), router, shared, tuple(tgt),
              int(step))


def identity(source: Mapping[str, Any], target: Mapping[str, Any], *, cast: bool = False,
             step: int = 0) -> Plan:
  """Every target leaf copied from the same path of `source`: continuing a checkpoint of the
  target's own architecture (MoE blocks included), with `make`'s checks and report and no
  initializers. Raises ValueError as `make` does."""
  flat, tgt = tree.flatten(source), tree.flatten(target)
  copies = tuple(_copy(p, leaf, flat, cast, upcycling=False) for p, leaf in tgt.items())
  used = {leaf.source for leaf in copies}
  return Plan(copies, (), tuple(p for p in flat if p not in used), None, None, 'copy',
              tuple(tgt), int(step))
