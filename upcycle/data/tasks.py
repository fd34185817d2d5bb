"""Registered seqio span-corruption tasks.

- `c4_span_corruption`: T5's pretraining task, TFDS `c4/en:3.1.0` with the 32k T5 SentencePiece
  vocabulary (100 extra ids), for real runs. T5 named `c4/en:3.0.1`; the pinned TFDS builds only
  3.1.0 (the same documents, with `content-type`/`content-length` fields added), and the task
  reads only `text`. Re-register with another vocabulary path or TFDS data
  dir by calling `add_c4_span_corruption(...)` from the entry point.
- `offline_span_corruption` (default): the same objective over the Python documentation
  (`offline_text`, 'pydoc') with `seqio.ByteVocabulary(extra_ids=100)`; needs no download.
- `offline_stdlib_span_corruption`: the same over the standard library's source (`offline_text`,
  'stdlib', ~25x larger), for runs that must not repeat their data.

Both have 'train' and 'validation' splits and features `inputs`/`targets` (int32, EOS added).

Text tasks, for decoder-only language models (`upcycle.data.lm` tokenizes them with the run's
tokenizer): `offline_stdlib_text` and `offline_pydoc_text`, the two offline corpora's
documents under `text`, untokenized. Registration is lazy: nothing is read until a dataset is
requested.
"""

import functools
from typing import Mapping, Optional

import seqio

from upcycle.data import offline_text
from upcycle.data import span_corruption

C4_TASK = 'c4_span_corruption'
OFFLINE_TASK = 'offline_span_corruption'
OFFLINE_STDLIB_TASK = 'offline_stdlib_span_corruption'
OFFLINE_TEXT_TASKS = {'offline_stdlib_text': 'stdlib', 'offline_pydoc_text': 'pydoc'}
C4_TFDS_NAME = 'c4/en:3.1.0'
T5_VOCABULARY_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'
EXTRA_IDS = 100
SPLITS = ('train', 'validation')


def output_features(vocabulary: seqio.Vocabulary) -> Mapping[str, seqio.Feature]:
  """T5's DEFAULT_OUTPUT_FEATURES: `inputs` (optional) and `targets`, both ending in EOS."""
  return {
      'inputs': seqio.Feature(vocabulary=vocabulary, add_eos=True, required=False),
      'targets': seqio.Feature(vocabulary=vocabulary, add_eos=True),
  }


def add_span_corruption_task(
    name: str,
    source: seqio.DataSource,
    vocabulary: seqio.Vocabulary,
    *,
    text_key: str = 'text',
    noise_density: float = span_corruption.NOISE_DENSITY,
    mean_noise_span_length: float = span_corruption.MEAN_NOISE_SPAN_LENGTH,
    shuffle_buffer_size: int = 1000,
) -> seqio.Task:
  """Registers (or re-registers) `name`: documents under `text_key` -> span corruption.

  Preprocessors as T5's `c4_v220_span_corruption`: rekey, tokenize, cache point,
  span corruption, append EOS.
  """
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name,
      source=source,
      preprocessors=[
          functools.partial(seqio.preprocessors.rekey, key_map={'targets': text_key}),
          seqio.preprocessors.tokenize,
          seqio.CacheDatasetPlaceholder(),
          functools.partial(
              span_corruption.span_corruption,
              noise_density=noise_density,
              mean_noise_span_length=mean_noise_span_length),
          seqio.preprocessors.append_eos_after_trim,
      ],
      output_features=output_features(vocabulary),
      metric_fns=[],
      shuffle_buffer_size=shuffle_buffer_size,
  )


def add_c4_span_corruption(
    name: str = C4_TASK,
    vocabulary_path: str = T5_VOCABULARY_PATH,
    extra_ids: int = EXTRA_IDS,
    tfds_name: str = C4_TFDS_NAME,
    tfds_data_dir: Optional[str] = None,
) -> seqio.Task:
  """T5 pretraining on C4 (needs the prepared TFDS dataset and the vocabulary file)."""
  vocabulary = seqio.SentencePieceVocabulary(vocabulary_path, extra_ids=extra_ids)
  source = seqio.TfdsDataSource(tfds_name, tfds_data_dir=tfds_data_dir, splits=SPLITS)
  return add_span_corruption_task(name, source, vocabulary)


def add_offline_span_corruption(
    name: str = OFFLINE_TASK, extra_ids: int = EXTRA_IDS, corpus: str = 'pydoc'
) -> seqio.Task:
  """Span corruption over a corpus that ships with Python (`offline_text.CORPORA`),
  byte-level; runs with no download."""
  source = seqio.FunctionDataSource(functools.partial(offline_text.dataset_fn, corpus=corpus),
                                    splits=offline_text.SPLITS)
  return add_span_corruption_task(name, source, seqio.ByteVocabulary(extra_ids=extra_ids))


def add_offline_text_task(name: str, corpus: str) -> seqio.Task:
  """Registers (or re-registers) `name`: the documents of an offline corpus under `text`,
  untokenized (the LM pipeline tokenizes them with the run's tokenizer)."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  source = seqio.FunctionDataSource(functools.partial(offline_text.dataset_fn, corpus=corpus),
                                    splits=offline_text.SPLITS)
  return seqio.TaskRegistry.add(name, source=source, output_features={})


add_c4_span_corruption()
add_offline_span_corruption()
add_offline_span_corruption(OFFLINE_STDLIB_TASK, corpus='stdlib')
for _name, _corpus in OFFLINE_TEXT_TASKS.items():
  add_offline_text_task(_name, _corpus)
