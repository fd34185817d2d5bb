"""Decoding a decoder-only Llama (Mistral, Qwen2): left-padded prompts continued by the
model's cached step, with the loops T5 uses.

  decode = make_decode_fn(Llama(config), DecodeConfig(method='sample', topp=0.9,
                                                      eos_id=tokenizer.eos_id), 32)
  tokens, scores = decode(params, prompt_tokens, prompt_mask, jax.random.PRNGKey(0))
  # tokens [batch, 32]: the continuation (0 after EOS), scores [batch]

As HF's `generate`: prompts are left-padded (`prompt_mask` 0 on the padding), so every row's
next token is at the same column, and positions count from each row's first real token. The
prompt fills the cache (`Llama.prefill`); the first step feeds its last token, and each later
step the token before. Llama's id 0 is a real token: a continuation ends at its first EOS, not
at a 0.
"""

import functools
from typing import Any, Optional, Tuple

import jax

from upcycle.decoding.methods import DecodeConfig, cached_step, search
from upcycle.models.llama import Llama

Array = jax.Array


def decode(model: Llama, params: Any, prompt_tokens: Array, prompt_mask: Array,
           rng: Optional[Array], *, config: DecodeConfig,
           max_decode_length: int) -> Tuple[Array, Array]:
  """Prompts `[batch, prompt_len]` (left-padded; `prompt_mask` 1 on the prompt) -> the best
  continuation `[batch, max_decode_length]` and its score `[batch]` (`methods.search`)."""
  batch, prompt_length = prompt_tokens.shape
  _, variables = model.apply({'params': params}, prompt_tokens, prompt_mask,
                             prompt_length + max_decode_length, method=Llama.prefill,
                             mutable=['cache'])
  return search(cached_step(model, params), variables['cache'], config, batch_size=batch,
                max_length=max_decode_length, rng=rng, initial_tokens=prompt_tokens[:, -1])


def make_decode_fn(model: Llama, config: DecodeConfig, max_decode_length: int):
  """Jitted `(params, prompt_tokens, prompt_mask [batch, prompt_len], rng) -> (tokens,
  scores)`."""
  return jax.jit(functools.partial(decode, model, config=config,
                                   max_decode_length=max_decode_length))
