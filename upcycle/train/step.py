"""The jitted train and eval steps (pure functions of state, batch and rng)."""

from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import optax

from upcycle import tree
from upcycle.models import scan_layout
from upcycle.moe import aux_losses, metrics as moe_metrics
from upcycle.train_state import TrainState

Array = jax.Array


def _microbatches(batch: Dict[str, Array], n: int, name: str = 'num_microbatches'
                  ) -> Dict[str, Array]:
  """`[batch, ...]` -> `[n, batch / n, ...]`; `name`: the setting that asked for `n`."""
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f'{name}={n} does not divide the batch of {x.shape[0]}.')
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])
  return jax.tree.map(split, batch)


def per_layer_metrics(model_config: Any) -> Callable[[Any], Dict[str, Array]]:
  """`state -> {'encoder/layers_1/mlp/expert_usage': ..., ...}`: the MoE layers' routing
  metrics (`moe.metrics`) under per-layer names whether or not the model scans its layers (a
  scanned one sows `[layers]` per sub-block, unrolled by `scan_layout.unstack`), so a run's
  metrics and TensorBoard tags do not depend on SCAN_LAYERS."""
  return lambda state: scan_layout.per_layer(moe_metrics(state), model_config)


ROUTER_KERNEL = 'router/router_weights/w/kernel'   # under an MoE layer (`upcycle.moe.layer`)


def router_kernels(params: Any, model_config: Any) -> Dict[str, Any]:
  """{'encoder/layers_1/mlp': the router kernel `[d_model, E]`} of every MoE layer of `params`
  (arrays or `jax.ShapeDtypeStruct`s), per layer whether or not the model scans its layers."""
  kernels = scan_layout.per_layer(
      {p: v for p, v in tree.flatten(params).items() if p.endswith('/' + ROUTER_KERNEL)},
      model_config)
  return {p[:-len(ROUTER_KERNEL) - 1]: v for p, v in kernels.items()}


def router_kernel_rms(params: Any, model_config: Any) -> Dict[str, Array]:
  """{'<layer>/router_kernel_rms': sqrt(mean(kernel^2))} of every MoE layer's router."""
  return {f'{layer}/router_kernel_rms': jnp.sqrt(jnp.mean(jnp.square(k.astype(jnp.float32))))
          for layer, k in router_kernels(params, model_config).items()}


def make_train_step(objective, optimizer: optax.GradientTransformation,
                    schedule: Callable[[Array], Array], num_microbatches: int = 1,
                    microbatch_unroll: int = 1):
  """-> train_step(state, batch, rng) -> (state, metrics).

  The loss is the cross-entropy summed over the whole batch divided by its total
  weight (target tokens for T5, images for ViT), plus the MoE auxiliary losses
  averaged over layers and microbatches. Its metrics: the loss's parts, and per MoE layer the
  routing metrics it sowed and its router kernel's RMS before this step's update
  (`moe/<layer>/router_kernel_rms`). Microbatching accumulates gradients of
  exactly that loss, so it changes memory, not the result. `microbatch_unroll`: the
  accumulation scan's unroll, microbatches per loop iteration (for the compiler's counts,
  `fit/step_count.py`).
  """

  model_config = objective.model.config
  layer_metrics = per_layer_metrics(model_config)

  def loss_fn(params, batch, rng, total_weight, num_micro):
    rngs = dict(zip(('dropout', 'jitter'), jax.random.split(rng)))
    ce, state = objective.forward(params, batch, train=True, rngs=rngs)
    aux = aux_losses(state)
    loss = ce['loss'] / total_weight + aux['total'] / num_micro
    return loss, {**ce, **{f'moe/{k}': v / num_micro for k, v in aux.items()},
                  **{f'moe/{k}': v / num_micro for k, v in layer_metrics(state).items()},
                  **{f'moe/{k}': v / num_micro
                     for k, v in router_kernel_rms(params, model_config).items()}}

  grad_fn = jax.grad(loss_fn, has_aux=True)

  def train_step(state: TrainState, batch: Dict[str, Array], rng: Array
                 ) -> Tuple[TrainState, Dict[str, Array]]:
    rng = jax.random.fold_in(rng, state.step)
    total_weight = jnp.maximum(objective.loss_weight_sum(batch), 1.0)
    if num_microbatches == 1:
      grads, stats = grad_fn(state.params, batch, rng, total_weight, 1)
    else:
      micro = _microbatches(batch, num_microbatches)

      def accumulate(carry, inputs):
        i, mb = inputs
        g, s = grad_fn(state.params, mb, jax.random.fold_in(rng, i), total_weight,
                       num_microbatches)
        return jax.tree.map(jnp.add, carry, (g, s)), None

      zero = jax.eval_shape(grad_fn, state.params, jax.tree.map(lambda x: x[0], micro), rng,
                            total_weight, num_microbatches)
      zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)
      (grads, stats), _ = jax.lax.scan(accumulate, zero, (jnp.arange(num_microbatches), micro),
                                       unroll=microbatch_unroll)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    weight = jnp.maximum(stats.pop('weight_sum'), 1.0)
    ce_sum, z_sum = stats.pop('loss'), stats.pop('z_loss')
    out = {
        'loss': ce_sum / weight + stats['moe/total'],
        'cross_entropy': (ce_sum - z_sum) / weight,
        'z_loss': z_sum / weight,
        'accuracy': stats.pop('correct') / weight,
        'learning_rate': schedule(state.step),
        'grad_norm': optax.global_norm(grads),
        **stats,
    }
    return TrainState(state.step + 1, params, opt_state), out

  return train_step


def make_eval_step(objective, num_microbatches: int = 1, microbatch_unroll: int = 1):
  """-> eval_step(params, batch) -> sums {'loss', 'correct', 'weight_sum', ...} (no dropout).

  With `num_microbatches`, the batch is evaluated that many rows at a time in a loop (its
  unroll `microbatch_unroll`, as the train step's) and their sums added: a device holds one
  microbatch's activations and logits, not the batch's (MaxText's eval_per_device_batch_size,
  T5X's eval batch), and the sums are the whole batch's up to float rounding. An MoE layer
  routes each microbatch as one, as the train step's microbatches do.
  """

  def sums(params: Any, batch: Dict[str, Array]) -> Dict[str, Array]:
    return objective.forward(params, batch, train=False)[0]

  def eval_step(params: Any, batch: Dict[str, Array]) -> Dict[str, Array]:
    if num_microbatches == 1:
      return sums(params, batch)
    micro = _microbatches(batch, num_microbatches, name='eval_microbatches')
    zero = jax.eval_shape(sums, params, jax.tree.map(lambda x: x[0], micro))
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zero)

    def add(total, microbatch):
      return jax.tree.map(jnp.add, total, sums(params, microbatch)), None

    return jax.lax.scan(add, zero, micro, unroll=microbatch_unroll)[0]

  return eval_step
