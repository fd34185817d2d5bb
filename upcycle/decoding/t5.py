"""Decoding a T5: the model's cached step bound to the decoding loops.

  decode = make_decode_fn(T5(config), DecodeConfig(method='beam', num_beams=4), max_length=32)
  tokens, scores = decode(params, encoder_input_tokens, jax.random.PRNGKey(0))
  # tokens [batch, max_length] (0 after EOS), scores [batch]
"""

import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from upcycle.decoding.methods import DecodeConfig, cached_step, search
from upcycle.models.t5 import T5

Array = jax.Array


def decode(model: T5, params: Any, encoder_input_tokens: Array, rng: Optional[Array], *,
           config: DecodeConfig, max_length: int) -> Tuple[Array, Array]:
  """`[batch, src_len]` -> the best decode `[batch, max_length]` and its score `[batch]`
  (`methods.search`)."""
  _, variables = model.apply({'params': params}, encoder_input_tokens, max_length,
                             method=T5.prefill, mutable=['cache'])
  return search(cached_step(model, params), variables['cache'], config,
                batch_size=encoder_input_tokens.shape[0], max_length=max_length, rng=rng)


def make_decode_fn(model: T5, config: DecodeConfig, max_length: int):
  """Jitted `(params, encoder_input_tokens [batch, src_len], rng) -> (tokens, scores)`."""
  return jax.jit(functools.partial(decode, model, config=config, max_length=max_length))


def exact_match(predictions: Array, targets: Array) -> Array:
  """Decoded vs target tokens `[batch, length]` (0 = padding) -> `[batch]` bool: every token
  equal, EOS and the padding after it included (T5's sequence accuracy, on token ids)."""
  length = max(predictions.shape[1], targets.shape[1])
  pad = lambda x: jnp.pad(x, ((0, 0), (0, length - x.shape[1])))
  return jnp.all(pad(predictions) == pad(targets), axis=1)
