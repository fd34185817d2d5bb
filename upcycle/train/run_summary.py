"""The lines `python -m upcycle.train` ends with: the step reached, the wall time, where the
run's checkpoints, metrics and TensorBoard files are, the offline corpus it trained on (its
digest, and whether that is the pinned one: `offline_text.corpus_record`, which the run also
keeps in MODEL_DIR/corpus.json) and an MoE run's routing health (the block `routing_health` of
metrics.jsonl, `upcycle.train.routing_health`)."""

import json
import os
import shlex
from typing import Dict, Mapping, Optional

from upcycle import progress
from upcycle.train import routing_health
from upcycle.train.logger import METRICS_FILE, TENSORBOARD_DIR


CORPUS_FILE = 'corpus.json'   # in MODEL_DIR: the offline corpus's record


def text(model_dir: str, step: int, checkpoint: Optional[str], tensorboard: bool,
         seconds: float, corpus: Optional[Dict] = None,
         routing: Optional[Mapping] = None) -> str:
  """The closing lines of a run that reached `step` in `seconds`, its latest checkpoint the
  directory `checkpoint` (None: none saved); `tensorboard`: whether it wrote TensorBoard
  files; `corpus`: the `offline_text.corpus_record` of its training data (None: not an
  offline corpus read from files); then an MoE run's `routing` health (its metrics.jsonl row;
  None: a dense run), a verdict line and one line per MoE layer."""
  saved = (f'{os.path.dirname(checkpoint)} (latest: {checkpoint})' if checkpoint
           else 'none saved')
  lines = [f'Done: step {step} in {progress.eta(seconds)}.',
           f'  checkpoints:  {saved}',
           f'  metrics:      {os.path.join(model_dir, METRICS_FILE)}']
  if tensorboard:
    logdir = os.path.join(model_dir, TENSORBOARD_DIR)
    lines.append(f'  TensorBoard:  tensorboard --logdir {shlex.quote(logdir)}')
  if corpus:
    lines.append(f'  corpus:       {corpus_words(corpus)}')
  if routing is not None:
    verdict, *layers = routing_health.lines(routing)
    lines += [f'  routing:      {verdict}', *[f'    {line}' for line in layers]]
  return '\n'.join(lines)


def corpus_words(corpus: Dict, named: bool = True) -> str:
  """An `offline_text.corpus_record` in one line: its name (if `named`), digest and whether
  it is the pinned one."""
  if corpus['matches'] is None:
    pin = 'not pinned: ' + ', '.join(f'{n} {v}' for n, v in corpus['versions'].items())
  else:
    pin = 'the pinned one' if corpus['matches'] else f"NOT the pinned {corpus['pinned_digest']}"
  return f"{corpus['corpus'] + ', ' if named else ''}sha256 {corpus['digest']} ({pin})"


def write_corpus(model_dir: str, corpus: Dict) -> None:
  """Keeps `corpus` (an `offline_text.corpus_record`) in MODEL_DIR/corpus.json."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  (epath.Path(model_dir) / CORPUS_FILE).write_text(json.dumps(corpus, indent=1) + '\n')


def read_corpus(model_dir: str) -> Optional[Dict]:
  """The run's MODEL_DIR/corpus.json (`write_corpus`); None if it trained on no offline
  corpus read from files (or ran before runs kept one)."""
  path = os.path.join(model_dir, CORPUS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
