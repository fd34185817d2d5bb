"""Depth upcycling: a checkpoint with L layers per stack -> L' layers, each a copy of one of them.

The baseline that deepens a model by stacking its layers (Gong et al. 2019, "stacking"):

  S_i/Y  <- S_{map[i]}/Y   every leaf of layer i of a stack S
  P      <- P              everything outside the stacks

A stack is the first path component of the form <name>_<index>: `encoder/layers_3/...` and
`decoder/layers_3/...` (T5), `Transformer/encoderblock_3/...` (ViT). The layer map of a stack
whose depth changes:

  'tile'     [0, 1, ..., L-1, 0, 1, ..., L-1, ...]   stacking; L' a multiple of L
  'repeat'   [0, 0, 1, 1, ...]                        each layer m times in a row; L' = m L
  [i_0, ..., i_{L'-1}]                                explicit source layers, any L'
  {stack: one of the above}                           per stack ('encoder/layers': ...)

Stacks whose depth does not change are copied as they are (unless a mapping names them).
Not function-preserving: every added layer adds its residual update to the stream. An MoE
checkpoint deepens too where the map sends every MoE layer to an MoE layer of the target
(e.g. 'tile' with 'every_other' placement and even L).
"""

import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax

from upcycle import tree
from upcycle.upcycling import execute
from upcycle.upcycling.growth import grown, source_indices, taken
from upcycle.upcycling.plan import Plan

PATTERNS = ('tile', 'repeat')
LayerMap = Union[str, Sequence[int], Mapping[str, Union[str, Sequence[int]]]]

FIX = ('the deeper model must be the checkpoint\'s architecture with more layers (the same '
       'sizes; for an MoE, a placement the layer map sends MoE layers to); a scanned '
       'checkpoint: upcycle.models.scan_layout.unstack it first')
_LAYER = re.compile(r'^(.+)_(\d+)$')


def split(path: str) -> Optional[Tuple[str, int, str]]:
  """(stack, layer index, rest) of a leaf inside a layer stack, else None.

  'encoder/layers_3/mlp/wo/kernel' -> ('encoder/layers', 3, 'mlp/wo/kernel').
  """
  keys = path.split('/')
  for i, key in enumerate(keys):
    match = _LAYER.match(key)
    if match:
      return '/'.join(keys[:i] + [match.group(1)]), int(match.group(2)), '/'.join(keys[i + 1:])
  return None


def depths(paths) -> Dict[str, int]:
  """{stack: number of layers}; a stack's layers must be numbered 0..L-1."""
  layers: Dict[str, set] = {}
  for path in paths:
    parts = split(path)
    if parts:
      layers.setdefault(parts[0], set()).add(parts[1])
  for stack, indices in layers.items():
    if indices != set(range(len(indices))):
      raise ValueError(f'The layers of {stack} are numbered {sorted(indices)}, not 0..'
                       f'{len(indices) - 1}.')
  return {stack: len(indices) for stack, indices in layers.items()}


def resolve_layer_map(spec: LayerMap, stack: str, old: int, new: int, *,
                      binding: str = 'layer_map') -> Tuple[int, ...]:
  """The source layer of every layer of `stack`, which grows from `old` to `new` layers.

  Args:
    spec: see the module docstring.
    stack: the stack ('encoder/layers').
    old, new: L and L'.
    binding: the name of `spec` in errors (a gin binding in the restore hook).
  """
  if isinstance(spec, Mapping):
    if stack not in spec:
      if old == new:
        return tuple(range(old))
      raise ValueError(f'{binding} has no entry for {stack}, which grows from {old} to {new} '
                       f'layers (it has {sorted(spec)}). Fix: add {stack!r}: \'tile\' (or '
                       f'\'repeat\', or a list of {new} source layers).')
    spec, binding = spec[stack], f'{binding}[{stack!r}]'
  elif old == new:
    return tuple(range(old))
  if isinstance(spec, str):
    if spec not in PATTERNS:
      raise ValueError(f'{binding}={spec!r}: expected one of {PATTERNS}, a list of source '
                       f'layers, or a mapping {{stack: ...}}.')
    if new % old:
      raise ValueError(
          f'{binding}={spec!r}: {stack} grows from {old} to {new} layers, not a multiple of '
          f'{old}. Fix: a depth that is a multiple of {old}, or an explicit list of {new} '
          f'source layers in [0, {old}).')
    return tuple(i % old if spec == 'tile' else i // (new // old) for i in range(new))
  return source_indices(
      spec, count=new, bound=old, binding=binding,
      expected=f'one of {PATTERNS}, a list of source layers, or a mapping {{stack: ...}}',
      grows=f'{stack}, which grows from {old} to {new} layers', what='source layers',
      fix='one source layer per layer of the deeper model')


def plan(params: Mapping[str, Any], target: Mapping[str, Any], *,
         layer_map: LayerMap = 'tile', step: int = 0, binding: str = 'layer_map') -> Plan:
  """The plan that deepens `params` into `target`; nothing is read.

  Args:
    params: nested or flat dict of the checkpoint's leaves (arrays, lazy or abstract).
    target: the deeper model's abstract params; flax boxes are opened.
    layer_map: the layer map (module docstring).
    step: the step the deeper model starts at.
    binding: the name of the layer map in errors.

  Raises:
    ValueError: naming the binding for a bad layer map, and the paths for a target leaf
      without a source leaf of its shape.
  """
  flat, tgt = tree.flatten(params), tree.flatten(target)
  old, new = depths(flat), depths(tgt)
  missing = sorted(set(new) - set(old))
  if missing:
    raise ValueError(f'The target has the layer stack {missing[0]}, which the checkpoint lacks '
                     f'(its stacks: {sorted(old)}). Fix: {FIX}.')
  if isinstance(layer_map, Mapping) and set(layer_map) - set(new):
    raise ValueError(f'{binding} names {sorted(set(layer_map) - set(new))}, which are not '
                     f'layer stacks of the target (those are {sorted(new)}).')
  maps = {stack: resolve_layer_map(layer_map, stack, old[stack], depth, binding=binding)
          for stack, depth in sorted(new.items())}
  leaves = []
  for path, leaf in tgt.items():
    parts = split(path)
    source = path
    if parts and parts[0] in maps:
      stack, index, rest = parts
      source = tree.join(f'{stack}_{maps[stack][index]}', rest)
    leaves.append(taken(path, leaf, source, flat.get(source), FIX))
  notes = tuple(f'{stack}: {old[stack]} -> {len(m)} layers, from layers {list(m)}'
                for stack, m in maps.items() if m != tuple(range(old[stack])))
  return grown(leaves, flat, notes or ('no stack changes depth',), step)


def grow_depth(params: Mapping[str, Any], target: Mapping[str, Any], *,
               layer_map: LayerMap = 'tile') -> Tuple[Dict[str, Any], Plan]:
  """A checkpoint's params with more layers, shaped like `target`.

  Args:
    params: nested dict of the checkpoint's leaves. Never modified.
    target: the deeper model's abstract params, e.g. `models.abstract_params(deeper_config)`.
    layer_map: the layer map (module docstring).

  Returns:
    (params, plan): a nested dict like `target`, and the growth `Plan` (print it for the
    report). `optimizer_state.carry.carry_optimizer_state` deepens the optimizer
    state alike.
  """
  growth = plan(params, target, layer_map=layer_map)
  return execute.run(growth, params, jax.random.PRNGKey(0)), growth
