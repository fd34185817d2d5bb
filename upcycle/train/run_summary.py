"""The lines `python -m upcycle.train` ends with: the step reached, the wall time, where the
run's checkpoints, metrics and TensorBoard files are, and an MoE run's routing health (the
block `routing_health` of metrics.jsonl, `upcycle.train.routing_health`)."""

import os
import shlex
from typing import Mapping, Optional

from upcycle import progress
from upcycle.train import routing_health
from upcycle.train.logger import METRICS_FILE, TENSORBOARD_DIR


def text(model_dir: str, step: int, checkpoint: Optional[str], tensorboard: bool,
         seconds: float, routing: Optional[Mapping] = None) -> str:
  """Up to four lines for a run that reached `step` in `seconds`, its latest checkpoint the
  directory `checkpoint` (None: none saved); `tensorboard`: whether it wrote TensorBoard
  files; then an MoE run's `routing` health (its metrics.jsonl row; None: a dense run), a
  verdict line and one line per MoE layer."""
  saved = (f'{os.path.dirname(checkpoint)} (latest: {checkpoint})' if checkpoint
           else 'none saved')
  lines = [f'Done: step {step} in {progress.eta(seconds)}.',
           f'  checkpoints:  {saved}',
           f'  metrics:      {os.path.join(model_dir, METRICS_FILE)}']
  if tensorboard:
    logdir = os.path.join(model_dir, TENSORBOARD_DIR)
    lines.append(f'  TensorBoard:  tensorboard --logdir {shlex.quote(logdir)}')
  if routing is not None:
    verdict, *layers = routing_health.lines(routing)
    lines += [f'  routing:      {verdict}', *[f'    {line}' for line in layers]]
  return '\n'.join(lines)
