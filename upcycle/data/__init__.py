"""Input pipelines on TensorFlow / seqio. Import only from training entry points.

Models, checkpoints and upcycling never import this package, so their tests run without
TensorFlow. Modules: `span_corruption` + `chunking` (T5 pretraining objective), `offline_text`
(a corpus that ships with Python), `tasks` (registered seqio tasks), `text` and `images` (batched
pipelines), `iterator` (deterministic, resumable numpy batches).

Importing the package hides accelerators from TensorFlow: tf.data runs on the host and must not
claim GPU/TPU memory that JAX owns.
"""

import logging

import tensorflow as tf


def _hide_accelerators_from_tensorflow():
  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError) as e:  # TF devices already initialized by someone else.
    logging.warning('upcycle.data could not hide accelerators from TensorFlow: %s', e)


_hide_accelerators_from_tensorflow()
