"""A seqio task's own metrics on a split's decoded examples, as T5X's `seqio.Evaluator`
computes them.

The task's `postprocess_fn` turns each decoded prediction (`is_target=False`) and each target
(`is_target=True`) text into what its metrics compare; every metric function of the task
that takes predictions (`predict_metric_fns`) is called as `fn(targets, predictions)`, every
one that also takes the model's auxiliary values (`predict_with_aux_metric_fns`) as
`fn(targets, predictions, aux_values)` with T5X's `{'scores': [n]}` (each decode's score,
`decoding.DecodeConfig`), every one that takes scores (`score_metric_fns`) as
`fn(targets, scores)`, the scores being each example's log-likelihood of its targets. Each
returns {name: value}: a number or `seqio.metrics.Scalar` is reported as a float, a
`seqio.metrics.Text` as its text, under '<task>/<name>', T5X's names; other values (images,
audio, histograms) are not recorded here, which is logged.
"""

import logging
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np

log = logging.getLogger(__name__)

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


def _named(task: Any, values: Mapping[str, Any]) -> Dict[str, Union[float, str]]:
  from seqio import metrics  # pylint: disable=g-import-not-at-top  (eval imports seqio anyway)
  out = {}
  for name, value in values.items():
    key = f'{task.name}/{name}'
    if isinstance(value, metrics.Text):
      out[key] = str(value.textdata)
    elif isinstance(value, metrics.MetricValue) and not isinstance(value, metrics.Scalar):
      log.warning('%s: a seqio.metrics.%s, which only scalars and texts are recorded here; '
                  'not reported.', key, type(value).__name__)
    else:
      out[key] = float(getattr(value, 'value', value))
  return out


def warn_metric_objects(task: Any) -> None:
  """Logs the task's metric objects (seqio's `metric_objs` API, beside `metric_fns`), which
  are not run here."""
  from seqio import metrics  # pylint: disable=g-import-not-at-top
  objects = [type(m).__name__ for m in task.metric_objs
             if not isinstance(m, metrics.PassthroughLegacyMetric)]
  if objects:
    log.warning('%s: its metric objects (%s, seqio metric_objs) are not run here; only its '
                'metric_fns are. Fix: give the task metric_fns to have them reported.',
                task.name, ', '.join(objects))


def predict_metrics(task: Any, records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
  """{'<task>/<metric>': value} of every metric function of `task` over the predictions of
  `records` (and, for those that take them, their decodes' scores as `aux_values`); {} when
  it has none, or the records have no texts."""
  with_aux = getattr(task, 'predict_with_aux_metric_fns', [])
  if not (task.predict_metric_fns or with_aux) or not records or 'prediction' not in records[0]:
    return {}
  targets, predictions = postprocessed(task, records)
  out = {}
  for metric_fn in task.predict_metric_fns:
    out.update(_named(task, metric_fn(targets, predictions)))
  aux_values = {'scores': np.asarray([r['score'] for r in records], np.float32)}
  for metric_fn in with_aux:
    out.update(_named(task, metric_fn(targets, predictions, aux_values=aux_values)))
  return out


def score_metrics(task: Any, records: Sequence[Mapping[str, Any]],
                  scores: np.ndarray) -> Dict[str, Any]:
  """{'<task>/<metric>': value} of every score metric function of `task`, `scores` `[n]` the
  log-likelihoods of the targets of `records`' examples, in their order."""
  targets, _ = postprocessed(task, records)
  out = {}
  for metric_fn in task.score_metric_fns:
    out.update(_named(task, metric_fn(targets, scores)))
  return out
