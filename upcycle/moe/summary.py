"""Collect what the MoE layers sowed during `model.apply(..., mutable=MOE_COLLECTIONS)`."""

from typing import Dict, Mapping, Tuple

import flax
import jax.numpy as jnp

from upcycle.moe import balance as balances

MOE_COLLECTIONS = ('aux_loss', 'moe_metrics')
# Sown only when asked for (`mutable=[ROUTER_LOGITS]`): each MoE layer's router logits.
ROUTER_LOGITS = 'router_logits'


def _per_layer(collection: Mapping, name: str) -> Dict[str, jnp.ndarray]:
  """{'encoder/layers_1/mlp': value, ...} for one sown name (each layer is called once)."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(collection))
  return {'/'.join(path[:-1]): values[-1] for path, values in flat.items() if path[-1] == name}


def _pooled_balance(losses: Mapping) -> Tuple[Dict[str, jnp.ndarray], Dict[str, jnp.ndarray]]:
  """Load-balancing loss of the layers whose `MoeConfig.balance` is a `balance.PooledSwitch`.

  The layers of one stack (the first name of their path: 'encoder', 'decoder', ViT's
  'Transformer') pool their statistics into one loss (`balance.PooledSwitch.stack_losses`).
  Returns ({path: that loss}, {path: weighted, the layer's weighted z-loss plus the weighted
  loss}), per layer as sown (`[layers]` in a scanned stack).
  """
  pooled = _per_layer(losses, balances.POOLED)
  weighted = _per_layer(losses, 'weighted')
  stacks = {}
  for path in pooled:
    stacks.setdefault(path.split('/')[0], []).append(path)
  balance, total = {}, {}
  for paths in stacks.values():
    loss, weighted_loss = balances.PooledSwitch.stack_losses([pooled[path] for path in paths])
    for path in paths:
      balance[path] = jnp.full(pooled[path].fraction.shape[:-2], loss)
      total[path] = weighted[path] + weighted_loss
  return balance, total


def aux_losses(state: Mapping) -> Dict[str, jnp.ndarray]:
  """Auxiliary losses averaged over the MoE layers of a model.

  Args:
    state: the mutable collections returned by `apply(..., mutable=MOE_COLLECTIONS)`.
  Returns:
    {'load_balancing_loss', 'router_z_loss', 'total'}: 'total' is the mean over
    layers of each layer's weighted sum, what the training loss adds. A layer whose
    load-balancing loss is pooled over its stack counts the stack's loss. All zero
    for a dense model.
  """
  losses = state.get('aux_loss', {})
  balance, total = _pooled_balance(losses)
  out = {}
  for name, key, pooled in (('load_balancing_loss', 'load_balancing_loss', balance),
                            ('router_z_loss', 'router_z_loss', {}), ('total', 'weighted', total)):
    # A scanned stack sows one value per layer along a leading `layers` axis: average the
    # layers' values, whatever the layout.
    values = [jnp.ravel(v) for v in {**_per_layer(losses, key), **pooled}.values()]
    out[name] = jnp.mean(jnp.concatenate(values)) if values else jnp.zeros((), jnp.float32)
  return out


def metrics(state: Mapping) -> Dict[str, jnp.ndarray]:
  """Per-layer routing metrics: {'encoder/layers_1/mlp/fraction_dropped_tokens': ..., ...}.

  A scanned model's are per sub-block with a leading `layers` axis
  ('encoder/layers/subblock_1/mlp/...' `[layers, ...]`); `models.scan_layout.unstack` of the
  collection gives the per-layer names.
  """
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(state.get('moe_metrics', {})))
  return {'/'.join(path): values[-1] for path, values in flat.items()}


def router_logits(state: Mapping) -> Dict[str, jnp.ndarray]:
  """Router logits per MoE layer, `{'encoder/layers_1/mlp': [batch, length, E]}`.

  Args:
    state: the collections returned by `apply(..., mutable=[ROUTER_LOGITS, ...])`.
  """
  return _per_layer(state.get(ROUTER_LOGITS, {}), 'logits')
