"""Progress and metrics: console line with steps/s, tokens/s and ETA; JSONL; TensorBoard.

Only process 0 writes files, through `etils.epath`, so MODEL_DIR may be a local path or
gs://. `MODEL_DIR/metrics.jsonl` holds one JSON object per
logged step ({'step': ..., 'split': 'train'|'eval', metrics...}), the file the
main job (`upcycle.quickstart`) plots from, one per warning ({'step', 'split': 'warning', 'message',
...}) and, at the end of an MoE run, its routing health ({'step', 'split': 'routing_health',
...}: `routing_health`). A resumed run first cuts the log back to the step it resumes from, so that
every step appears once; a new run (no checkpoint) starts an empty log. TensorBoard event files
are appended to as they are (TensorBoard shows the redone steps' latest values).

A GCS object cannot be appended to: on gs:// the log is kept in memory and the whole object
rewritten by `flush()` (the trainer calls it before every checkpoint, so the log always
reaches the step a restart resumes from), at most every FLUSH_SECONDS otherwise, and on close.
"""

import json
import logging
import time
from typing import Any, Dict, List, Mapping, Optional

import jax
import numpy as np
from etils import epath

from upcycle import progress

log = logging.getLogger(__name__)


FLUSH_SECONDS = 30.0
METRICS_FILE = 'metrics.jsonl'    # in MODEL_DIR
TENSORBOARD_DIR = 'tensorboard'   # in MODEL_DIR: one subdirectory per split


def _is_gcs(path: epath.Path) -> bool:
  return str(path).startswith('gs://')


def truncate_log(path, resume_step: Optional[int]) -> int:
  """Keeps the rows of `path` with step <= resume_step (none if None); returns rows dropped.

  Rewrites through a temporary file and a rename locally (a kill leaves the old or the new
  log), in one object write on gs://. A torn last line (a kill mid-write) is dropped.
  """
  path = epath.Path(path)
  if not path.exists():
    return 0
  kept, dropped = [], 0
  for line in path.read_text().splitlines(keepends=True):
    try:
      row = json.loads(line)
    except ValueError:
      dropped += 1
      continue
    if resume_step is not None and row.get('step', 0) <= resume_step:
      kept.append(line if line.endswith('\n') else line + '\n')
    else:
      dropped += 1
  if dropped:
    if _is_gcs(path):
      path.write_text(''.join(kept))
    else:
      tmp = path.parent / (path.name + '.tmp')
      tmp.write_text(''.join(kept))
      tmp.replace(path)
  return dropped


class _Jsonl:
  """Appends lines to a local file, or to a gs:// object rewritten whole (see module doc)."""

  def __init__(self, path: epath.Path):
    self.path, self._gcs = path, _is_gcs(path)
    self._lines = [path.read_text()] if self._gcs and path.exists() else []
    self._file = None if self._gcs else path.open('a')
    self._flushed = time.time()

  def write(self, line: str) -> None:
    if self._gcs:
      self._lines.append(line)
      if time.time() - self._flushed > FLUSH_SECONDS:
        self.flush()
    else:
      self._file.write(line)
      self._file.flush()

  def flush(self) -> None:
    if self._gcs:
      self.path.write_text(''.join(self._lines))
      self._flushed = time.time()
    else:
      self._file.flush()

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


# TensorBoard tags: T5X's names for the quantities T5X logs too (t5x/models.py and
# t5x/contrib/moe/models.py), so a T5X user's dashboards and comparisons carry over; the
# other metrics keep this project's names (metrics.jsonl keeps them all).
T5X_TAGS = {'cross_entropy': 'cross_ent_loss', 'steps_per_sec': 'timing/steps_per_second'}
# T5X MoE's means over the MoE layers of the per-layer metrics of the same definitions.
T5X_EXPERT_MEANS = {'fraction_dropped_tokens': 'experts/fraction_tokens_left_behind',
                    'expert_usage': 'experts/expert_usage',
                    'router_confidence': 'experts/router_confidence'}


def tensorboard_tags(values: Mapping[str, float]) -> Dict[str, float]:
  """One logged row's TensorBoard scalars: `T5X_TAGS` renamed, and T5X MoE's `experts/*`
  means over the per-layer `moe/<layer>/<name>` values (`T5X_EXPERT_MEANS`)."""
  out = {T5X_TAGS.get(name, name): value for name, value in values.items()}
  for name, tag in T5X_EXPERT_MEANS.items():
    layers = [v for k, v in values.items() if k.startswith('moe/') and k.endswith(f'/{name}')]
    if layers:
      out[tag] = float(np.mean(layers))
  return out


def _scalars(metrics: Mapping[str, np.ndarray]) -> Dict[str, float]:
  """Scalars as they are; vectors (e.g. per-expert usage) summarized by min and max."""
  out = {}
  for name, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      out[name] = float(value)
    else:
      out[f'{name}_min'] = float(value.min())
      out[f'{name}_max'] = float(value.max())
  return out


class MetricLogger:
  """Writes metrics to the console, `metrics.jsonl` and TensorBoard event files."""

  def __init__(self, model_dir: str, total_steps: int, tokens_per_step: int,
               tensorboard: bool = True, resume_step: Optional[int] = None,
               append: bool = False):
    """`resume_step`: the step a resumed run continues from (rows after it are dropped from
    metrics.jsonl); None for a new run (an earlier, checkpoint-less attempt's rows go).
    `append`: keep every row already in metrics.jsonl (`upcycle.eval` adds one per
    evaluation to a run's log)."""
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self._writes = jax.process_index() == 0
    self._jsonl = None
    self._tb = {}
    self._tensorboard = tensorboard
    self._model_dir = epath.Path(model_dir)
    if self._writes:
      self._model_dir.mkdir(parents=True, exist_ok=True)
      dropped = 0 if append else truncate_log(self._model_dir / METRICS_FILE, resume_step)
      if dropped:
        log.info('metrics.jsonl: dropped %d rows after step %d, from the part of an earlier '
                 'attempt that is redone now.', dropped, resume_step or 0)
      self._jsonl = _Jsonl(self._model_dir / METRICS_FILE)
    self._last = None  # (time, step) of the previous train log

  def _tb_writer(self, split: str):
    if split not in self._tb:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top  (training imports TF anyway)
      self._tb[split] = tf.summary.create_file_writer(
          str(self._model_dir / TENSORBOARD_DIR / split))
    return self._tb[split]

  def write(self, step: int, metrics: Mapping[str, np.ndarray], split: str = 'train',
            texts: Optional[Mapping[str, str]] = None) -> Dict:
    """Logs one step's metrics; for 'train' adds steps/s, tokens/s and the ETA. `texts`
    (e.g. a task metric's `seqio.metrics.Text`) go into the row and TensorBoard's text
    summaries."""
    texts = dict(texts or {})
    values = _scalars(metrics)
    now = time.time()
    if split == 'train' and self._last is not None and step > self._last[1]:
      steps_per_sec = (step - self._last[1]) / max(now - self._last[0], 1e-9)
      values['steps_per_sec'] = steps_per_sec
      values['tokens_per_sec'] = steps_per_sec * self.tokens_per_step
    if split == 'train':
      self._last = (now, step)
    if self._writes:
      self._jsonl.write(json.dumps({'step': int(step), 'split': split, **values, **texts})
                        + '\n')
      if self._tensorboard:
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        with self._tb_writer(split).as_default(step=int(step)):
          for name, value in tensorboard_tags(values).items():
            tf.summary.scalar(name, value)
          for name, text in texts.items():
            tf.summary.text(name, text)
      log.info('%s', self._line(step, values, split))
    return values

  def warn(self, step: int, message: str, **fields) -> None:
    """A warning: on the console, and in metrics.jsonl as a row with split 'warning'."""
    if self._writes:
      self.record({'step': int(step), 'split': 'warning', 'message': message, **fields})
      log.warning('WARNING at step %d: %s', step, message)

  def record(self, row: Mapping[str, Any]) -> None:
    """One row of metrics.jsonl as it is (JSON: nested blocks and booleans kept)."""
    if self._writes:
      self._jsonl.write(json.dumps(row) + '\n')

  def rows(self) -> List[dict]:
    """The rows of metrics.jsonl so far, this run's and the attempts' it resumes (process 0;
    [] on the others)."""
    if not self._writes:
      return []
    self.flush()
    return [json.loads(line) for line in
            (self._model_dir / METRICS_FILE).read_text().splitlines() if line.strip()]

  def _line(self, step: int, values: Mapping[str, float], split: str) -> str:
    shown = [f'{split} step {step}/{self.total_steps}']
    for name in ('loss', 'accuracy', 'learning_rate', 'moe/total'):
      if name in values:
        shown.append(f'{name} {values[name]:.4g}')
    if 'steps_per_sec' in values:
      rate = values['steps_per_sec']
      shown.append(f'{rate:.2f} steps/s, {values["tokens_per_sec"]:.0f} tokens/s, '
                   f'ETA {progress.eta((self.total_steps - step) / max(rate, 1e-9))}')
    return ' | '.join(shown)

  def flush(self) -> None:
    """Makes everything logged so far durable (metrics.jsonl; TensorBoard flushes itself)."""
    if self._jsonl is not None:
      self._jsonl.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    for writer in self._tb.values():
      writer.flush()
      writer.close()


def write_eval_results(directory: str, results: Mapping[str, Any], *, tensorboard: bool) -> None:
  """An evaluation's `results` ({'step': the checkpoint's or None, metrics...}) in
  `directory`, local or gs://: eval_results.json (this evaluation), a row of metrics.jsonl
  ({'step', 'split': 'eval', metrics...}, one per evaluation, appended) and, with
  `tensorboard`, TensorBoard scalars and the task metrics' texts (keys with a '/') in
  tensorboard/eval; the numbers among `results` are the metrics (`python -m upcycle.eval`,
  `python -m upcycle.lm_eval`)."""
  path = epath.Path(directory)
  path.mkdir(parents=True, exist_ok=True)
  (path / 'eval_results.json').write_text(json.dumps(results, indent=2))
  step = int(results['step'] or 0)
  scalars = {k: v for k, v in results.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and k != 'step'}
  texts = {k: v for k, v in results.items() if '/' in k and isinstance(v, str)}  # task metrics
  logger = MetricLogger(str(path), total_steps=step, tokens_per_step=0,
                        tensorboard=tensorboard, append=True)
  logger.write(step, scalars, split='eval', texts=texts)
  logger.close()
