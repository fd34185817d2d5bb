"""python -m upcycle.eval --gin_file=... --gin.CHECKPOINT_PATH=...: evaluate a checkpoint.

Reads any checkpoint `upcycle.checkpoints.load` supports (this project's orbax runs, T5X,
HF, vit_jax/big_vision npz), checks it against the gin-configured model, and reports
validation loss and accuracy; for T5 also sequence accuracy (exact match of greedy-decoded
targets, `decode_data`); for ViT also few-shot linear accuracy. Gin files bind
`eval_script.evaluate` (`import __main__ as eval_script`); see configs/runs/eval.gin.

A checkpoint that carries digests (a step of a training run, an output of convert or export)
is first compared with them, reading every parameter once: changed bytes stop it in one line
naming the array. --no_verify skips that and evaluates the checkpoint as it is.
"""

import json
import os
import sys
from typing import Any, Optional, Sequence

import jax

from upcycle import fields, gin_utils, predictions, startup


def evaluate(*, objective: Any, eval_data: Any, checkpoint_path: str, batch_size: int,
             format: Optional[str] = None,  # pylint: disable=redefined-builtin
             eval_batches: int = 0, fewshot_train_data: Optional[Any] = None,
             fewshot_shots: Sequence[int] = (1, 5, 10), fewshot_l2_reg: float = 2.0 ** 10,
             decode_data: Optional[Any] = None, decoding: Optional[Any] = None,
             decode_batches: int = 0, other_row_inputs: bool = False,
             num_microbatches: int = 1, num_expert_partitions: int = 1,
             num_model_partitions: int = 1, logical_axis_rules: Any = 'default',
             output_dir: Optional[str] = None, tensorboard: bool = True, seed: int = 0,
             verify: bool = True) -> dict:
  """Evaluates `checkpoint_path` with `objective`'s model; returns (and prints) the metrics.

  `decode_data` (an unpacked seq2seq split; None: skip) adds `sequence_accuracy` from decoded
  outputs (`decoding`, an `upcycle.decoding.DecodeConfig`; None: greedy) over at most
  `decode_batches` batches (0: all), `decoded_examples`, their number, and the metrics of the
  task's own `metric_fns` ('<task>/<metric>', `upcycle.task_metrics`). `other_row_inputs`
  (T5) adds what the loss owes to the input: `input_use`, the loss over the same batches with
  each row's encoder input swapped for another row's minus the loss with its own, with its
  paired standard error and that loss and accuracy (`evaluation.input_use`).

  `num_microbatches` (gin: EVAL_MICROBATCHES) evaluates each batch that many rows at a time
  and adds the sums (the numbers do not change; a device holds a microbatch's activations and
  logits: a batch that trains in microbatches evaluates in them too).

  Every process of a slice runs it (`launch/tpu_vm.py eval`); the numbers are those of one
  process. The parameters are placed on the mesh of all devices (`num_expert_partitions`,
  `num_model_partitions`) by `logical_axis_rules`, the training run's (gin:
  LOGICAL_AXIS_RULES, `partitioning.rules`: 'default', 'fsdp' or a list of pairs). With
  `output_dir`, process 0 writes eval_results.json, appends a row to metrics.jsonl and, with
  `tensorboard`, writes TensorBoard scalars (tensorboard/eval), at the checkpoint's step.

  With `verify` (`--no_verify` clears it), the parameters are first compared with the digests
  the checkpoint carries (`checkpoints/verify.py`): changed bytes stop it in one line.
  """
  # pylint: disable=g-import-not-at-top
  from upcycle import decoding as decoding_lib
  from upcycle import pretrained
  from upcycle import partitioning
  from upcycle.train import evaluation
  from upcycle.train.step import make_eval_step
  from upcycle.train.objectives import Seq2Seq
  # pylint: enable=g-import-not-at-top
  fields.integer_value('BATCH_SIZE (eval_script.evaluate.batch_size)', batch_size, 1)
  microbatches = 'EVAL_MICROBATCHES (eval_script.evaluate.num_microbatches)'
  fields.integer_value(microbatches, num_microbatches, 1)
  fields.divisor_value(microbatches, num_microbatches, total=batch_size, of='BATCH_SIZE')
  if other_row_inputs and not isinstance(objective, Seq2Seq):
    raise fields.ConfigError(
        f'eval_script.evaluate.other_row_inputs = True swaps encoder inputs between rows; '
        f'{type(objective).__name__} has no encoder. Fix: set it False (a seq2seq objective '
        f'only).')
  if output_dir:
    fields.directory('EVAL_OUTPUT_DIR (eval_script.evaluate.output_dir)', output_dir)
  rules = partitioning.rules(logical_axis_rules,
                             'LOGICAL_AXIS_RULES (eval_script.evaluate.logical_axis_rules)')
  mesh = partitioning.make_mesh(num_expert_partitions, num_model_partitions)
  checkpoint, params, _ = pretrained.load_on_mesh(
      checkpoint_path, model_config=objective.model.config, mesh=mesh, rules=rules,
      format=format, verify=verify, sizes=partitioning.mesh_sizes(
          expert='NUM_EXPERT_PARTITIONS (eval_script.evaluate.num_expert_partitions)',
          model='NUM_MODEL_PARTITIONS (eval_script.evaluate.num_model_partitions)'),
      check=lambda ckpt: pretrained.check_tokenizer(
          eval_data, objective.model.config, ckpt.path, ckpt.format,
          fix="TOKENIZER = %CHECKPOINT_PATH (the checkpoint's own); a run whose tokenizer/ "
          'was replaced needs the one it was trained with put back.'))
  host_batch = batch_size // jax.process_count()
  with partitioning.activate(mesh, rules):
    eval_step = jax.jit(make_eval_step(objective, num_microbatches))
    measure = evaluation.input_use if other_row_inputs else evaluation.evaluate
    results = measure(eval_step, params, eval_data, batch_size=host_batch, mesh=mesh,
                      max_batches=eval_batches, seed=seed)
    if fewshot_train_data is not None:
      results.update(evaluation.linear_fewshot(
          objective, params, fewshot_train_data, eval_data, batch_size=host_batch, mesh=mesh,
          shots=fewshot_shots, l2_reg=fewshot_l2_reg, max_batches=eval_batches, seed=seed))
    if decode_data is not None:
      results.update(predictions.decoded_metrics(
          objective, params, decode_data, decoding or decoding_lib.DecodeConfig(),
          batch_size=batch_size, mesh=mesh, max_batches=decode_batches, seed=seed))
  results = {'checkpoint': os.fspath(checkpoint_path), 'format': checkpoint.format,
             'step': checkpoint.step, **results}
  print(json.dumps(results, indent=2), flush=True)
  if output_dir and jax.process_index() == 0:
    from upcycle.train.logger import write_eval_results  # pylint: disable=g-import-not-at-top
    write_eval_results(output_dir, results, tensorboard=tensorboard)
  return results


def main(argv) -> dict:
  """Runs `evaluate`; errors a user can cause (a bad binding, a checkpoint that does not fit,
  an empty split, a tokenizer that is not the checkpoint's) end in one line and exit status 1
  (gin_utils.run; --verbose shows the traceback)."""
  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import CheckpointError
  from upcycle.data.iterator import EmptySplit
  from upcycle.data.tokenizer import TokenizerError
  # pylint: enable=g-import-not-at-top
  argv, given = gin_utils.no_verify(argv)
  return gin_utils.run(evaluate, argv, __doc__, given=given,
                       expected=(fields.ConfigError, CheckpointError, EmptySplit, TokenizerError))


if __name__ == '__main__':
  startup.begin()
  main(sys.argv[1:])
