"""Decoding batch by batch (`python -m upcycle.infer`, `python -m upcycle.eval`): a task
split's examples with a T5, or prompts continued by a decoder-only Llama; each batch's tokens
and scores, one JSON-ready record per example, sequence accuracy."""

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Tuple

import jax
import numpy as np

from upcycle import decoding as decoding_lib
from upcycle.data.prompts import Prompts

Predictions = Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]


def decoded_batches(decode_fn, params: Any, pipeline: Any, *, batch_size: int,
                    max_batches: int = 0, seed: int = 0) -> Iterator[Predictions]:
  """(batch, tokens `[n, max_length]`, scores `[n]`) for each batch of `pipeline`, in order.

  Every example is decoded once: the last partial batch is padded to `batch_size` (one
  compiled shape) and the padding cut off again, so `n <= batch_size`.
  """
  from upcycle.data.iterator import DataIterator  # pylint: disable=g-import-not-at-top
  iterator = DataIterator(pipeline, batch_size=batch_size, seed=seed, num_epochs=1,
                          drop_remainder=False)
  rng = jax.random.PRNGKey(seed)
  for i, batch in enumerate(iterator):
    if max_batches and i >= max_batches:
      return
    n = batch['encoder_input_tokens'].shape[0]
    inputs = np.pad(batch['encoder_input_tokens'], ((0, batch_size - n), (0, 0)))
    tokens, scores = decode_fn(params, inputs, jax.random.fold_in(rng, i))
    yield batch, np.asarray(tokens)[:n], np.asarray(scores)[:n]


def target_vocabulary(task: str) -> Optional[Any]:
  """The seqio vocabulary of `task`'s 'targets' feature, or None if it has none."""
  import seqio  # pylint: disable=g-import-not-at-top
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top,unused-import  (registers)
  try:
    return seqio.get_mixture_or_task(task).output_features['targets'].vocabulary
  except (ValueError, KeyError):
    return None


def _until_padding(tokens: np.ndarray) -> list:
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(0)] if 0 in tokens else tokens


def example_records(batch: Dict[str, np.ndarray], tokens: np.ndarray, scores: np.ndarray,
                    vocabulary: Optional[Any]) -> Iterator[Dict[str, Any]]:
  """One JSON-ready dict per example of a decoded batch."""
  for i in range(tokens.shape[0]):
    record = {'input_tokens': _until_padding(batch['encoder_input_tokens'][i]),
              'target_tokens': _until_padding(batch['decoder_target_tokens'][i]),
              'prediction_tokens': _until_padding(tokens[i]),
              'score': float(scores[i])}
    if vocabulary is not None:
      for text_key, token_key in (('inputs', 'input_tokens'), ('targets', 'target_tokens'),
                                  ('prediction', 'prediction_tokens')):
        record[text_key] = vocabulary.decode(record[token_key])
    yield record


def expected_examples(pipeline: Any, *, batch_size: int, max_batches: int) -> Optional[int]:
  """How many examples decoding `pipeline` gives, if known: at most `max_batches` batches,
  and a span-corruption split has one per input example, prompts one per prompt (None: the
  source does not say)."""
  import seqio  # pylint: disable=g-import-not-at-top
  limit = max_batches * batch_size if max_batches else None
  if isinstance(pipeline, Prompts):
    split = pipeline.size()
  else:
    try:
      split = seqio.get_mixture_or_task(pipeline.task).num_input_examples(pipeline.split)
    except Exception:  # pylint: disable=broad-except  (no total; reading the split says why)
      split = None
  known = [n for n in (limit, split) if n is not None]
  return min(known) if known else None


def source_name(pipeline: Any) -> str:
  """What a decode's output is named after: the task, or the prompts' file or task."""
  return pipeline.name if isinstance(pipeline, Prompts) else pipeline.task


def continued_prompts(decode_fn, params: Any, prompts: Prompts, *, batch_size: int,
                      max_batches: int = 0, seed: int = 0) -> Iterator[Predictions]:
  """(batch, continuations `[n, max_decode_length]`, scores `[n]`) for each batch of
  `prompts`, in order, decoded by `decoding.llama.make_decode_fn`'s function. The last partial
  batch is padded with empty rows to `batch_size` (one compiled shape) and cut again."""
  rng = jax.random.PRNGKey(seed)
  for i, batch in enumerate(prompts.batches(batch_size)):
    if max_batches and i >= max_batches:
      return
    n = len(batch['prompt'])
    padding = ((0, batch_size - n), (0, 0))
    tokens, scores = decode_fn(params, np.pad(batch['prompt_tokens'], padding),
                               np.pad(batch['prompt_mask'], padding), jax.random.fold_in(rng, i))
    yield batch, np.asarray(tokens)[:n], np.asarray(scores)[:n]


def through_eos(tokens: np.ndarray, eos_id: int) -> List[int]:
  """A decoder-only continuation up to its first EOS, included (Llama's 0 is a real token, so
  the padding after EOS is found from EOS, not from 0)."""
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def continuation_records(batch: Dict[str, Any], tokens: np.ndarray, scores: np.ndarray,
                         tokenizer: Any) -> Iterator[Dict[str, Any]]:
  """One JSON-ready dict per prompt of a decoded batch: its text and tokens, the continuation
  as the tokenizer decodes it (special tokens such as EOS dropped) and its tokens."""
  for i in range(tokens.shape[0]):
    prediction = through_eos(tokens[i], tokenizer.eos_id)
    real = batch['prompt_mask'][i] == 1
    yield {'prompt': batch['prompt'][i], 'prediction': tokenizer.decode(prediction),
           'score': float(scores[i]),
           'prompt_tokens': [int(t) for t in batch['prompt_tokens'][i][real]],
           'prediction_tokens': prediction}


def batch_records(model: Any, params: Any, pipeline: Any, decoding: Any, *,
                  max_decode_length: int, batch_size: int, max_batches: int,
                  seed: int) -> Iterator[List[Dict[str, Any]]]:
  """The records of each decoded batch, in order: a task split's examples decoded by a T5
  (`pipeline` a `TextPipeline`), or prompts continued by a decoder-only Llama (a `Prompts`;
  the tokenizer's EOS ends a continuation, as it ends every training document)."""
  if isinstance(pipeline, Prompts):
    tokenizer = pipeline.load_tokenizer()
    decode_fn = decoding_lib.llama.make_decode_fn(
        model, dataclasses.replace(decoding, eos_id=tokenizer.eos_id), max_decode_length)
    for batch, tokens, scores in continued_prompts(
        decode_fn, params, pipeline, batch_size=batch_size, max_batches=max_batches, seed=seed):
      yield list(continuation_records(batch, tokens, scores, tokenizer))
    return
  decode_fn = decoding_lib.make_decode_fn(model, decoding, max_decode_length)
  vocabulary = target_vocabulary(pipeline.task)
  for batch, tokens, scores in decoded_batches(
      decode_fn, params, pipeline, batch_size=batch_size, max_batches=max_batches, seed=seed):
    yield list(example_records(batch, tokens, scores, vocabulary))


def sequence_accuracy(model: Any, params: Any, pipeline: Any, decoding: Any, *,
                      batch_size: int, max_batches: int, seed: int) -> dict:
  """Fraction of `pipeline`'s examples whose decoded targets equal the reference exactly
  (T5's sequence accuracy, on token ids), and how many examples were decoded."""
  decode_fn = decoding_lib.make_decode_fn(model, decoding, pipeline.feature_lengths['targets'])
  matches = [np.asarray(decoding_lib.exact_match(tokens, batch['decoder_target_tokens']))
             for batch, tokens, _ in decoded_batches(
                 decode_fn, params, pipeline, batch_size=batch_size, max_batches=max_batches,
                 seed=seed)]
  matches = np.concatenate(matches)
  return {'sequence_accuracy': float(matches.mean()), 'decoded_examples': int(matches.size)}
