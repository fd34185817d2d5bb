"""python -m upcycle.train --gin_file=... [--gin.KEY=VALUE ...]: train a T5 or ViT, dense or MoE.

Gin files bind `train_script.train` (`import __main__ as train_script`), as in T5X; see
configs/runs/. Macros used there: MODEL_DIR, TRAIN_STEPS, BATCH_SIZE,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, INITIAL_CHECKPOINT_PATH.
"""

import os
import signal
import sys
import time
import traceback
from typing import Any, Optional

from upcycle import gin_utils, startup


def train(*, objective: Any, optimizer: Any, config: Any, train_data: Any,
          eval_data: Optional[Any] = None, initializer: Optional[Any] = None,
          decode_data: Optional[Any] = None, decoding: Optional[Any] = None) -> dict:
  """Runs `upcycle.train.trainer.Trainer` with gin-built pieces; returns its result. Process 0
  ends with where the run's checkpoints, metrics and TensorBoard files are and its offline
  corpus (`run_summary`), and warns in one line at the start when that corpus is not the pinned
  one. `decode_data` / `decoding`: what `TrainConfig.infer_eval` decodes."""
  from upcycle.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
  started = time.monotonic()
  corpus = _corpus(train_data)
  # config.gin is written once the run holds MODEL_DIR and its state is restored or built,
  # so a refused or failed start leaves the config of the run in MODEL_DIR as it was.
  trainer = Trainer(objective, optimizer, config, train_data, eval_data, initializer,
                    decode_data=decode_data, decoding=decoding)

  def on_start():
    gin_utils.write_config(config.model_dir)
    _keep_tokenizer(train_data, config.model_dir)
    if corpus:
      from upcycle.train import run_summary  # pylint: disable=g-import-not-at-top
      run_summary.write_corpus(config.model_dir, corpus)

  result = trainer.run(on_start=on_start)
  gin_utils.write_config(config.model_dir, operative=True, header=_operative_header())
  _show_summary(config, result, time.monotonic() - started, corpus)
  return result


def _operative_header() -> str:
  """The comment above operative_config.gin: for a model given by a HuggingFace directory
  (`models/hf.gin`), that its `models.LlamaConfig` parameters are not the model's."""
  from upcycle import hf_model  # pylint: disable=g-import-not-at-top
  try:
    reads_directory = 'path' in gin_utils.bound_parameters('hf_model.model_config')
  except ValueError:   # not registered: no gin file of this process reads a directory
    reads_directory = False
  return (hf_model.operative_config_note(gin_utils.macro_value(hf_model.MACRO))
          if reads_directory else '')


def _corpus(train_data: Any) -> Optional[dict]:
  """On process 0, the `offline_text.corpus_record` of the offline corpus `train_data` reads
  (None for other data, and on other processes); prints its one-line warning if it is not the
  pinned corpus, and the tokenizer's if it is the offline packages BPE but not the pinned
  file (`tokenizer.pin_warning`)."""
  # pylint: disable=g-import-not-at-top
  import jax
  from upcycle.data import offline_text, tasks
  from upcycle.data import tokenizer as tokenizer_lib
  # pylint: enable=g-import-not-at-top
  task = getattr(train_data, 'task', None)
  if jax.process_index() != 0 or not isinstance(task, str):
    return None
  record = tasks.offline_corpus_record(task)
  load_tokenizer = getattr(train_data, 'load_tokenizer', None)
  packages = record if record and record['corpus'] == 'packages' else None
  for warning in (offline_text.mismatch_warning(record),
                  load_tokenizer and tokenizer_lib.pin_warning(load_tokenizer(), packages)):
    if warning:
      print(warning, flush=True)
  return record


def _show_summary(config: Any, result: dict, seconds: float, corpus: Optional[dict]) -> None:
  """Prints `run_summary.text` for the finished run (process 0)."""
  import jax  # pylint: disable=g-import-not-at-top
  from upcycle.train import run_summary  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    step = max(result['start_step'], config.train_steps)
    print(run_summary.text(config.model_dir, step, result['checkpoint'], config.tensorboard,
                           seconds, corpus=corpus, routing=result.get('routing_health')),
          flush=True)


def _keep_tokenizer(train_data: Any, model_dir: str) -> None:
  """A decoder-only run keeps its tokenizer in MODEL_DIR/tokenizer/ (process 0), where a run
  that continues it, `infer` and `export --format=hf` find it (`upcycle.data.tokenizer`)."""
  import jax  # pylint: disable=g-import-not-at-top
  load = getattr(train_data, 'load_tokenizer', None)
  if load is not None and jax.process_index() == 0:
    from upcycle.data import tokenizer  # pylint: disable=g-import-not-at-top
    load().save(os.path.join(model_dir, tokenizer.RUN_SUBDIR))


def main(argv) -> int:
  """Runs `train`; --help exits 0, and refusals (bad flags or gin files, bad config values,
  MODEL_DIR in use or not a directory, a checkpoint that does not fit or cannot be read, a
  tokenizer that is missing or not the weights', a loss that became NaN) end with one message
  and exit status 1 instead of a traceback (gin_utils.run; --verbose shows it); so does a task
  whose data cannot be read (upcycle.data.source_errors). Any other error shows its traceback
  once. SIGTERM saves the step it arrives at and exits with status 143 (train/preemption.py)."""
  # pylint: disable=g-import-not-at-top
  from upcycle import fields
  from upcycle.checkpoints import CheckpointError
  from upcycle.data.source_errors import SourceError
  from upcycle.data.tokenizer import TokenizerError
  from upcycle.train.preemption import Stopped
  from upcycle.train.run_lock import RunDirectoryInUse
  from upcycle.train.trainer import NonFiniteLossError
  # pylint: enable=g-import-not-at-top
  try:
    gin_utils.run(train, argv, __doc__, expected=(
        fields.ConfigError, RunDirectoryInUse, CheckpointError, SourceError, TokenizerError,
        NonFiniteLossError))
  except Stopped as e:   # SIGTERM: the step is saved; the shell's status for a SIGTERM
    print(gin_utils.message(e), file=sys.stderr)
    return 128 + signal.SIGTERM
  except SystemExit as e:
    _exit_now_if_one_of_many(e)
    raise
  except BaseException:
    if _one_of_many():   # the exit below skips the interpreter's printing of the traceback
      traceback.print_exc()
    _exit_now_if_one_of_many(SystemExit(1))
    raise
  return 0


def _one_of_many() -> bool:
  """Whether this process is one of several joined by jax.distributed."""
  jax = sys.modules.get('jax')
  return bool(jax and jax.distributed.is_initialized() and jax.process_count() > 1)


def _exit_now_if_one_of_many(exit_: SystemExit) -> None:
  """Exits at once, as `exit_` would, when this is one of several joined processes: a normal
  exit would first wait (up to jax.distributed's shutdown timeout, minutes) for peers that may
  be stuck in a collective with the dead process; exiting lets the launcher (launch/local.py,
  or the pod's) stop them. --help, and errors before the processes join, just exit."""
  if exit_.code and _one_of_many():
    if isinstance(exit_.code, str):
      print(exit_.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_.code if isinstance(exit_.code, int) else 1)  # pylint: disable=protected-access


if __name__ == '__main__':
  startup.begin()
  sys.exit(main(sys.argv[1:]))
