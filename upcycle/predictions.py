"""Decoding batch by batch (`python -m upcycle.infer`, `python -m upcycle.eval`): a task
split's examples with a T5, or prompts continued by a decoder-only Llama; each batch's tokens
and scores, one JSON-ready record per example, sequence accuracy.

Over a slice, every process runs the same loop: each reads the split whole, in the same order
(reading is cheap next to decoding), and feeds its devices their rows of each batch; the mesh
decodes the batch as one program (parameters placed by their logical axes, the batch split
over ('expert', 'data')) and every process gets the whole batch's tokens back. So a slice's
output has the rows, in the order, that one process writes (T5X's infer shards by process
and merges by index to the same end).
"""

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np

from upcycle import decoding as decoding_lib
from upcycle import partitioning, task_metrics
from upcycle.data.prompts import Prompts

Predictions = Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]


def padded_rows(batch_size: int, mesh: Mesh) -> int:
  """Rows of a decoded batch: `batch_size` rounded up to a multiple of the devices a batch is
  split over (the extra rows are padding, cut off again)."""
  ways = mesh.shape['data'] * mesh.shape['expert']
  return -(-batch_size // ways) * ways


def _global(rows: np.ndarray, mesh: Mesh) -> jax.Array:
  """A batch every process holds whole `[rows, ...]` -> one array over the mesh, each device
  given its rows."""
  return jax.make_array_from_callback(rows.shape, partitioning.batch_sharding(mesh, rows.ndim),
                                      lambda index: rows[index])


def _fetched(x: jax.Array) -> np.ndarray:
  """The whole value of an array of the mesh, on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def on_mesh(fn, params: Any, inputs: Sequence[np.ndarray], *extra, rows: int, mesh: Mesh):
  """`fn(params, *inputs, *extra)` on the mesh, each input `[n, ...]` padded with zero rows to
  `rows` (one compiled shape for every batch); its outputs as numpy, whole on every process
  and cut back to the n rows. Run within the caller's `partitioning.activate(mesh, rules)`,
  the rules `params` were placed with (the trainer's, eval's, infer's, `harness.ProjectLM`'s):
  the models' sharding constraints resolve by them."""
  n = inputs[0].shape[0]
  padded = [_global(np.pad(x, [(0, rows - n)] + [(0, 0)] * (x.ndim - 1)), mesh) for x in inputs]
  outputs = fn(params, *padded, *extra)
  return jax.tree.map(lambda x: _fetched(x)[:n], outputs)


def decoded_batches(decode_fn, params: Any, pipeline: Any, *, batch_size: int, mesh: Mesh,
                    max_batches: int = 0, seed: int = 0) -> Iterator[Predictions]:
  """(batch, tokens `[n, max_length]`, scores `[n]`) for each batch of `pipeline`, in order,
  on every process (`params` placed on `mesh`); the batch with the task's `*_pretokenized`
  texts (`TextPipeline.pretokenized`).

  Every example is decoded once: every batch is padded to `padded_rows(batch_size)` (one
  compiled shape) and the padding cut off again, so `n <= batch_size`.
  """
  rows, rng = padded_rows(batch_size, mesh), jax.random.PRNGKey(seed)
  for i, batch in enumerate(_split_batches(pipeline, batch_size=batch_size,
                                           max_batches=max_batches, seed=seed)):
    tokens, scores = on_mesh(decode_fn, params, [batch['encoder_input_tokens']],
                              jax.random.fold_in(rng, i), rows=rows, mesh=mesh)
    yield batch, tokens, scores


def _split_batches(pipeline: Any, *, batch_size: int, max_batches: int,
                   seed: int) -> Iterator[Dict[str, np.ndarray]]:
  """`pipeline`'s batches with the task's `*_pretokenized` texts (`TextPipeline.pretokenized`),
  every example once (the last batch partial), at most `max_batches` (0: all)."""
  from upcycle.data.iterator import DataIterator  # pylint: disable=g-import-not-at-top
  iterator = DataIterator(dataclasses.replace(pipeline, pretokenized=True),
                          batch_size=batch_size, seed=seed, num_epochs=1, drop_remainder=False)
  for i, batch in enumerate(iterator):
    if max_batches and i >= max_batches:
      return
    yield batch


def target_scores(score_fn, params: Any, batch: Dict[str, np.ndarray], *, rows: int,
                  mesh: Mesh) -> np.ndarray:
  """`[n]`: `score_fn(params, batch)` (`_target_score_fn`) of the batch's token features on
  `mesh`, padded to `rows`."""
  names = sorted(k for k in batch if not k.endswith('_pretokenized'))
  return on_mesh(lambda p, *xs: score_fn(p, dict(zip(names, xs))), params,
                  [batch[k] for k in names], rows=rows, mesh=mesh)


def target_vocabulary(pipeline: Any) -> Optional[Any]:
  """The seqio vocabulary of the 'targets' feature of `pipeline`'s task, or None if it has
  none."""
  try:
    return pipeline.seqio_task().output_features['targets'].vocabulary
  except KeyError:
    return None


def _until_padding(tokens: np.ndarray) -> list:
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(0)] if 0 in tokens else tokens


def whole_targets(text: Optional[bytes], target_tokens: List[int], vocabulary: Any
                  ) -> Optional[str]:
  """The example's `targets_pretokenized` `text` when `target_tokens` are its encoding (cut at
  the feature length, EOS after), else None: a span-corruption task's targets are spans of
  its text, not the text."""
  if text is None:
    return None
  text = text.decode('utf-8')
  tokens = target_tokens[:-1] if target_tokens[-1:] == [vocabulary.eos_id] else target_tokens
  return text if vocabulary.encode(text)[:len(tokens)] == tokens else None


def example_records(batch: Dict[str, np.ndarray], tokens: np.ndarray, scores: np.ndarray,
                    vocabulary: Optional[Any]) -> Iterator[Dict[str, Any]]:
  """One JSON-ready dict per example of a decoded batch: its tokens (the input and target
  tokens as the model saw them, truncated to the feature lengths), the decode's score and,
  with a `vocabulary`, its texts: inputs and prediction decoded from the tokens, targets the
  task's whole `targets_pretokenized` text where it is the targets' text (`whole_targets`),
  else decoded."""
  texts = batch.get('targets_pretokenized')
  for i in range(tokens.shape[0]):
    record = {'input_tokens': _until_padding(batch['encoder_input_tokens'][i]),
              'target_tokens': _until_padding(batch['decoder_target_tokens'][i]),
              'prediction_tokens': _until_padding(tokens[i]),
              'score': float(scores[i])}
    if vocabulary is not None:
      for text_key, token_key in (('inputs', 'input_tokens'), ('targets', 'target_tokens'),
                                  ('prediction', 'prediction_tokens')):
        record[text_key] = vocabulary.decode(record[token_key])
      record['targets'] = whole_targets(
          None if texts is None else texts[i], record['target_tokens'], vocabulary
      ) or record['targets']
    yield record


T5X_MODES = ('predict', 'predict_with_aux', 'score')


def _texts(batch: Dict[str, np.ndarray], i: int) -> Dict[str, str]:
  """Example `i`'s `*_pretokenized` texts."""
  return {k: batch[k][i].decode('utf-8') for k in sorted(batch) if k.endswith('_pretokenized')}


def t5x_records(batch: Dict[str, np.ndarray], tokens: np.ndarray, scores: np.ndarray,
                vocabulary: Any, mode: str) -> Iterator[Dict[str, Any]]:
  """One dict per example of a decoded batch, as T5X's `infer.write_inferences_to_file`
  writes it in `mode` ('predict' or 'predict_with_aux', with `output_ids`): {'inputs': every
  `*_pretokenized` text of the task's example, whole; 'prediction': the decoded row's text;
  'prediction_tokens': its tokens up to the first padding} and with 'predict_with_aux'
  {'aux': {'scores': the decode's score}}."""
  for i in range(tokens.shape[0]):
    record = {'inputs': _texts(batch, i),
              'prediction': vocabulary.decode([int(t) for t in tokens[i]]),
              'prediction_tokens': _until_padding(tokens[i])}
    if mode == 'predict_with_aux':
      record['aux'] = {'scores': float(scores[i])}
    yield record


def scored_records(objective: Any, params: Any, pipeline: Any, *, batch_size: int, mesh: Mesh,
                   max_batches: int, seed: int) -> Iterator[List[Dict[str, Any]]]:
  """T5X's 'score' rows of each batch of `pipeline`, in order: {'inputs': the example's
  `*_pretokenized` texts, 'score': the log-likelihood of its target tokens with the reference
  fed back (T5X's `score_batch`)}; nothing is decoded."""
  score_fn, rows = _target_score_fn(objective), padded_rows(batch_size, mesh)
  for batch in _split_batches(pipeline, batch_size=batch_size, max_batches=max_batches,
                              seed=seed):
    scores = target_scores(score_fn, params, batch, rows=rows, mesh=mesh)
    yield [{'inputs': _texts(batch, i), 'score': float(score)}
           for i, score in enumerate(scores)]


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
                      mesh: Mesh, max_batches: int = 0, seed: int = 0) -> Iterator[Predictions]:
  """(batch, continuations `[n, max_decode_length]`, scores `[n]`) for each batch of
  `prompts`, in order, decoded by `decoding.llama.make_decode_fn`'s function on `mesh`. The
  last partial batch is padded with empty rows to `batch_size` (one compiled shape) and cut
  again."""
  rows, rng = padded_rows(batch_size, mesh), jax.random.PRNGKey(seed)
  for i, batch in enumerate(prompts.batches(batch_size)):
    if max_batches and i >= max_batches:
      return
    tokens, scores = on_mesh(decode_fn, params, [batch['prompt_tokens'], batch['prompt_mask']],
                              jax.random.fold_in(rng, i), rows=rows, mesh=mesh)
    yield batch, tokens, scores


def through_eos(tokens: np.ndarray, eos_id: Union[int, Tuple[int, ...]]) -> List[int]:
  """A decoder-only continuation up to its first EOS (`eos_id`, or any of a tuple of them),
  included (Llama's 0 is a real token, so the padding after EOS is found from EOS, not from
  0)."""
  tokens, ends = [int(t) for t in tokens], set(np.atleast_1d(eos_id).tolist())
  end = next((i for i, t in enumerate(tokens) if t in ends), None)
  return tokens if end is None else tokens[:end + 1]


def continuation_records(batch: Dict[str, Any], tokens: np.ndarray, scores: np.ndarray,
                         tokenizer: Any) -> Iterator[Dict[str, Any]]:
  """One JSON-ready dict per prompt of a decoded batch: its text and tokens, the continuation
  as the tokenizer decodes it (special tokens such as EOS dropped) and its tokens."""
  for i in range(tokens.shape[0]):
    prediction = through_eos(tokens[i], tokenizer.stop_ids)
    real = batch['prompt_mask'][i] == 1
    yield {'prompt': batch['prompt'][i], 'prediction': tokenizer.decode(prediction),
           'score': float(scores[i]),
           'prompt_tokens': [int(t) for t in batch['prompt_tokens'][i][real]],
           'prediction_tokens': prediction}


def batch_records(model: Any, params: Any, pipeline: Any, decoding: Any, *,
                  max_decode_length: int, batch_size: int, mesh: Mesh, max_batches: int,
                  seed: int, t5x_mode: Optional[str] = None) -> Iterator[List[Dict[str, Any]]]:
  """The records of each decoded batch, in order: a task split's examples decoded by a T5
  (`pipeline` a `TextPipeline`; `example_records`, or with `t5x_mode` 'predict' or
  'predict_with_aux' T5X's `t5x_records`),
  or prompts continued by a decoder-only Llama (a `Prompts`; the tokenizer's EOS ends a
  continuation, as it ends every training document, and so does each id of the source's eos
  list: `Tokenizer.stop_ids`, what transformers' `generate` stops at)."""
  if isinstance(pipeline, Prompts):
    tokenizer = pipeline.load_tokenizer()
    decode_fn = decoding_lib.llama.make_decode_fn(
        model, dataclasses.replace(decoding, eos_id=tokenizer.stop_ids), max_decode_length)
    for batch, tokens, scores in continued_prompts(
        decode_fn, params, pipeline, batch_size=batch_size, mesh=mesh, max_batches=max_batches,
        seed=seed):
      yield list(continuation_records(batch, tokens, scores, tokenizer))
    return
  decode_fn = decoding_lib.make_decode_fn(model, decoding, max_decode_length)
  vocabulary = target_vocabulary(pipeline)
  for batch, tokens, scores in decoded_batches(
      decode_fn, params, pipeline, batch_size=batch_size, mesh=mesh, max_batches=max_batches,
      seed=seed):
    yield list(t5x_records(batch, tokens, scores, vocabulary, t5x_mode) if t5x_mode
               else example_records(batch, tokens, scores, vocabulary))


def decoded_split(model: Any, params: Any, pipeline: Any, decoding: Any, *, batch_size: int,
                  mesh: Mesh, max_batches: int, seed: int, scored_by: Any = None
                  ) -> Tuple[List[Dict[str, Any]], dict, Optional[np.ndarray]]:
  """`pipeline`'s examples decoded (at most `max_batches` batches): their records
  (`example_records`); {'sequence_accuracy': the fraction whose decoded targets equal the
  reference exactly (T5's, on token ids), 'decoded_examples': their number}; and with
  `scored_by` (the model's objective) `[examples]` the log-likelihood of each example's
  targets, the sum of log p(token) over its target tokens with the reference fed back
  (T5X's `score_batch`), else None. The split is read once for both."""
  decode_fn = decoding_lib.make_decode_fn(model, decoding, pipeline.feature_lengths['targets'])
  score_fn = None if scored_by is None else _target_score_fn(scored_by)
  vocabulary = target_vocabulary(pipeline)
  records, matches, scores = [], [], []
  for batch, tokens, beam_scores in decoded_batches(
      decode_fn, params, pipeline, batch_size=batch_size, mesh=mesh, max_batches=max_batches,
      seed=seed):
    matches.append(np.asarray(decoding_lib.exact_match(tokens, batch['decoder_target_tokens'])))
    records.extend(example_records(batch, tokens, beam_scores, vocabulary))
    if score_fn is not None:
      scores.append(target_scores(score_fn, params, batch, rows=padded_rows(batch_size, mesh),
                                  mesh=mesh))
  matches = np.concatenate(matches)
  return records, {'sequence_accuracy': float(matches.mean()),
                   'decoded_examples': int(matches.size)}, (
                       np.concatenate(scores) if score_fn is not None else None)


def decoded_metrics(objective: Any, params: Any, pipeline: Any, decoding: Any, *,
                    batch_size: int, mesh: Mesh, max_batches: int, seed: int) -> dict:
  """Sequence accuracy and the task's own metrics (`upcycle.task_metrics`) of `pipeline`'s
  decoded examples (at most `max_batches` batches of `batch_size`, the global batch); its
  score metrics, if it has any, from the targets' log-likelihoods: what `python -m
  upcycle.eval` and a training run's inference evaluation (T5X's infer_eval) report."""
  task = pipeline.seqio_task()
  task_metrics.warn_metric_objects(task)
  records, results, scores = decoded_split(
      objective.model, params, pipeline, decoding, batch_size=batch_size, mesh=mesh,
      max_batches=max_batches, seed=seed,
      scored_by=objective if task.score_metric_fns else None)
  results.update(task_metrics.predict_metrics(task, records))
  if scores is not None:
    results.update(task_metrics.score_metrics(task, records, scores))
  return results


def _target_score_fn(objective: Any):
  """jitted (params, batch) -> `[batch]`: each example's summed log-likelihood of its target
  tokens (weighted by `decoder_loss_weights`), the reference fed back."""

  @jax.jit
  def score(params, batch):
    logits, _ = objective.apply(params, batch, train=False)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    targets = batch['decoder_target_tokens']
    token = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(token * batch['decoder_loss_weights'], axis=-1)

  return score
