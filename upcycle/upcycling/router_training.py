"""UpIT's router initialization stage: train only the routers on the expert buckets.

After expert-specific data selection (`data_selection.assign_buckets`), every
token of a sample is labelled with the sample's expert, and the routers of all
MoE layers are trained, everything else frozen, to send it there: the loss is
the cross-entropy of each MoE layer's router logits against that label,
averaged over real tokens and over layers. Ordinary MoE training follows.

The model is reached through a function, so this works for any model whose MoE
layers report their router logits (`upcycle.moe.ROUTER_LOGITS`):
`router_logits_fn(params, batch) -> {layer: (logits [batch, length, E], token_mask [batch, length])}`
(the mask False for padding; encoder and decoder layers have their own lengths).
"""

from typing import Any, Callable, Dict, Iterable, Mapping, Tuple

import jax
import jax.numpy as jnp
import optax

from upcycle import tree

Array = jax.Array
LayerLogits = Mapping[str, Tuple[Array, Array]]
RouterLogitsFn = Callable[[Any, Any], LayerLogits]


def router_loss(logits: LayerLogits, labels: Array) -> Array:
  """Mean over layers of the masked token cross-entropy of router logits.

  Args:
    logits: `{layer: (router logits [batch, length, E], token_mask [batch, length])}`.
    labels: `[batch]` int, the expert of each sample (the label of all its tokens).
  """
  if not logits:
    raise ValueError('router_loss: no router logits; is any layer an MoE layer, and is the '
                     'ROUTER_LOGITS collection mutable in router_logits_fn?')
  losses = []
  for layer_logits, token_mask in logits.values():
    mask = token_mask.astype(jnp.float32)
    target = jnp.broadcast_to(labels[:, None], layer_logits.shape[:2])
    ce = optax.softmax_cross_entropy_with_integer_labels(layer_logits, target)
    losses.append(jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0))
  return jnp.mean(jnp.stack(losses))


def split_routers(params: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """`(router leaves, other leaves)` of a param tree, as flat `{path: leaf}` dicts."""
  flat = tree.flatten(params)
  routers = {p: x for p, x in flat.items() if f'/{tree.ROUTER}/' in f'/{p}'}
  if not routers:
    raise ValueError('split_routers: the param tree has no router leaves (X/router/...).')
  return routers, {p: x for p, x in flat.items() if p not in routers}


def train_routers(params: Any, router_logits_fn: RouterLogitsFn,
                  batches: Iterable[Tuple[Any, Array]], *, steps: int,
                  optimizer: optax.GradientTransformation = optax.adam(1e-2)) -> Any:
  """The router stage: `steps` updates of the routers only; returns the new params.

  Args:
    params: the upcycled MoE param tree.
    router_logits_fn: `(params, batch) -> {layer: (logits [batch, length, E],
      token_mask [batch, length])}`.
    batches: yields `(batch, labels [batch])`, labels the bucket (expert) of
      each sample; at least `steps` of them (cycle a finite list).
    steps: number of updates (UpIT's router-initialization length).
    optimizer: optax transformation for the router leaves.
  """
  if steps < 1:
    raise ValueError(f'train_routers: steps={steps}; expected >= 1.')
  routers, frozen = split_routers(params)

  def loss(r, batch, labels):
    return router_loss(router_logits_fn(tree.unflatten({**frozen, **r}), batch), labels)

  @jax.jit
  def step(r, opt_state, batch, labels):
    value, grads = jax.value_and_grad(loss)(r, batch, labels)
    updates, opt_state = optimizer.update(grads, opt_state, r)
    return optax.apply_updates(r, updates), opt_state, value

  opt_state = optimizer.init(routers)
  iterator = iter(batches)
  for _ in range(steps):
    try:
      batch, labels = next(iterator)
    except StopIteration:
      raise ValueError(f'train_routers: batches ran out before steps={steps}.') from None
    routers, opt_state, _ = step(routers, opt_state, batch, jnp.asarray(labels))
  return tree.unflatten({**frozen, **routers})
