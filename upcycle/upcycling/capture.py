"""Capturing the inputs of a dense model's MLPs, for `router_init.FromData`.

The router of an MoE block sees exactly what the dense MLP it replaces saw
(the pre-MLP normalized hidden state), so the inputs of the dense MLP modules
at the MoE layers are what router rows are initialized from. Flax module
paths equal parameter paths, so the MoE layers of a target tree name the
modules directly.
"""

from typing import Any, Dict, List, Mapping, Sequence

import flax.linen as nn
import jax

from upcycle import tree


def moe_layers(target: Mapping[str, Any]) -> List[str]:
  """Paths X of the MoE blocks of a (possibly abstract) MoE param tree."""
  return list(tree.moe_layers(tree.flatten(target)))


def mlp_inputs(model: nn.Module, variables: Mapping[str, Any], layers: Sequence[str],
               *args, **kwargs) -> Dict[str, jax.Array]:
  """Runs `model.apply(variables, *args, **kwargs)`; returns each layer's MLP input.

  Args:
    model: the dense model.
    variables: its variables, e.g. {'params': dense_params}.
    layers: module paths ('encoder/layers_1/mlp'), e.g. `moe_layers(target)`.
    *args, **kwargs: the model's inputs.

  Returns:
    {layer: the first argument of that module's `__call__`, `[batch, length,
    d_model]`}. Padding positions are included.
  """
  wanted = set(layers)
  captured: Dict[str, jax.Array] = {}

  def interceptor(next_fun, call_args, call_kwargs, context):
    if context.method_name == '__call__':
      path = '/'.join(context.module.path)
      if path in wanted and path not in captured:
        captured[path] = call_args[0]
    return next_fun(*call_args, **call_kwargs)

  with nn.intercept_methods(interceptor):
    model.apply(variables, *args, **kwargs)
  missing = sorted(wanted - set(captured))
  if missing:
    raise ValueError(
        f'mlp_inputs: no module at {missing[0]} was called by {type(model).__name__}; captured '
        f'{sorted(captured) or "none"}. Fix: pass the dense model and MoE layer paths as in the '
        f'target tree (moe_layers(target)).')
  return captured


def hidden_states_per_expert(model: nn.Module, variables: Mapping[str, Any],
                             layers: Sequence[str],
                             batches: Sequence[Mapping[str, Any]]) -> Dict[str, List[jax.Array]]:
  """MLP inputs at `layers` for batch e of each expert e: the input of `router_init.FromData`.

  `batches[e]` holds the keyword inputs of the model for the data expert e
  should handle (e.g. UpIT: the data its source checkpoint does best on).
  """
  per_batch = [mlp_inputs(model, variables, layers, **batch) for batch in batches]
  return {layer: [states[layer] for states in per_batch] for layer in layers}
