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
from typing import Any, Optional

from etils import epath
import jax

from upcycle import gin_utils, predictions, progress

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
  vocabulary = predictions.target_vocabulary(infer_data.task)
  path = epath.Path(output_dir) / 'inference' / f'{infer_data.task}-{checkpoint.step or 0}.jsonl'
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.parent / (path.name + '.tmp')
  done = progress.Progress('infer', 'examples', total=predictions.expected_examples(
      infer_data, batch_size=batch_size, max_batches=max_batches))
  try:
    with partial.open('w') as f:
      for batch, tokens, scores in predictions.decoded_batches(
          decode_fn, params, infer_data, batch_size=batch_size, max_batches=max_batches,
          seed=seed):
        for record in predictions.example_records(batch, tokens, scores, vocabulary):
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
