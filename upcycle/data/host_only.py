"""tf.data runs on the host: TensorFlow must not claim the GPU/TPU memory that JAX owns."""

import functools
import logging

import tensorflow as tf


@functools.cache
def hide_accelerators() -> None:
  """Makes GPUs and TPUs invisible to TensorFlow; called before a pipeline is built (once)."""
  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError) as e:  # TF devices already initialized by someone else.
    logging.warning('upcycle.data could not hide accelerators from TensorFlow: %s', e)
