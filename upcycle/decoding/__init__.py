"""Autoregressive decoding: greedy, temperature sampling, beam search (T5X semantics).

The loops (`sampling`, `beam_search`) are pure functions of a cached step function and its
cache pytree; `t5` binds them to `upcycle.models.T5` (`T5.prefill` / `T5.decode_step`).
"""

from upcycle.decoding.beam_search import beam_search, brevity_penalty
from upcycle.decoding.sampling import temperature_sample
from upcycle.decoding.t5 import DecodeConfig, decode, exact_match, make_decode_fn

__all__ = ['beam_search', 'brevity_penalty', 'temperature_sample', 'DecodeConfig', 'decode',
           'exact_match', 'make_decode_fn']
