"""Training losses: cross-entropy with T5's z-loss and label smoothing, normalized by weights."""

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(logits: Array, targets: Array, weights: Optional[Array] = None,
                  z_loss: float = 0.0, label_smoothing: float = 0.0) -> Dict[str, Array]:
  """Weighted softmax cross-entropy, summed; normalize by `weight_sum` (target tokens).

  Args:
    logits: `[..., vocab]` float32.
    targets: `[...]` int class ids.
    weights: `[...]`, e.g. T5's decoder_loss_weights (0 on padding); None = all 1.
    z_loss: T5's auxiliary loss z_loss * log(Z)^2 that keeps the softmax
      normalizer near 1 (1e-4 in T5X).
    label_smoothing: mass spread uniformly over the vocabulary; the loss is
      reported minus its minimum (the smoothed target's entropy), as T5X does.
  Returns:
    {'loss': sum of weighted losses incl. z-loss, 'z_loss': its z part,
     'correct': sum of weighted correct argmaxes, 'weight_sum'}.
  """
  vocab = logits.shape[-1]
  logits = jnp.asarray(logits, jnp.float32)
  weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1) if vocab > 1 else 0.0
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  normalizer = -(confidence * jnp.log(confidence) +
                 (vocab - 1) * low * jnp.log(low + 1e-20)) if label_smoothing else 0.0
  log_z = jax.nn.logsumexp(logits, axis=-1)
  log_probs = logits - log_z[..., None]
  token_loss = -jnp.sum(soft * log_probs, axis=-1) - normalizer
  token_z = z_loss * jnp.square(log_z)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return {
      'loss': jnp.sum((token_loss + token_z) * weights),
      'z_loss': jnp.sum(token_z * weights),
      'correct': jnp.sum(correct * weights),
      'weight_sum': jnp.sum(weights),
  }


def chunked_cross_entropy(features: Array, project: Callable[[Array], Array], targets: Array,
                          weights: Optional[Array] = None, *, num_chunks: int,
                          z_loss: float = 0.0, label_smoothing: float = 0.0,
                          unroll: bool = False) -> Dict[str, Array]:
  """`cross_entropy(project(features), targets, ...)` without the whole `[batch, length,
  vocab]` float32 logits in memory: the sequence is cut into `num_chunks` slices, each
  slice's logits computed, reduced to the sums and dropped (`lax.scan`), and computed again in
  the backward pass (`jax.checkpoint`), so one slice's logits are live at a time (MaxText's
  vocabulary tiling). Slices keep the batch axis whole, so a batch split over devices stays
  split. Equal to `cross_entropy` up to the order of the sums.

  Args:
    features: `[batch, length, d]`, what `project` turns into logits.
    project: `[batch, n, d]` -> float32 logits `[batch, n, vocab]`.
    targets, weights, z_loss, label_smoothing: as `cross_entropy`'s (`[batch, length]`).
    num_chunks: slices of the sequence; must divide `length`.
    unroll: the slices' loop unrolled (the same values and memory bound; what the compile-ahead
      counting copies compile, since the compiler counts a loop's body once).
  """
  batch, length = targets.shape
  if length % num_chunks:
    raise ValueError(f'chunked_cross_entropy: num_chunks={num_chunks} does not divide the '
                     f'sequence length {length}.')
  weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights

  def slices(x: Array) -> Array:   # [batch, length, ...] -> [chunks, batch, length / chunks, ...]
    return jnp.moveaxis(x.reshape((batch, num_chunks, length // num_chunks) + x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one(x, t, w):
    return cross_entropy(project(x), t, w, z_loss, label_smoothing)

  def add(total, chunk):
    return jax.tree.map(jnp.add, total, one(*chunk)), None

  zeros = {name: jnp.zeros((), jnp.float32) for name in ('loss', 'z_loss', 'correct',
                                                           'weight_sum')}
  total, _ = jax.lax.scan(add, zeros, (slices(features), slices(targets), slices(weights)),
                          unroll=unroll)
  return total
