"""Evaluation over a validation split: loss/accuracy for any objective, few-shot for ViT.

Every example of the split counts once, whatever the batch size: the last partial batch is
padded to the batch size (one compiled shape) with rows that `EXAMPLE_MASK` marks 0, which the
objectives weigh 0 (T5X's evaluator pads the same way).
"""

from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import partitioning
from upcycle.data.iterator import DataIterator
from upcycle.train import fewshot
from upcycle.train.objectives import EXAMPLE_MASK


def pad_batch(batch: Dict[str, np.ndarray], batch_size: int) -> Dict[str, np.ndarray]:
  """A host batch of n <= batch_size examples -> batch_size rows (added rows zeros) and its
  `EXAMPLE_MASK`."""
  n = next(iter(batch.values())).shape[0]
  padded = {k: np.pad(v, [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1))
            for k, v in batch.items()}
  return {**padded, EXAMPLE_MASK: (np.arange(batch_size) < n).astype(np.float32)}


def host_batches(pipeline, batch_size: int, max_batches: int, seed: int):
  """This host's rows of one epoch of `pipeline` (at most `max_batches` batches; 0: all), every
  example once, each batch padded to `batch_size` with its `EXAMPLE_MASK`.

  Every host reads the split whole, in one order, and keeps its `batch_size` rows of each
  global batch (`batch_size` x the number of hosts): a slice evaluates the examples, and
  batches, one process evaluates, whatever its number of hosts (sharding the source instead
  would give each host examples of its own, span corruption's noise included).
  """
  hosts, host = jax.process_count(), jax.process_index()
  iterator = DataIterator(pipeline, batch_size=batch_size * hosts, seed=seed, num_epochs=1,
                          drop_remainder=False)
  for i, batch in enumerate(iterator):
    if max_batches and i >= max_batches:
      return
    yield pad_batch({k: v[host * batch_size:(host + 1) * batch_size] for k, v in batch.items()},
                    batch_size)


def global_batch(local: Dict[str, np.ndarray], mesh) -> Dict[str, jax.Array]:
  """Per-host numpy batch -> global arrays sharded over ('expert', 'data')."""
  return {k: jax.make_array_from_process_local_data(partitioning.batch_sharding(mesh, v.ndim), v)
          for k, v in local.items()}


def ratio_stderr(numerators: np.ndarray, denominators: np.ndarray) -> float:
  """Standard error of sum(numerators) / sum(denominators) over `n` batches `[n]`.

  The ratio (delta-method) estimator: sqrt(n / (n - 1) * sum((a_b - R w_b)^2)) / sum(w_b),
  R the ratio; with equal denominators it is the standard error of the batch means. Batches,
  not tokens, are the units: tokens of one sequence are not independent. NaN for n < 2.
  """
  a, w = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
  n = a.size
  if n < 2:
    return float('nan')
  ratio = a.sum() / w.sum()
  return float(np.sqrt(n / (n - 1) * np.sum((a - ratio * w) ** 2)) / w.sum())


def evaluate(eval_step, params, pipeline, *, batch_size: int, mesh, max_batches: int = 0,
             seed: int = 0, batches: Optional[Sequence[Dict[str, np.ndarray]]] = None
             ) -> Dict[str, float]:
  """Token (T5) or image (ViT) weighted loss and accuracy, the loss's standard error over
  batches (`loss_stderr`, from 2 batches on) and the number of batches; `eval_step` from
  step.make_eval_step. `batches`: this host's validation batches already read (`host_batches`,
  e.g. kept by the trainer); None reads them from `pipeline`."""
  per_batch = []
  source = host_batches(pipeline, batch_size, max_batches, seed) if batches is None else batches
  for batch in source:
    per_batch.append(eval_step(params, global_batch(batch, mesh)))
  return _metrics(_per_batch_sums(per_batch, pipeline))


def _per_batch_sums(per_batch: Sequence[Dict[str, jax.Array]], pipeline) -> Dict[str, np.ndarray]:
  """eval steps' sums, one per batch -> {statistic: `[batches]` float64}."""
  if not per_batch:
    raise ValueError(f'The validation pipeline {pipeline.describe()} gave no example.')
  return {k: np.array([float(b[k]) for b in jax.device_get(per_batch)], np.float64)
          for k in per_batch[0]}


def _metrics(sums: Dict[str, np.ndarray]) -> Dict[str, float]:
  """`_per_batch_sums` -> `evaluate`'s metrics."""
  losses, weights = sums['loss'] - sums['z_loss'], sums['weight_sum']
  weight = max(float(weights.sum()), 1.0)
  metrics = {'loss': float(losses.sum()) / weight,
             'accuracy': float(sums['correct'].sum()) / weight, 'batches': len(losses)}
  real = weights > 0    # a batch with no real token (padding only) is not a batch
  if real.sum() > 1:
    metrics['loss_stderr'] = ratio_stderr(losses[real], weights[real])
  return metrics


def other_row_inputs(batch: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
  """`batch` with each row's encoder input (every `encoder_*` array, `[batch, length]`) taken
  from the row before it, the first row's from the last; the targets stay."""
  return {k: jnp.roll(v, 1, axis=0) if k.startswith('encoder_') else v for k, v in batch.items()}


def input_use(eval_step, params, pipeline, *, batch_size: int, mesh, max_batches: int = 0,
              seed: int = 0) -> Dict[str, float]:
  """`evaluate`'s metrics and what a seq2seq model's validation loss owes to its input: over
  the same batches, read once, the loss and accuracy with each row's encoder input swapped for
  another row's (`other_row_inputs/loss`, `/accuracy`), and `input_use`, that loss minus the
  loss with its own input (nats per target token; about 0 for a model that ignores its input),
  with its paired standard error over batches (`input_use_stderr`)."""
  other_step = jax.jit(lambda p, batch: eval_step(p, other_row_inputs(batch)))
  own, other = [], []
  for batch in host_batches(pipeline, batch_size, max_batches, seed):
    batch = global_batch(batch, mesh)
    own.append(eval_step(params, batch))
    other.append(other_step(params, batch))
  own, other = _per_batch_sums(own, pipeline), _per_batch_sums(other, pipeline)
  weights = own['weight_sum']
  weight = max(float(weights.sum()), 1.0)
  own_losses, other_losses = own['loss'] - own['z_loss'], other['loss'] - other['z_loss']
  real = weights > 0
  return {**_metrics(own), 'other_row_inputs/loss': float(other_losses.sum()) / weight,
          'other_row_inputs/accuracy': float(other['correct'].sum()) / weight,
          'input_use': float((other_losses - own_losses).sum()) / weight,
          'input_use_stderr': ratio_stderr((other_losses - own_losses)[real], weights[real])}


def linear_fewshot(objective, params, train_pipeline, test_pipeline, *, batch_size: int,
                   mesh, shots: Sequence[int] = (1, 5, 10), l2_reg: float = 2.0 ** 10,
                   max_batches: int = 0, seed: int = 0) -> Dict[str, float]:
  """{'fewshot/{n}shot': accuracy} of ridge regression on the model's pre-logit features."""
  features = jax.jit(objective.features)

  def collect(pipeline):
    xs, ys = [], []
    for batch in host_batches(pipeline, batch_size, max_batches, seed):
      real = batch[EXAMPLE_MASK] > 0
      xs.append(np.asarray(jax.device_get(features(params, global_batch(batch, mesh))))[real])
      ys.append(batch['label'][real])
    return np.concatenate(xs), np.concatenate(ys)

  train_x, train_y = collect(train_pipeline)
  test_x, test_y = collect(test_pipeline)
  num_classes = objective.model.config.num_classes
  return {f'fewshot/{n}shot': fewshot.fewshot_accuracy(
      train_x, train_y, test_x, test_y, shots=n, num_classes=num_classes, l2_reg=l2_reg,
      seed=seed) for n in shots}
