"""python -m upcycle.infer --gin_file=... --gin.CHECKPOINT_PATH=...: decode a split to JSONL.

Like T5X's `infer.py`: restores any checkpoint `upcycle.pretrained.load` reads (this project's
orbax runs, T5X, HF), decodes every example of an unpacked task split (greedy, temperature
sampling or beam search; `upcycle.decoding.DecodeConfig`) and writes
`OUTPUT_DIR/inference/<task>-<step>.jsonl`, one object per example:

  {"inputs": "...", "targets": "...", "prediction": "...", "score": -3.2,
   "input_tokens": [...], "target_tokens": [...], "prediction_tokens": [...]}

Texts are the task's `targets` vocabulary decoding the tokens (absent when the task has none);
token lists stop at the first padding (0). Gin files bind `infer_script.infer`
(`import __main__ as infer_script`); see configs/runs/infer.gin.
"""

import json
import os
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from etils import epath
import jax
import numpy as np

from upcycle import gin_utils, progress

Predictions = Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]


def predictions(decode_fn, params: Any, pipeline: Any, *, batch_size: int,
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
  and a span-corruption split has one per input example (None: the source does not say)."""
  import seqio  # pylint: disable=g-import-not-at-top
  limit = max_batches * batch_size if max_batches else None
  try:
    split = seqio.get_mixture_or_task(pipeline.task).num_input_examples(pipeline.split)
  except Exception:  # pylint: disable=broad-except  (no total; reading the split says why)
    split = None
  known = [n for n in (limit, split) if n is not None]
  return min(known) if known else None


def infer(*, model: Any, infer_data: Any, checkpoint_path: str, output_dir: str,
          batch_size: int, decoding: Any, max_decode_length: Optional[int] = None,
          format: Optional[str] = None,  # pylint: disable=redefined-builtin
          max_batches: int = 0, seed: int = 0) -> str:
  """Decodes `infer_data` with the checkpoint; returns the path of the JSONL written.

  Args:
    model: the `T5` the checkpoint fits (gin: %MODEL).
    infer_data: an unpacked (`pack=False`) `TextPipeline` split.
    checkpoint_path: any checkpoint `upcycle.pretrained.load` reads.
    output_dir: the JSONL goes to `output_dir/inference/<task>-<step>.jsonl`.
    batch_size: examples decoded at once.
    decoding: an `upcycle.decoding.DecodeConfig`.
    max_decode_length: tokens to decode at most (None: the task's 'targets' feature length).
    format: checkpoint format (None: detected).
    max_batches: stop after this many batches (0: the whole split).
    seed: data order and sampling randomness.
  """
  # pylint: disable=g-import-not-at-top
  from upcycle import decoding as decoding_lib
  from upcycle import pretrained
  # pylint: enable=g-import-not-at-top
  if getattr(infer_data, 'pack', False):
    raise ValueError('infer_data: decoding needs one example per row; bind '
                     "infer/text.TextPipeline.pack = False (as runs/infer.gin does).")
  checkpoint = pretrained.load(checkpoint_path, format, model_config=model.config)
  params = jax.tree.map(jax.numpy.asarray, checkpoint.params)
  max_length = max_decode_length or infer_data.feature_lengths['targets']
  decode_fn = decoding_lib.make_decode_fn(model, decoding, max_length)
  vocabulary = target_vocabulary(infer_data.task)
  path = epath.Path(output_dir) / 'inference' / f'{infer_data.task}-{checkpoint.step or 0}.jsonl'
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.parent / (path.name + '.tmp')
  done = progress.Progress('infer', 'examples', total=expected_examples(
      infer_data, batch_size=batch_size, max_batches=max_batches))
  try:
    with partial.open('w') as f:
      for batch, tokens, scores in predictions(decode_fn, params, infer_data,
                                               batch_size=batch_size, max_batches=max_batches,
                                               seed=seed):
        for record in example_records(batch, tokens, scores, vocabulary):
          f.write(json.dumps(record) + '\n')
        done.update(tokens.shape[0])
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  partial.replace(path)
  done.finish()
  print(f'Wrote {done.done} predictions ({decoding.method}) of checkpoint {checkpoint_path} '
        f'(step {checkpoint.step}) to {path}', flush=True)
  return os.fspath(path)


if __name__ == '__main__':
  from upcycle import fields  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import CheckpointError  # pylint: disable=g-import-not-at-top
  from upcycle.data.iterator import EmptySplit  # pylint: disable=g-import-not-at-top
  gin_utils.run(infer, sys.argv[1:], __doc__,
                expected=(fields.ConfigError, CheckpointError, EmptySplit))
