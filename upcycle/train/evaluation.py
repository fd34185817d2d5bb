"""Evaluation over a validation split: loss/accuracy for any objective, few-shot for ViT."""

from typing import Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from upcycle.data.iterator import DataIterator
from upcycle.train import fewshot, partitioning


def host_batches(pipeline, batch_size: int, max_batches: int, seed: int):
  """One epoch of this host's shard of `pipeline`, at most `max_batches` (0: all)."""
  iterator = DataIterator(pipeline, batch_size=batch_size, seed=seed,
                          shard_index=jax.process_index(), num_shards=jax.process_count(),
                          num_epochs=1)
  for i, batch in enumerate(iterator):
    if max_batches and i >= max_batches:
      return
    yield batch


def global_batch(local: Dict[str, np.ndarray], mesh) -> Dict[str, jax.Array]:
  """Per-host numpy batch -> global arrays sharded over ('expert', 'data')."""
  return {k: jax.make_array_from_process_local_data(partitioning.batch_sharding(mesh, v.ndim), v)
          for k, v in local.items()}


def evaluate(eval_step, params, pipeline, *, batch_size: int, mesh, max_batches: int = 0,
             seed: int = 0) -> Dict[str, float]:
  """Token (T5) or image (ViT) weighted loss and accuracy; `eval_step` from step.make_eval_step."""
  totals = None
  for batch in host_batches(pipeline, batch_size, max_batches, seed):
    sums = eval_step(params, global_batch(batch, mesh))
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    raise ValueError(f'The validation pipeline {pipeline.describe()} gave no full batch of '
                     f'{batch_size}; lower the batch size.')
  totals = jax.device_get(totals)
  weight = max(float(totals['weight_sum']), 1.0)
  return {'loss': (float(totals['loss']) - float(totals['z_loss'])) / weight,
          'accuracy': float(totals['correct']) / weight}


def linear_fewshot(objective, params, train_pipeline, test_pipeline, *, batch_size: int,
                   mesh, shots: Sequence[int] = (1, 5, 10), l2_reg: float = 2.0 ** 10,
                   max_batches: int = 0, seed: int = 0) -> Dict[str, float]:
  """{'fewshot/{n}shot': accuracy} of ridge regression on the model's pre-logit features."""
  features = jax.jit(objective.features)

  def collect(pipeline):
    xs, ys = [], []
    for batch in host_batches(pipeline, batch_size, max_batches, seed):
      xs.append(np.asarray(jax.device_get(features(params, global_batch(batch, mesh)))))
      ys.append(batch['label'])
    return np.concatenate(xs), np.concatenate(ys)

  train_x, train_y = collect(train_pipeline)
  test_x, test_y = collect(test_pipeline)
  num_classes = objective.model.config.num_classes
  return {f'fewshot/{n}shot': fewshot.fewshot_accuracy(
      train_x, train_y, test_x, test_y, shots=n, num_classes=num_classes, l2_reg=l2_reg,
      seed=seed) for n in shots}
