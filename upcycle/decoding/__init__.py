"""Autoregressive decoding: greedy, temperature sampling (top-k, top-p), beam search (T5X
semantics).

The loops (`sampling`, `beam_search`) are pure functions of a cached step function and its
cache pytree; `methods` picks one by `DecodeConfig`; `t5` binds them to `upcycle.models.T5`
(`T5.prefill` / `T5.decode_step`), `llama` to the decoder-only `upcycle.models.Llama` on
left-padded prompts.
"""

from upcycle.decoding import llama
from upcycle.decoding.beam_search import beam_search, brevity_penalty
from upcycle.decoding.methods import DecodeConfig
from upcycle.decoding.sampling import sampling_logits, temperature_sample
from upcycle.decoding.t5 import decode, exact_match, make_decode_fn

__all__ = ['beam_search', 'brevity_penalty', 'sampling_logits', 'temperature_sample',
           'DecodeConfig', 'decode', 'exact_match', 'llama', 'make_decode_fn']
