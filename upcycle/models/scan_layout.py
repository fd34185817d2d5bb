"""Scanned parameter layout: which layers repeat, and unrolled <-> scanned parameter trees.

A stack of `num_layers` blocks whose MoE placement repeats every `p` layers (the smallest such
`p` dividing `num_layers`) is scanned over `num_layers / p` *periods*; one period holds `p`
sub-blocks, the dense and MoE blocks in placement order. Every parameter of sub-block `j` gets a
leading `layers` axis of length `num_layers / p`; its entry `k` is unrolled layer `i = k·p + j`:

  unrolled  encoder/layers_{i}/REST            [...]
  scanned   encoder/layers/subblock_{j}/REST   [num_layers / p, ...]

e.g. 'every_other' (1, 3, 5, ...) has p = 2: subblock_0 dense, subblock_1 MoE; a dense stack
and 'all' have p = 1. (Flaxformer's scanned MoE, `moe_architecture.MoeEncoderScanBlock`, scans
the same kind of block: `num_layers / num_sparse_layers - 1` dense layers then one sparse one,
its sub-layers `subblock_{j}`; it stacks on axis 1 by default, here the `layers` axis is
first, before an expert's `expert` axis: `[layers, E, d_model, d_ff]`.) A placement that repeats
only with the whole stack (e.g. 'last_2') has nothing to scan and is refused by the config.

`stack(params, config)` / `unstack(params, config)` convert whole trees, so a non-scanned
checkpoint (dense or MoE, e.g. one just upcycled) loads into a scanned model and back. They
work on any tree with the model's structure: parameters, abstract `ShapeDtypeStruct`s, and
(`unstack`) the collections a scanned model sows (MoE losses and metrics, router logits).
"""

import dataclasses
import re
from typing import Any, Dict, List, Sequence, Tuple

import jax
import numpy as np

from upcycle import fields, tree



def period(sparse: Sequence[int], num_layers: int) -> int:
  """Smallest p dividing `num_layers` such that layer i is sparse iff layer i mod p is."""
  sparse = set(sparse)
  for p in range(1, num_layers + 1):
    if num_layers % p == 0 and all((i in sparse) == (i % p in sparse) for i in range(num_layers)):
      return p
  return num_layers


def pattern(sparse: Sequence[int], num_layers: int) -> Tuple[bool, ...]:
  """Whether each sub-block of one period is sparse, e.g. (False, True) for 'every_other'."""
  return tuple(j in set(sparse) for j in range(period(sparse, num_layers)))


def check_scannable(sparse: Sequence[int], num_layers: int, field: str) -> None:
  """Raises if the placement repeats only with the whole stack (nothing to scan over)."""
  p = period(sparse, num_layers)
  if num_layers > 1 and p == num_layers:
    raise fields.ConfigError(
        f'{field}: MoE layers {tuple(sparse)} of {num_layers} do not repeat with a period '
        f'shorter than the stack, so scan_layers=True has nothing to scan over. Fix: a periodic '
        f"placement ('every_other', 'all', or indices that repeat every p layers, p dividing "
        f'{num_layers}), or scan_layers=False.')


def cut_one_stack(config: Any, depth_field: str, depths: Sequence[int]) -> Any:
  """`config.with_depths(depths)` of a config with one stack of `config.<depth_field>` layers
  and its MoE blocks at `config.moe_layers` (ViT, Llama): those below the cut stay where
  they were."""
  (depth,) = depths
  return dataclasses.replace(config, **{depth_field: depth}, scan_layers=False,
                             moe_layers=tuple(i for i in config.sparse_layers() if i < depth))


def stacks(config) -> List[Tuple[str, str, str, int, Tuple[int, ...]]]:
  """(prefix, unrolled block name with '{}', scanned name, num_layers, sparse) per stack."""
  if not hasattr(config, 'layer_stacks'):
    raise TypeError(f'scan_layout: expected a T5Config, ViTConfig or LlamaConfig, got '
                    f'{type(config).__name__}.')
  return config.layer_stacks()


def _stack_leaves(leaves: Sequence[Any]) -> Any:
  def one(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape), xs[0].dtype)
    if all(isinstance(x, np.ndarray) for x in xs):
      return np.stack(xs)
    return jax.numpy.stack(xs)
  return jax.tree.map(one, *leaves)


def _slice_leaf(leaf: Any, k: int) -> Any:
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      sharding = x.sharding
      if isinstance(sharding, jax.sharding.NamedSharding):   # without the `layers` axis
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:]))
      return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype, sharding=sharding)
    return x[k]
  return jax.tree.map(one, leaf)


def stack(params: Any, config) -> Dict[str, Any]:
  """Unrolled tree (`.../layers_{i}/...`) -> the scanned layout of `config`'s stacks.

  `config` describes the model (its placement decides the period); its `scan_layers` is not
  read, so the same config converts both ways. Leaves keep their type (numpy, jax, abstract).
  """
  flat = tree.flatten(params)
  out = {}
  for prefix, block, scanned, num_layers, sparse in stacks(config):
    p = period(sparse, num_layers)
    head = re.compile(re.escape(f'{prefix}/') + block.replace('{}', r'(\d+)') + '/(.*)')
    rests: Dict[str, Dict[int, Any]] = {}
    for path in [q for q in flat if head.fullmatch(q)]:
      i, rest = head.fullmatch(path).groups()
      rests.setdefault(rest, {})[int(i)] = flat.pop(path)
    for rest, by_layer in rests.items():
      for j in range(p):
        layer_ids = list(range(j, num_layers, p))
        missing = [i for i in layer_ids if i not in by_layer]
        if len(missing) == len(layer_ids):
          continue        # a leaf of the other kind of sub-block (dense vs MoE)
        if missing:
          raise ValueError(f'scan_layout.stack: {prefix}/{block.format(missing[0])}/{rest} is '
                           f'missing; layers {layer_ids} share sub-block {j} and must all have it.')
        out[f'{prefix}/{scanned}/{tree.SUBBLOCK.format(j)}/{rest}'] = _stack_leaves(
            [by_layer[i] for i in layer_ids])
  out.update(flat)
  return tree.unflatten(out)


def unstack(params: Any, config) -> Dict[str, Any]:
  """Scanned tree -> unrolled (`.../layers_{i}/...`); the inverse of `stack`.

  Also turns a scanned model's sown collections (e.g. `{'aux_loss': ...}` from
  `apply(..., mutable=MOE_COLLECTIONS)`) into per-layer names, when given one collection.
  """
  flat = tree.flatten(params)
  out = {}
  for prefix, block, scanned, num_layers, sparse in stacks(config):
    p = period(sparse, num_layers)
    head = re.compile(re.escape(f'{prefix}/{scanned}/') + tree.SUBBLOCK.replace('{}', r'(\d+)')
                      + '/(.*)')
    for path in [q for q in flat if head.fullmatch(q)]:
      j, rest = head.fullmatch(path).groups()
      leaf = flat.pop(path)
      for k in range(num_layers // p):
        out[f'{prefix}/{block.format(k * p + int(j))}/{rest}'] = _slice_leaf(leaf, k)
  out.update(flat)
  return tree.unflatten(out)


def per_layer(flat: Dict[str, Any], config) -> Dict[str, Any]:
  """A flat dict of leaves or sown values of a model of `config` under per-layer names
  (`encoder/layers_{i}/...`): `unstack`ed where the model scans its layers, else as given."""
  if not getattr(config, 'scan_layers', False):
    return flat
  return tree.flatten(unstack(tree.unflatten(flat), config))
