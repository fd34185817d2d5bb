"""Input pipelines on TensorFlow / seqio.

Importing this package imports no TensorFlow: `iterator` (deterministic, resumable numpy
batches) is what the trainer needs, and TensorFlow is loaded by the modules that build
pipelines: `span_corruption` + `chunking` (T5 pretraining objective), `offline_text` (a corpus
that ships with Python), `tasks` (registered seqio tasks), `text` and `images` (batched
pipelines). Building a pipeline first hides accelerators from TensorFlow (`host_only`).
"""
