"""Collect what the MoE layers sowed during `model.apply(..., mutable=MOE_COLLECTIONS)`."""

from typing import Dict, Mapping

import flax
import jax.numpy as jnp

MOE_COLLECTIONS = ('aux_loss', 'moe_metrics')
# Sown only when asked for (`mutable=[ROUTER_LOGITS]`): each MoE layer's router logits.
ROUTER_LOGITS = 'router_logits'


def _per_layer(collection: Mapping, name: str) -> Dict[str, jnp.ndarray]:
  """{'encoder/layers_1/mlp': value, ...} for one sown name (each layer is called once)."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(collection))
  return {'/'.join(path[:-1]): values[-1] for path, values in flat.items() if path[-1] == name}


def aux_losses(state: Mapping) -> Dict[str, jnp.ndarray]:
  """Auxiliary losses averaged over the MoE layers of a model.

  Args:
    state: the mutable collections returned by `apply(..., mutable=MOE_COLLECTIONS)`.
  Returns:
    {'load_balancing_loss', 'router_z_loss', 'total'}: 'total' is the mean over
    layers of each layer's weighted sum, what the training loss adds. All zero
    for a dense model.
  """
  losses = state.get('aux_loss', {})
  out = {}
  for name, key in (('load_balancing_loss', 'load_balancing_loss'),
                    ('router_z_loss', 'router_z_loss'), ('total', 'weighted')):
    # A scanned stack sows one value per layer along a leading `layers` axis: average the
    # layers' values, whatever the layout.
    values = [jnp.ravel(v) for v in _per_layer(losses, key).values()]
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
