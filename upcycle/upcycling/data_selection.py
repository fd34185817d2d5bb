"""UpIT's expert-specific data selection: every sample to the expert that models it best.

Each training sample is scored by every expert checkpoint (its loss, i.e. log
perplexity: the same order as perplexity); the sample goes to the bucket of its
lowest-loss expert, or, when that bucket is full, to the next lowest, and so on.
The buckets then label the data of the router stage (`router_training`).
"""

from typing import Any, Callable, Iterable, Sequence

import numpy as np

LossFn = Callable[[Any, Any], Any]   # (params, batch) -> per-sample loss [batch]


def score_samples(loss_fn: LossFn, expert_params: Sequence[Any],
                  batches: Iterable[Any]) -> np.ndarray:
  """Loss of every sample under every expert checkpoint: `[samples, experts]`.

  Args:
    loss_fn: `(params, batch) -> [batch]` per-sample loss, e.g. the mean
      token cross-entropy of a dense T5 (log perplexity); jit it once.
    expert_params: the dense param trees the experts come from (e.g. the
      intermediate checkpoints of `sources.Merge` / `FromCheckpoints`).
    batches: the training samples, in a fixed order (iterated once).
  """
  rows = []
  for batch in batches:
    rows.append(np.stack([np.asarray(loss_fn(p, batch), np.float64) for p in expert_params], 1))
  if not rows:
    raise ValueError('score_samples: no batches.')
  return np.concatenate(rows, axis=0)


def assign_buckets(losses: np.ndarray, bucket_size: int) -> np.ndarray:
  """The expert bucket of each sample: `[samples, experts]` losses -> `[samples]` int.

  Samples are placed in order; each goes to its lowest-loss expert whose bucket
  holds fewer than `bucket_size` samples. Equal losses go to the lower expert
  index.

  Raises:
    ValueError: when the buckets cannot hold every sample
      (samples > experts * bucket_size).
  """
  losses = np.asarray(losses)
  if losses.ndim != 2:
    raise ValueError(f'assign_buckets: losses have shape {losses.shape}; expected '
                     f'[samples, experts].')
  samples, experts = losses.shape
  if bucket_size < 1 or samples > experts * bucket_size:
    raise ValueError(
        f'assign_buckets: {samples} samples do not fit {experts} buckets of bucket_size='
        f'{bucket_size}. Fix: bucket_size >= {-(-samples // experts)}, or score fewer samples.')
  preference = np.argsort(losses, axis=1, kind='stable')   # lowest loss first, ties by index
  filled = np.zeros(experts, np.int64)
  bucket = np.empty(samples, np.int64)
  for i in range(samples):
    expert = next(e for e in preference[i] if filled[e] < bucket_size)
    bucket[i] = expert
    filled[expert] += 1
  return bucket
