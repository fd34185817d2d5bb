"""Greedy decoding and temperature sampling (optionally top-k and top-p), as a
`jax.lax.while_loop`.

T5X semantics (`t5x/decoding.py: temperature_sample`): the first input token is 0 (T5's
decoder start) unless given (a decoder-only LM's last prompt token), each step feeds the
previous output, a sequence ends at its first `eos_id` and emits 0 (padding) afterwards, and
the loop stops when every sequence has ended or `max_length` tokens are out. Temperature 0 is
greedy (argmax).
"""

from typing import Any, Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp

Array = jax.Array
Cache = Any
# tokens `[n]` int32, cache -> next-token logits `[n, vocab]` (float32), advanced cache.
StepFn = Callable[[Array, Cache], Tuple[Array, Cache]]
EosId = Union[int, Tuple[int, ...]]   # one end-of-sequence id, or several (HF's eos list)


def sampling_logits(logits: Array, *, temperature: float, topk: int = 0,
                    topp: float = 0.0) -> Array:
  """The distribution a token is drawn from, as logits `[n, vocab]` (-inf: never drawn).

  In the order of T5X's `temperature_sample` and of HF's warpers (`TemperatureLogitsWarper`,
  `TopKLogitsWarper`, `TopPLogitsWarper`): the logits over `temperature` (> 0); with `topk`,
  only the k largest kept (ties with the k-th too); with `topp` in (0, 1), only the most likely
  tokens whose probability above them, under the distribution so far, is less than `topp`
  (the smallest set that reaches `topp`; ties with its least likely token too).
  """
  scaled = logits / temperature
  if topk:
    kth_best = jax.lax.top_k(scaled, topk)[0][:, -1:]
    scaled = jnp.where(scaled < kth_best, -jnp.inf, scaled)
  if 0 < topp < 1:
    descending = -jnp.sort(-scaled, axis=-1)
    mass_through = jnp.cumsum(jax.nn.softmax(descending, axis=-1), axis=-1)
    # Token i (descending) is kept when the mass of tokens 0..i-1 is below topp: the first
    # `kept` of them, at least 1, at most all.
    kept = 1 + jnp.sum(mass_through[:, :-1] < topp, axis=-1, keepdims=True)
    least_kept = jnp.take_along_axis(descending, kept - 1, axis=-1)
    scaled = jnp.where(scaled < least_kept, -jnp.inf, scaled)
  return scaled


def is_eos(token: Array, eos_id: EosId) -> Array:
  """Whether each of `token` (int array, any shape) ends a sequence: equals `eos_id`, or any
  of a tuple of them."""
  return jnp.isin(token, jnp.asarray(eos_id, jnp.int32))


def temperature_sample(step_fn: StepFn, cache: Cache, *, batch_size: int, max_length: int,
                       eos_id: EosId, rng: Array, temperature: float = 1.0, topk: int = 0,
                       topp: float = 0.0, rescale_log_probs: bool = False,
                       initial_tokens: Optional[Array] = None) -> Tuple[Array, Array]:
  """Samples one continuation per example.

  Args:
    step_fn: one cached decoder step (see `StepFn`).
    cache: the decoder cache for `batch_size` examples.
    batch_size: examples decoded at once.
    max_length: tokens to decode at most.
    eos_id: end-of-sequence token, or a tuple of them (ends at any).
    rng: PRNG key (unused when `temperature == 0`).
    temperature: a Python float; 0 picks the argmax (greedy).
    topk: sample among the `topk` most likely tokens only (0: all).
    topp: sample among the most likely tokens that reach this probability (nucleus
      sampling; 0 or 1: all). See `sampling_logits`.
    rescale_log_probs: score each token under the distribution it was drawn from (the
      logits over the temperature, top-k and top-p kept; 0 for greedy), as T5X's
      `temperature_sample` does by default (`rescale_log_probs=True`). False: under the model.
    initial_tokens: `[batch]` int32, the first step's input (None: 0, T5's decoder start).

  Returns:
    tokens `[batch, max_length]` int32 (0 after EOS) and their log-probability `[batch]`
    (float32, EOS included): under the model, or with `rescale_log_probs` under the sampling
    distribution.
  """
  if temperature < 0:
    raise ValueError(f'temperature={temperature}: expected >= 0 (0 is greedy).')
  distribution = lambda logits: sampling_logits(logits, temperature=temperature, topk=topk,
                                                topp=topp)

  def pick(logits: Array, key: Array) -> Array:
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, distribution(logits), axis=-1).astype(jnp.int32)

  def score(logits: Array, token: Array) -> Array:
    if rescale_log_probs and temperature == 0:
      return jnp.zeros(token.shape, jnp.float32)
    scored = distribution(logits) if rescale_log_probs else logits
    return jnp.take_along_axis(jax.nn.log_softmax(scored), token[:, None], -1)[:, 0]

  def cond(state):
    i, _, _, _, ended, _, _ = state
    return (i < max_length) & ~jnp.all(ended)

  def body(state):
    i, token, sequences, cache, ended, log_prob, key = state
    logits, cache = step_fn(token, cache)
    key, subkey = jax.random.split(key)
    token = jnp.where(ended, 0, pick(logits, subkey))
    log_prob = log_prob + jnp.where(ended, 0.0, score(logits, token))
    sequences = jax.lax.dynamic_update_slice_in_dim(sequences, token[:, None], i, axis=1)
    return i + 1, token, sequences, cache, ended | is_eos(token, eos_id), log_prob, key

  first = (jnp.zeros((batch_size,), jnp.int32) if initial_tokens is None
           else jnp.asarray(initial_tokens, jnp.int32))
  state = (jnp.zeros((), jnp.int32), first, jnp.zeros((batch_size, max_length), jnp.int32),
           cache, jnp.zeros((batch_size,), bool), jnp.zeros((batch_size,), jnp.float32), rng)
  _, _, sequences, _, _, log_prob, _ = jax.lax.while_loop(cond, body, state)
  return sequences, log_prob
