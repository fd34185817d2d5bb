"""Running a plan on arrays: one MoE block, one copied (or grown) leaf, or the whole tree.

These are pure functions of the dense leaves and a key, so the same code runs eagerly on
the host (`surgery.upcycle`), inside the restore hook's sharded `jax.jit`, and block by
block when streaming to disk (`stream.py`). Each block's draws depend only on the key and
the block's path (`base.key_for`), so all three give the same values. (An initializer may
also make other blocks' draws from the same key, `ExpertInit.for_key`: UpIT's merges with
one pair for the whole model pick it over every layer's merged experts.)
"""

from typing import Any, Dict, Mapping

import jax
import jax.numpy as jnp

from upcycle import tree
from upcycle.upcycling.base import as_array, key_for
from upcycle.upcycling.plan import Block, Leaf, Plan


def copy(leaf: Leaf, value: Any) -> jax.Array:
  """The copied leaf: the dense value by the leaf's op (`leaf_ops`: copied, or taken along
  an axis when the plan grows it or keeps a narrower shared expert's first d_ff units), in
  the target dtype."""
  return leaf.op.apply(as_array(value)).astype(leaf.dtype)


def block(plan: Plan, moe_block: Block, dense: Mapping[str, Any], rng: jax.Array
          ) -> Dict[str, jax.Array]:
  """{target path: array} for the expert, router and shared-expert leaves of one MoE block.

  Args:
    plan: the plan (for its initializers).
    moe_block: one of `plan.blocks`.
    dense: {dense path: value}, at least the block's MLP leaves.
    rng: the plan's key; the block folds in its own path.
  """
  expert_rng, router_rng = jax.random.split(rng)
  layer = moe_block.layer
  mlp = {name: dense[leaf.source] for name, leaf in moe_block.experts.items()}
  made = plan.experts.for_key(expert_rng)(mlp, moe_block.num_experts,
                                          key_for(expert_rng, layer), layer=layer)
  out = {}
  for name, leaf in moe_block.experts.items():
    value = made.get(name)
    if value is None or tree.shape_of(value) != leaf.shape:
      got = None if value is None else tree.shape_of(value)
      raise ValueError(f'{plan.experts!r} returned {got} for {leaf.path}; the target wants '
                       f'{leaf.shape}. This is a bug in the initializer.')
    out[leaf.path] = jnp.asarray(value).astype(leaf.dtype)
  abstract = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
              for name, leaf in moe_block.router.items()}
  routers = plan.experts.tie_router(plan.router(abstract, key_for(router_rng, layer),
                                                layer=layer), layer=layer)
  for name, leaf in moe_block.router.items():
    if tree.shape_of(routers[name]) != leaf.shape:
      raise ValueError(f'{plan.router!r} returned {tree.shape_of(routers[name])} for '
                       f'{leaf.path}; the target wants {leaf.shape}.')
    out[leaf.path] = jnp.asarray(routers[name], leaf.dtype)
  for leaf in moe_block.shared.values():
    out[leaf.path] = copy(leaf, dense[leaf.source])
  return out


def run(plan: Plan, dense: Mapping[str, Any], rng: jax.Array) -> Dict[str, Any]:
  """The whole MoE param tree (nested, in target order); traceable under `jax.jit`.

  Args:
    plan: the plan.
    dense: nested or flat dict of dense values (numpy, lazy or jax arrays, or tracers).
    rng: the key.
  """
  flat = tree.flatten(dense)
  values = {leaf.path: copy(leaf, flat[leaf.source]) for leaf in plan.copies}
  for moe_block in plan.blocks:
    values.update(block(plan, moe_block, flat, rng))
  return tree.unflatten({path: values[path] for path in plan.order})
