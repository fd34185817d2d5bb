"""Beam search with T5X's brevity penalty, as a `jax.lax.while_loop`.

Semantics as T5X (`t5x/decoding.py: beam_search`):
- Each step extends every live beam by every token and keeps the `2 * beams` most likely
  candidates, so that `beams` stay live even if `beams` of them just emitted EOS.
- A candidate ending in EOS is finished; its score is its log-probability divided by
  `brevity_penalty(alpha, length)` = ((5 + length) / 6) ** alpha, length counting EOS. Any of
  the `2 * beams` candidates may enter the finished set (the best `beams` finished so far).
- The best `beams` candidates not ending in EOS stay live (ranked by log-probability).
- The search stops at `max_length` or once, for every example, all `beams` finished slots are
  filled and no live beam could still beat the worst of them (its log-probability over the
  largest penalty, that of `max_length`).
- An example with no finished sequence at the end returns its live beams (scored by
  log-probability); live beams are not added to a non-empty finished set.
"""

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from upcycle.decoding import beams as beam_ops
from upcycle.decoding import sampling
from upcycle.decoding.sampling import Cache, StepFn

Array = jax.Array
NEG_INF = -1.0e7   # "minus infinity" that stays finite through sums, as T5X's.


def brevity_penalty(alpha: float, length) -> Array:
  """T5X's (GNMT's) length normalization: ((5 + length) / 6) ** alpha."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


def beam_search(step_fn: StepFn, cache: Cache, *, batch_size: int, max_length: int,
                eos_id: sampling.EosId, num_beams: int, alpha: float = 0.6,
                initial_tokens: Optional[Array] = None) -> Tuple[Array, Array]:
  """Beam search over `num_beams` beams per example.

  Args:
    step_fn: one cached decoder step (`sampling.StepFn`) for `batch * beams` sequences.
    cache: the decoder cache for `batch_size` examples; expanded here to `batch * beams`.
    batch_size: examples decoded at once.
    max_length: tokens to decode at most.
    eos_id: end-of-sequence token, or a tuple of them (ends at any).
    num_beams: beams per example.
    alpha: brevity-penalty exponent (0: rank by log-probability alone).
    initial_tokens: `[batch]` int32, the first step's input (None: 0, T5's decoder start).

  Returns:
    sequences `[batch, beams, max_length]` int32 (0 after EOS), best first, and their scores
    `[batch, beams]` (log-probability / brevity penalty).
  """
  b, k = batch_size, num_beams
  # Sequences carry a leading token, the first step's input (T5's decoder start 0).
  seq_shape = (b, k, max_length + 1)
  first = (jnp.zeros((b,), jnp.int32) if initial_tokens is None
           else jnp.asarray(initial_tokens, jnp.int32))
  max_penalty = brevity_penalty(alpha, max_length)

  def cond(state):
    i, live_log_probs, _, finished_scores, _, finished, _ = state
    best_live = live_log_probs[:, 0] / max_penalty
    settled = jnp.all(finished, axis=1) & (jnp.min(finished_scores, axis=1) > best_live)
    return (i < max_length) & ~jnp.all(settled)

  def body(state):
    i, live_log_probs, live_seqs, finished_scores, finished_seqs, finished, cache = state
    tokens = jax.lax.dynamic_index_in_dim(live_seqs, i, axis=2, keepdims=False)   # [b, k]
    logits, cache = step_fn(tokens.reshape(b * k), cache)
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits).reshape(b, k, vocab) + live_log_probs[..., None]
    top_log_probs, top_index = jax.lax.top_k(log_probs.reshape(b, k * vocab), 2 * k)
    from_beam, token = top_index // vocab, top_index % vocab                 # [b, 2k]
    candidates = beam_ops.take_beams(live_seqs, from_beam)                    # [b, 2k, len]
    candidates = jax.lax.dynamic_update_index_in_dim(candidates, token, i + 1, axis=2)
    ends = sampling.is_eos(token, eos_id)

    # Live: the best k candidates that did not just end.
    _, keep = jax.lax.top_k(top_log_probs + ends * NEG_INF, k)
    live_log_probs = beam_ops.take_beams(top_log_probs + ends * NEG_INF, keep)
    live_seqs = beam_ops.take_beams(candidates, keep)
    cache = beam_ops.gather(cache, beam_ops.take_beams(from_beam, keep))

    # Finished: the best k of those finished before and those that just ended.
    new_scores = top_log_probs / brevity_penalty(alpha, i + 1) + (~ends) * NEG_INF
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    all_seqs = jnp.concatenate([finished_seqs, candidates], axis=1)
    all_finished = jnp.concatenate([finished, ends], axis=1)
    finished_scores, best = jax.lax.top_k(all_scores, k)
    finished_seqs = beam_ops.take_beams(all_seqs, best)
    finished = beam_ops.take_beams(all_finished, best)
    return i + 1, live_log_probs, live_seqs, finished_scores, finished_seqs, finished, cache

  state = (jnp.zeros((), jnp.int32),
           jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
           jnp.zeros(seq_shape, jnp.int32).at[:, :, 0].set(first[:, None]),
           jnp.full((b, k), NEG_INF, jnp.float32),
           jnp.zeros(seq_shape, jnp.int32),
           jnp.zeros((b, k), bool),
           beam_ops.expand(cache, k))
  _, live_log_probs, live_seqs, finished_scores, finished_seqs, finished, _ = (
      jax.lax.while_loop(cond, body, state))
  any_finished = jnp.any(finished, axis=1)
  sequences = jnp.where(any_finished[:, None, None], finished_seqs, live_seqs)
  scores = jnp.where(any_finished[:, None], finished_scores, live_log_probs)
  return sequences[:, :, 1:], scores
