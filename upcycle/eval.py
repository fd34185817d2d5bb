"""python -m upcycle.eval --gin_file=... --gin.CHECKPOINT_PATH=...: evaluate a checkpoint.

Reads any checkpoint `upcycle.checkpoints.load` supports (this project's orbax runs, T5X,
HF, vit_jax/big_vision npz), checks it against the gin-configured model, and reports
validation loss and accuracy; for T5 also sequence accuracy (exact match of greedy-decoded
targets, `decode_data`); for ViT also few-shot linear accuracy. Gin files bind
`eval_script.evaluate` (`import __main__ as eval_script`); see configs/runs/eval.gin.
"""

import json
import os
import sys
from typing import Any, Optional, Sequence

from etils import epath
import jax

from upcycle import fields, gin_utils, predictions


def evaluate(*, objective: Any, eval_data: Any, checkpoint_path: str, batch_size: int,
             format: Optional[str] = None,  # pylint: disable=redefined-builtin
             eval_batches: int = 0, fewshot_train_data: Optional[Any] = None,
             fewshot_shots: Sequence[int] = (1, 5, 10), fewshot_l2_reg: float = 2.0 ** 10,
             decode_data: Optional[Any] = None, decoding: Optional[Any] = None,
             decode_batches: int = 0,
             num_expert_partitions: int = 1, num_model_partitions: int = 1,
             output_dir: Optional[str] = None, seed: int = 0) -> dict:
  """Evaluates `checkpoint_path` with `objective`'s model; returns (and prints) the metrics.

  `decode_data` (an unpacked seq2seq split; None: skip) adds `sequence_accuracy` from decoded
  outputs (`decoding`, an `upcycle.decoding.DecodeConfig`; None: greedy) over at most
  `decode_batches` batches (0: all) and `decoded_examples`, their number.
  """
  # pylint: disable=g-import-not-at-top
  from upcycle import decoding as decoding_lib
  from upcycle import pretrained
  from upcycle.train import evaluation, partitioning
  from upcycle.train.objectives import init_params
  from upcycle.train.step import make_eval_step
  # pylint: enable=g-import-not-at-top
  fields.integer_value('BATCH_SIZE (eval_script.evaluate.batch_size)', batch_size, 1)
  if output_dir:
    fields.directory('EVAL_OUTPUT_DIR (eval_script.evaluate.output_dir)', output_dir)
  checkpoint = pretrained.load(checkpoint_path, format, model_config=objective.model.config,
                               with_optimizer_state=False)
  mesh = partitioning.make_mesh(num_expert_partitions, num_model_partitions)
  host_batch = batch_size // jax.process_count()
  with partitioning.activate(mesh):
    example = next(iter(evaluation.host_batches(eval_data, host_batch, 1, seed)))
    boxed = jax.eval_shape(lambda: init_params(objective, jax.random.PRNGKey(0), example))
    shardings = partitioning.logical_sharding(boxed, mesh)
    params = jax.tree.map(
        lambda leaf, s: jax.make_array_from_callback(leaf.shape, s, lambda i: leaf[i]),
        checkpoint.params, shardings)
    results = evaluation.evaluate(jax.jit(make_eval_step(objective)), params, eval_data,
                                  batch_size=host_batch, mesh=mesh, max_batches=eval_batches,
                                  seed=seed)
    if fewshot_train_data is not None:
      results.update(evaluation.linear_fewshot(
          objective, params, fewshot_train_data, eval_data, batch_size=host_batch, mesh=mesh,
          shots=fewshot_shots, l2_reg=fewshot_l2_reg, max_batches=eval_batches, seed=seed))
  if decode_data is not None:
    results.update(predictions.sequence_accuracy(
        objective.model, params, decode_data, decoding or decoding_lib.DecodeConfig(),
        batch_size=host_batch, max_batches=decode_batches, seed=seed))
  results = {'checkpoint': os.fspath(checkpoint_path), 'format': checkpoint.format,
             'step': checkpoint.step, **results}
  print(json.dumps(results, indent=2), flush=True)
  if output_dir and jax.process_index() == 0:
    directory = epath.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / 'eval_results.json').write_text(json.dumps(results, indent=2))
  return results


def main(argv) -> dict:
  """Runs `evaluate`; errors a user can cause (a bad binding, a checkpoint that does not fit,
  an empty split) end in one line and exit status 1 (gin_utils.run; --verbose shows the
  traceback)."""
  from upcycle.checkpoints import CheckpointError  # pylint: disable=g-import-not-at-top
  from upcycle.data.iterator import EmptySplit  # pylint: disable=g-import-not-at-top
  return gin_utils.run(evaluate, argv, __doc__,
                       expected=(fields.ConfigError, CheckpointError, EmptySplit))


if __name__ == '__main__':
  main(sys.argv[1:])
