"""Training losses: cross-entropy with T5's z-loss and label smoothing, normalized by weights."""

import functools
from typing import Any, Callable, Dict, NamedTuple, Optional

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


def chunked_cross_entropy(features: Array, project: Callable[[Any, Array], Array], head: Any,
                          targets: Array, weights: Optional[Array] = None, *, num_chunks: int,
                          z_loss: float = 0.0, label_smoothing: float = 0.0,
                          unroll: bool = False) -> Dict[str, Array]:
  """`cross_entropy(project(head, features), targets, ...)` without the whole `[batch, length,
  vocab]` float32 logits in memory: the sequence is cut into `num_chunks` slices, each slice's
  logits computed, reduced to the sums and dropped (`lax.scan`), so one slice's logits are live
  at a time (MaxText's vocabulary tiling). Slices keep the batch axis whole, so a batch split
  over devices stays split. Equal to `cross_entropy` up to the order of the sums.

  Differentiated, each slice's gradients of 'loss' with respect to its features and `head` are
  computed in the forward pass, beside its logits, and kept (a custom VJP; the backward pass
  scales them by the loss's cotangent): no slice's logits are computed twice, as a
  rematerializing backward would (2 x tokens x d x vocab FLOPs more), and the features'
  gradient `[batch, length, d]` (in their dtype) is what stays between the passes. Only 'loss'
  carries gradients ('z_loss', its part, is reported; 'correct' and 'weight_sum' have none).

  Args:
    features: `[batch, length, d]`, what `project` turns into logits.
    project: `(head, [batch, n, d])` -> float32 logits `[batch, n, vocab]`.
    head: the parameters `project` reads (the output layer's, or the tied embedding).
    targets, weights, z_loss, label_smoothing: as `cross_entropy`'s (`[batch, length]`).
    num_chunks: slices of the sequence; must divide `length`.
    unroll: the slices' loop unrolled (the same values and memory bound; what the compile-ahead
      counting copies compile, since the compiler counts a loop's body once).
  """
  length = targets.shape[1]
  if length % num_chunks:
    raise ValueError(f'chunked_cross_entropy: num_chunks={num_chunks} does not divide the '
                     f'sequence length {length}.')
  weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
  settings = _Chunking(project, num_chunks, z_loss, label_smoothing, unroll)
  return _chunked(settings, features, head, targets, weights)


class _Chunking(NamedTuple):
  """`chunked_cross_entropy`'s static arguments."""
  project: Callable[[Any, Array], Array]
  num_chunks: int
  z_loss: float
  label_smoothing: float
  unroll: bool

  def slices(self, x: Array) -> Array:
    """`[batch, length, ...]` -> `[chunks, batch, length / chunks, ...]`."""
    batch, length = x.shape[:2]
    shape = (batch, self.num_chunks, length // self.num_chunks) + x.shape[2:]
    return jnp.moveaxis(x.reshape(shape), 1, 0)

  def whole(self, x: Array) -> Array:
    """`slices`' inverse."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])

  def sums(self, head: Any, x: Array, targets: Array, weights: Array) -> Dict[str, Array]:
    return cross_entropy(self.project(head, x), targets, weights, self.z_loss,
                         self.label_smoothing)


_SUMS = ('loss', 'z_loss', 'correct', 'weight_sum')


def _zeros() -> Dict[str, Array]:
  return {name: jnp.zeros((), jnp.float32) for name in _SUMS}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(settings: _Chunking, features: Array, head: Any, targets: Array,
             weights: Array) -> Dict[str, Array]:
  def add(total, chunk):
    return jax.tree.map(jnp.add, total, settings.sums(head, *chunk)), None

  chunks = tuple(map(settings.slices, (features, targets, weights)))
  return jax.lax.scan(add, _zeros(), chunks, unroll=settings.unroll)[0]


def _chunked_forward(settings: _Chunking, features: Array, head: Any, targets: Array,
                     weights: Array):
  def loss(x, h, t, w):
    sums = settings.sums(h, x, t, w)
    return sums['loss'], sums

  gradients = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

  def add(carry, chunk):
    total, head_grad = carry
    x, t, w = chunk
    (_, sums), (x_grad, h_grad) = gradients(x, head, t, w)
    return (jax.tree.map(jnp.add, total, sums), jax.tree.map(jnp.add, head_grad, h_grad)), x_grad

  zero_head = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), head)
  chunks = tuple(map(settings.slices, (features, targets, weights)))
  (total, head_grad), x_grads = jax.lax.scan(add, (_zeros(), zero_head), chunks,
                                             unroll=settings.unroll)
  return total, (settings.whole(x_grads), head_grad)


def _chunked_backward(settings: _Chunking, residuals, cotangent):
  del settings
  features_grad, head_grad = residuals
  scale = cotangent['loss']
  return ((features_grad * scale).astype(features_grad.dtype),
          jax.tree.map(lambda g: (g * scale).astype(g.dtype), head_grad), None, None)


_chunked.defvjp(_chunked_forward, _chunked_backward)
