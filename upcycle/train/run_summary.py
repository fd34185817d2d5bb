"""The lines `python -m upcycle.train` ends with: the step reached, the wall time, and where
the run's checkpoints, metrics and TensorBoard files are."""

import os
import shlex
from typing import Optional

from upcycle import progress
from upcycle.train.logger import METRICS_FILE, TENSORBOARD_DIR


def text(model_dir: str, step: int, checkpoint: Optional[str], tensorboard: bool,
         seconds: float) -> str:
  """Up to four lines for a run that reached `step` in `seconds`, its latest checkpoint the
  directory `checkpoint` (None: none saved); `tensorboard`: whether it wrote TensorBoard
  files."""
  saved = (f'{os.path.dirname(checkpoint)} (latest: {checkpoint})' if checkpoint
           else 'none saved')
  lines = [f'Done: step {step} in {progress.eta(seconds)}.',
           f'  checkpoints:  {saved}',
           f'  metrics:      {os.path.join(model_dir, METRICS_FILE)}']
  if tensorboard:
    logdir = os.path.join(model_dir, TENSORBOARD_DIR)
    lines.append(f'  TensorBoard:  tensorboard --logdir {shlex.quote(logdir)}')
  return '\n'.join(lines)
