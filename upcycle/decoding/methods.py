"""How to decode (`DecodeConfig`), and the loop it names run on a model's cached step.

Model-agnostic: `t5` and `llama` prefill their model's cache and call `search` with its step.
"""

import dataclasses
from typing import Any, Callable, Optional, Tuple, Union

import jax

from upcycle import fields
from upcycle.decoding.beam_search import beam_search
from upcycle.decoding.sampling import StepFn, temperature_sample

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
    topp: sample among the most likely tokens that reach this probability, after the
      temperature and top-k (nucleus sampling, T5X's `topp`, HF's `top_p`; 'sample'; 0 or 1:
      all).
    eos_id: end-of-sequence token (T5 vocabularies: 1; a decoder-only LM: its tokenizer's), or
      a tuple of them (an HF generation_config's eos list, `Tokenizer.stop_ids`): a decode
      ends at the first of any.
    rescale_log_probs: 'greedy' and 'sample' score a decode under the distribution its
      tokens were drawn from (temperature, top-k and top-p applied; greedy scores 0), T5X's
      default. False (ours): under the model, comparable across temperatures and methods.
  """

  method: str = 'greedy'
  num_beams: int = 4
  alpha: float = 0.6
  temperature: float = 1.0
  topk: int = 0
  topp: float = 0.0
  eos_id: Union[int, Tuple[int, ...]] = 1
  rescale_log_probs: bool = False

  def __post_init__(self):
    fields.choice(self, 'method', METHODS)
    fields.integer(self, 'num_beams', 1)
    fields.number(self, 'alpha', 0.0)
    fields.number(self, 'temperature', 0.0, strictly=True)
    fields.integer(self, 'topk', 0)
    fields.number(self, 'topp', 0.0)
    if self.topp > 1:
      raise fields.ConfigError(
          f'{fields.binding(self, "topp")} = {self.topp!r}: expected a probability in [0, 1] '
          '(0 or 1: sample among all tokens).')
    if isinstance(self.eos_id, (tuple, list)):
      if not self.eos_id or not all(isinstance(i, int) and i >= 0 for i in self.eos_id):
        raise fields.ConfigError(f'{fields.binding(self, "eos_id")} = {self.eos_id!r}: expected '
                                 'an id >= 0 or a non-empty tuple of them.')
      object.__setattr__(self, 'eos_id', tuple(self.eos_id))
    else:
      fields.integer(self, 'eos_id', 0)
    fields.boolean(self, 'rescale_log_probs')


def search(step_fn: StepFn, cache: Any, config: DecodeConfig, *, batch_size: int,
           max_length: int, rng: Optional[Array],
           initial_tokens: Optional[Array] = None) -> Tuple[Array, Array]:
  """The best decode `[batch, max_length]` (0 after EOS) and its score `[batch]` by
  `config.method`, from a cache for `batch_size` examples.

  Scores: log-probability of the tokens up to EOS ('greedy', 'sample'; under the sampling
  distribution with `config.rescale_log_probs`); log-probability over the brevity penalty
  ('beam'). `initial_tokens` `[batch]`: the first step's input (None: 0, T5's decoder start).
  """
  common = dict(batch_size=batch_size, max_length=max_length, eos_id=config.eos_id,
                initial_tokens=initial_tokens)
  if config.method == 'beam':
    sequences, scores = beam_search(step_fn, cache, num_beams=config.num_beams,
                                    alpha=config.alpha, **common)
    return sequences[:, 0], scores[:, 0]
  greedy = config.method == 'greedy'
  return temperature_sample(step_fn, cache, rng=jax.random.PRNGKey(0) if rng is None else rng,
                            temperature=0.0 if greedy else config.temperature,
                            topk=0 if greedy else config.topk,
                            topp=0.0 if greedy else config.topp,
                            rescale_log_probs=config.rescale_log_probs, **common)


def cached_step(model: Any, params: Any) -> Callable[[Array, Any], Tuple[Array, Any]]:
  """`(tokens [n], cache) -> (logits [n, vocab], cache)`: `model.decode_step` (T5's, Llama's)
  with `params`."""

  def step(tokens: Array, cache: Any) -> Tuple[Array, Any]:
    logits, variables = model.apply({'params': params, 'cache': cache}, tokens[:, None],
                                    method=type(model).decode_step, mutable=['cache'])
    return logits, variables['cache']

  return step
