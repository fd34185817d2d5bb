"""A seqio task's own metrics on a split's decoded examples, as T5X's `seqio.Evaluator`
computes them.

The task's `postprocess_fn` turns each decoded prediction (`is_target=False`) and each target
(`is_target=True`) text into what its metrics compare; every metric function of the task
that takes predictions (`predict_metric_fns`) is called as `fn(targets, predictions)`, every
one that takes scores (`score_metric_fns`) as `fn(targets, scores)`, the scores being each
example's log-likelihood of its targets. Each returns {name: value} (a float or a
`seqio.metrics.MetricValue`); the values are reported as '<task>/<name>', T5X's names.
"""

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np


def _example(record: Mapping[str, Any]) -> Dict[str, Any]:
  """What a postprocess function gets as `example`: the example's texts and tokens."""
  return {'inputs_pretokenized': record['inputs'], 'targets_pretokenized': record['targets'],
          'inputs': np.asarray(record['input_tokens']),
          'targets': np.asarray(record['target_tokens'])}


def postprocessed(task: Any, records: Sequence[Mapping[str, Any]]) -> Tuple[List, List]:
  """(targets, predictions) of decoded `records` (`predictions.example_records`), through
  the task's `postprocess_fn`."""
  targets = [task.postprocess_fn(r['targets'], example=_example(r), is_target=True)
             for r in records]
  predictions = [task.postprocess_fn(r['prediction'], example=_example(r), is_target=False)
                 for r in records]
  return targets, predictions


def _named(task: Any, values: Mapping[str, Any]) -> Dict[str, float]:
  return {f'{task.name}/{name}': float(getattr(value, 'value', value))
          for name, value in values.items()}


def predict_metrics(task: Any, records: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
  """{'<task>/<metric>': value} of every metric function of `task` over the predictions of
  `records` ({} when it has none, or the records have no texts)."""
  if not task.predict_metric_fns or not records or 'prediction' not in records[0]:
    return {}
  targets, predictions = postprocessed(task, records)
  out = {}
  for metric_fn in task.predict_metric_fns:
    out.update(_named(task, metric_fn(targets, predictions)))
  return out


def score_metrics(task: Any, records: Sequence[Mapping[str, Any]],
                  scores: np.ndarray) -> Dict[str, float]:
  """{'<task>/<metric>': value} of every score metric function of `task`, `scores` `[n]` the
  log-likelihoods of the targets of `records`' examples, in their order."""
  targets, _ = postprocessed(task, records)
  out = {}
  for metric_fn in task.score_metric_fns:
    out.update(_named(task, metric_fn(targets, scores)))
  return out
