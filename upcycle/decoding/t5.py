"""Decoding a T5: the model's cached step bound to the decoding loops.

  decode = make_decode_fn(T5(config), DecodeConfig(method='beam', num_beams=4), max_length=32)
  tokens, scores = decode(params, encoder_input_tokens, jax.random.PRNGKey(0))
  # tokens [batch, max_length] (0 after EOS), scores [batch]
"""

import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from upcycle import fields
from upcycle.decoding.beam_search import beam_search
from upcycle.decoding.sampling import temperature_sample
from upcycle.models.t5 import T5

Array = jax.Array
METHODS = ('greedy', 'sample', 'beam')


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How to decode (T5X's decoding functions).

  Attributes:
    method: 'greedy' (argmax), 'sample' (temperature sampling) or 'beam' (beam search).
    num_beams: beams per example ('beam').
    alpha: brevity-penalty exponent of beam search, ((5 + length) / 6) ** alpha.
    temperature: sampling temperature ('sample'; > 0).
    topk: sample among the top-k tokens only ('sample'; 0: all).
    eos_id: end-of-sequence token (T5 vocabularies: 1).
    rescale_log_probs: 'greedy' and 'sample' score a decode under the distribution its
      tokens were drawn from (temperature and top-k applied; greedy scores 0), T5X's
      default. False (ours): under the model, comparable across temperatures and methods.
  """

  method: str = 'greedy'
  num_beams: int = 4
  alpha: float = 0.6
  temperature: float = 1.0
  topk: int = 0
  eos_id: int = 1
  rescale_log_probs: bool = False

  def __post_init__(self):
    fields.choice(self, 'method', METHODS)
    fields.integer(self, 'num_beams', 1)
    fields.number(self, 'alpha', 0.0)
    fields.number(self, 'temperature', 0.0, strictly=True)
    fields.integer(self, 'topk', 0)
    fields.integer(self, 'eos_id', 0)
    fields.boolean(self, 'rescale_log_probs')


def cached_step(model: T5, params: Any) -> Callable[[Array, Any], Tuple[Array, Any]]:
  """`(tokens [n], cache) -> (logits [n, vocab], cache)` of `model` with `params`."""

  def step(tokens: Array, cache: Any) -> Tuple[Array, Any]:
    logits, variables = model.apply({'params': params, 'cache': cache}, tokens[:, None],
                                    method=T5.decode_step, mutable=['cache'])
    return logits, variables['cache']

  return step


def decode(model: T5, params: Any, encoder_input_tokens: Array, rng: Optional[Array], *,
           config: DecodeConfig, max_length: int) -> Tuple[Array, Array]:
  """`[batch, src_len]` -> the best decode `[batch, max_length]` and its score `[batch]`.

  Scores: log-probability of the tokens up to EOS ('greedy', 'sample'; under the sampling
  distribution with `config.rescale_log_probs`); log-probability over the brevity penalty
  ('beam').
  """
  batch = encoder_input_tokens.shape[0]
  _, variables = model.apply({'params': params}, encoder_input_tokens, max_length,
                             method=T5.prefill, mutable=['cache'])
  step = cached_step(model, params)
  common = dict(batch_size=batch, max_length=max_length, eos_id=config.eos_id)
  if config.method == 'beam':
    sequences, scores = beam_search(step, variables['cache'], num_beams=config.num_beams,
                                    alpha=config.alpha, **common)
    return sequences[:, 0], scores[:, 0]
  greedy = config.method == 'greedy'
  rng = jax.random.PRNGKey(0) if rng is None else rng
  return temperature_sample(step, variables['cache'], rng=rng,
                            temperature=0.0 if greedy else config.temperature,
                            topk=0 if greedy else config.topk,
                            rescale_log_probs=config.rescale_log_probs, **common)


def make_decode_fn(model: T5, config: DecodeConfig, max_length: int):
  """Jitted `(params, encoder_input_tokens [batch, src_len], rng) -> (tokens, scores)`."""
  return jax.jit(functools.partial(decode, model, config=config, max_length=max_length))


def exact_match(predictions: Array, targets: Array) -> Array:
  """Decoded vs target tokens `[batch, length]` (0 = padding) -> `[batch]` bool: every token
  equal, EOS and the padding after it included (T5's sequence accuracy, on token ids)."""
  length = max(predictions.shape[1], targets.shape[1])
  pad = lambda x: jnp.pad(x, ((0, 0), (0, length - x.shape[1])))
  return jnp.all(pad(predictions) == pad(targets), axis=1)
