"""Registered seqio span-corruption tasks.

- T5's C4 pretraining objective, one task per name of `C4_TASKS`, with the 32k T5
  SentencePiece vocabulary (100 extra ids), for real runs: `c4_v220_span_corruption` is T5's
  and T5X's name (t5.data.tasks, TFDS `c4/en:2.2.0`, which the pinned TFDS reads but no longer
  builds), `c4_span_corruption` this project's, on `c4/en:3.1.0`, the version the pinned TFDS
  builds (the same documents, with `content-type`/`content-length` fields added; the task
  reads only `text`). Re-register one with another vocabulary path or TFDS data dir by calling
  `add_c4_span_corruption(...)` from the entry point.
- `offline_span_corruption` (default): the same objective over the Python documentation
  (`offline_text`, 'pydoc') with `seqio.ByteVocabulary(extra_ids=100)`; needs no download.
- `offline_stdlib_span_corruption`: the same over the standard library's source (`offline_text`,
  'stdlib', ~25x larger), for runs that must not repeat their data.
- `offline_packages_span_corruption`: the same over the source of the pinned numpy, scipy,
  scikit-learn and matplotlib (`offline_text`, 'packages', ~3x the stdlib's), the same text on
  every machine that installs setup.py's pins (`offline_text.corpus_record`).

The span-corruption tasks have 'train' and 'validation' splits and features `inputs`/`targets`
(int32, EOS added).

Text tasks, for decoder-only language models (`upcycle.data.lm` tokenizes them with the run's
tokenizer): `offline_packages_text`, `offline_stdlib_text` and `offline_pydoc_text`, the
offline corpora's documents under `text`, untokenized. Instruction tuning (`upcycle.data.sft`):
`offline_stdlib_sft`, the documented functions of the standard library as `prompt` /
`response` strings (`offline_text.stdlib_functions`). Registration is lazy: nothing is read until a
dataset is requested.

Tasks of your own: a module that registers them, named by T5X's `MIXTURE_OR_TASK_MODULE`, is
imported before the task is looked up (`get_task`); the entry points import it before the gin
config is locked (`gin_utils.parse_gin`), so a module that declares gin configurables imports
too. A module that registers T5's own names (`t5.data.tasks`: `c4_v220_span_corruption`)
replaces this project's registration of them.
"""

import functools
import importlib
from typing import Mapping, Optional, Union

import seqio

from upcycle import fields
from upcycle.data import offline_text
from upcycle.data import span_corruption

# T5's C4 span-corruption tasks (t5/data/tasks.py) and this project's: name -> TFDS name:version.
C4_TASKS = {
    'c4_v220_span_corruption': 'c4/en:2.2.0',
    'c4_span_corruption': 'c4/en:3.1.0',
}
C4_TASK = 'c4_span_corruption'
T5_NAMES = ('c4_v220_span_corruption',)   # registered by t5.data.tasks as well
OFFLINE_TASK = 'offline_span_corruption'
OFFLINE_STDLIB_TASK = 'offline_stdlib_span_corruption'
OFFLINE_PACKAGES_TASK = 'offline_packages_span_corruption'
OFFLINE_TEXT_TASKS = {'offline_packages_text': 'packages', 'offline_stdlib_text': 'stdlib',
                      'offline_pydoc_text': 'pydoc'}
OFFLINE_SFT_TASK = 'offline_stdlib_sft'
C4_TFDS_NAME = C4_TASKS[C4_TASK]
T5_VOCABULARY_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'
EXTRA_IDS = 100
SPLITS = ('train', 'validation')
OFFLINE_CORPORA = {}   # {task name: the offline_text corpus it reads}, as registered


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
  """Span corruption over an offline corpus (`offline_text.CORPORA`), byte-level; runs with
  no download."""
  return add_span_corruption_task(name, _offline_source(name, corpus),
                                  seqio.ByteVocabulary(extra_ids=extra_ids))


def add_offline_text_task(name: str, corpus: str) -> seqio.Task:
  """Registers (or re-registers) `name`: the documents of an offline corpus under `text`,
  untokenized (the LM pipeline tokenizes them with the run's tokenizer)."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(name, source=_offline_source(name, corpus), output_features={})


def _offline_source(name: str, corpus: str) -> seqio.DataSource:
  """The source of task `name` over the offline `corpus`, noted in OFFLINE_CORPORA."""
  OFFLINE_CORPORA[name] = corpus
  return seqio.FunctionDataSource(functools.partial(offline_text.dataset_fn, corpus=corpus),
                                  splits=offline_text.SPLITS)


def offline_corpus_record(name: str) -> Optional[dict]:
  """`offline_text.corpus_record` of the offline corpus task `name` reads; None for a task
  over another source (C4, a user's) or over a corpus not read from files ('pydoc')."""
  return offline_text.corpus_record(OFFLINE_CORPORA[name]) if name in OFFLINE_CORPORA else None


def add_offline_sft_task(name: str = OFFLINE_SFT_TASK) -> seqio.Task:
  """Registers (or re-registers) `name`: the stdlib's documented functions as instruction
  samples, `prompt` / `response` strings (`offline_text.stdlib_functions`)."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  source = seqio.FunctionDataSource(offline_text.functions_dataset_fn, splits=offline_text.SPLITS)
  return seqio.TaskRegistry.add(name, source=source, output_features={})


def import_task_module(module: Optional[str], *, binding: str) -> None:
  """Imports `module` (T5X's MIXTURE_OR_TASK_MODULE), which registers its tasks; None: none.

  A module that fails to import is a `fields.ConfigError` naming `binding` and the module.
  """
  if not module:
    return
  # T5's own names (`t5.data.tasks` registers c4_v220_span_corruption too): the module's
  # registration replaces this project's copy, which comes back if the module has none.
  ours = {name: seqio.TaskRegistry.get(name) for name in T5_NAMES
          if name in seqio.TaskRegistry.names()}
  for name in ours:
    seqio.TaskRegistry.remove(name)
  try:
    importlib.import_module(module)
  except Exception as e:  # pylint: disable=broad-except  (a user's module fails many ways)
    lines = str(e).strip().splitlines()
    cause = f'{type(e).__name__}: {lines[-1]}' if lines else type(e).__name__
    raise fields.ConfigError(
        f'{binding} = {module!r} (MIXTURE_OR_TASK_MODULE): importing it failed ({cause}). Fix: '
        'name a module on the Python path that registers your seqio tasks, or None.') from e
  finally:
    for name, task in ours.items():
      if name not in seqio.TaskRegistry.names():
        seqio.TaskRegistry.add_provider(name, task)


def get_task(name: str, *, module: Optional[str], task_binding: str,
             module_binding: str) -> Union[seqio.Task, seqio.Mixture]:
  """The seqio task or mixture `name`, after importing `module` (`import_task_module`).

  A name nothing registered is a `fields.ConfigError` naming `task_binding` and the way to
  register one.
  """
  import_task_module(module, binding=module_binding)
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError:
    known = sorted(seqio.TaskRegistry.names())[:20]
    raise fields.ConfigError(
        f'{task_binding} = {name!r} (MIXTURE_OR_TASK_NAME): not a registered seqio task or '
        f'mixture (registered: {known}). Fix: one of those, or register yours in a module and '
        f'name it: --gin.MIXTURE_OR_TASK_MODULE="\'my_tasks\'".') from None


def check_split(task: Union[seqio.Task, seqio.Mixture], split: str, *, binding: str) -> None:
  """Refuses a `split` that `task` does not have: a `fields.ConfigError` naming `binding` and
  the task's splits."""
  if split not in task.splits:
    raise fields.ConfigError(
        f'{binding} = {split!r}: the task {task.name!r} has the splits {tuple(task.splits)}. '
        f'Fix: one of those (python -m upcycle.eval: --gin.EVAL_SPLIT="\'<split>\'").')


for _name, _tfds_name in C4_TASKS.items():
  add_c4_span_corruption(_name, tfds_name=_tfds_name)
add_offline_span_corruption()
add_offline_span_corruption(OFFLINE_STDLIB_TASK, corpus='stdlib')
add_offline_span_corruption(OFFLINE_PACKAGES_TASK, corpus='packages')
for _name, _corpus in OFFLINE_TEXT_TASKS.items():
  add_offline_text_task(_name, _corpus)
add_offline_sft_task()
