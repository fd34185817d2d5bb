"""How much of its training data a run read: epochs = training examples read by the run's end
(those of the run it read on from included) / examples in one epoch of the training split,
from the data position its last checkpoint saved; the epoch's size counted once per pipeline.
"""

import functools
import json
import os
from typing import Dict


def examples_per_epoch(pipeline: Dict, cache_dir: str) -> int:
  """Training examples in one epoch of `pipeline` (a data position's 'pipeline' description),
  counted by reading it once; cached in cache_dir/corpus.json."""
  key = json.dumps(pipeline, sort_keys=True)
  path = os.path.join(cache_dir, 'corpus.json')
  cache = {}
  if os.path.exists(path):
    with open(path) as f:
      cache = json.load(f)
  if key not in cache:
    cache[key] = _count(key)
    with open(path, 'w') as f:
      json.dump(cache, f, indent=1)
  return cache[key]


@functools.lru_cache(maxsize=None)
def _count(pipeline_json: str) -> int:
  from upcycle.data.images import ImagePipeline  # pylint: disable=g-import-not-at-top
  from upcycle.data.lm import LmPipeline  # pylint: disable=g-import-not-at-top
  from upcycle.data.text import TextPipeline  # pylint: disable=g-import-not-at-top
  fields = json.loads(pipeline_json)
  kind = fields.pop('kind')
  if kind == 'lm':   # described by its length and tokenizer digest: the offline tokenizer
    fields = {'task': fields['task'], 'split': fields['split'], 'pack': fields['pack'],
              'shuffle': fields['shuffle'], 'feature_lengths': {'targets': fields['length']}}
  pipeline = {'text': TextPipeline, 'image': ImagePipeline, 'lm': LmPipeline}[kind](**fields)
  batches = pipeline.batches(seed=0, batch_size=1024, shard_index=0, num_shards=1,
                             drop_remainder=False, skip_batches=0)
  return sum(len(next(iter(b.values()))) for b in batches.as_numpy_iterator())


def data_position(run_dir: str) -> Dict:
  """The data position (shard 0) saved with a finished run's last checkpoint."""
  from upcycle.checkpoints import orbax  # pylint: disable=g-import-not-at-top
  steps = orbax.finished_steps(os.path.join(run_dir, 'checkpoints'))
  if not steps:
    raise ValueError(f'{run_dir} has no finished checkpoint to read its data position from.')
  state = orbax.dataset_state(steps[max(steps)])
  if state is None:
    raise ValueError(f'{steps[max(steps)]} saved no data position.')
  return state['shards']['0']


def read(run_dir: str, cache_dir: str) -> float:
  """Training examples the run had read at its end (those of the run it read on from
  included) / examples in one epoch of its training data."""
  position = data_position(run_dir)
  total = examples_per_epoch(position['pipeline'], cache_dir)
  return position['epoch'] + position['batch_in_epoch'] * position['batch_size'] / total


def corpus_bytes(corpus: str) -> int:
  """UTF-8 bytes of the training split of an `offline_text` corpus ('pydoc', 'stdlib',
  'packages')."""
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  return sum(len(d.encode()) for d in offline_text.CORPORA[corpus]('train'))


def describe(corpus: str, run_dir: str, cache_dir: str) -> str:
  """The files-based offline `corpus` in words: its sha256 and whether it is the pinned one
  (the run's corpus.json once `run_dir` has one, else this machine's), its size and (once
  `run_dir` has a checkpoint) its sequences per epoch at that run's feature lengths."""
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  from upcycle.train import run_summary  # pylint: disable=g-import-not-at-top
  record = run_summary.read_corpus(run_dir) or offline_text.corpus_record(corpus)
  words = (f'the `{corpus}` offline corpus ({run_summary.corpus_words(record, named=False)}; '
           f'{corpus_bytes(corpus) / 1e6:.1f} MB of training text')
  if os.path.isdir(os.path.join(run_dir, 'checkpoints')):
    position = data_position(run_dir)
    lengths = position['pipeline']['feature_lengths']
    words += (f'; {examples_per_epoch(position["pipeline"], cache_dir):,} training sequences '
              f"of {lengths['inputs']} input / {lengths['targets']} target bytes per epoch")
  return words + ')'
