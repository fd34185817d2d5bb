"""An English corpus that ships with Python: the documentation topics of `pydoc_data.topics`.

Real prose and code from the Python reference manual, so language-model pipelines run with no
download. Documents are paragraphs (blank-line separated), each kept once: ~2070 distinct
paragraphs, ~370 KB. Split by topic, deterministically: every tenth of the 79 topics in sorted
order is 'validation' (~210 paragraphs, ~29 KB), so validation text comes from topics never seen
in training. The exact text depends on the Python version (`sys.version`).
"""

import functools
import re
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

SPLITS = ('train', 'validation')
_VALIDATION_EVERY = 10


@functools.lru_cache(maxsize=None)
def paragraphs(split: str) -> Tuple[str, ...]:
  """The paragraphs of `split`, in corpus order (sorted topics, then position in topic)."""
  if split not in SPLITS:
    raise ValueError(f'The offline corpus has splits {SPLITS}; got split {split!r}.')
  from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top
  out, seen = [], set()
  for i, name in enumerate(sorted(topics)):
    for p in re.split(r'\n\s*\n', topics[name]):
      p = p.strip()
      if p and p not in seen:  # Some paragraphs recur across topics; keep the first.
        seen.add(p)
        if (i % _VALIDATION_EVERY == 0) == (split == 'validation'):
          out.append(p)
  return tuple(out)


def dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None) -> tf.data.Dataset:
  """`seqio.FunctionDataSource` source: `{'text': string scalar}` per paragraph.

  With `shuffle_files`, the order is a full permutation drawn from `seed` (numpy, so it is the
  same on every machine); otherwise corpus order.
  """
  texts = np.array(paragraphs(split), dtype=object)
  if shuffle_files:
    texts = texts[np.random.default_rng(seed).permutation(len(texts))]
  return tf.data.Dataset.from_tensor_slices({'text': tf.constant(list(texts), tf.string)})
