"""python -m upcycle.infer --gin_file=... --gin.CHECKPOINT_PATH=...: decode a split to JSONL.

Like T5X's `infer.py`: restores any checkpoint `upcycle.pretrained.load` reads (this project's
orbax runs, T5X, HF), decodes every example of an unpacked task split (greedy, temperature
sampling or beam search; `upcycle.decoding.DecodeConfig`) and writes
`OUTPUT_DIR/inference/<task>-<step>-<method>-<digest>.jsonl` (`output_name`; the digest tells
apart decodes of other prompts or checkpoints that share the rest), one object per example:

  {"inputs": "...", "targets": "...", "prediction": "...", "score": -3.2,
   "input_tokens": [...], "target_tokens": [...], "prediction_tokens": [...],
   "checkpoint": {"path": "/abs/run/checkpoints/20", "format": "orbax", "step": 20}}

Texts are the task's `targets` vocabulary decoding the tokens (absent when the task has none),
but for "targets", the task's whole `targets_pretokenized` text where the target tokens are its
encoding (not truncated to the feature length); token lists stop at the first padding (0).
With `t5x_mode` ('predict', 'predict_with_aux' or 'score'; gin: T5X_MODE) the rows are T5X's
(`write_inferences_to_file` with `output_ids`), the file named `...-<method>-t5x_<mode>-...`
('...-t5x_score-...' for 'score', which decodes nothing):

  {"inputs": {"inputs_pretokenized": "...", "targets_pretokenized": "..."},
   "prediction": "...", "prediction_tokens": [...], "aux": {"scores": -3.2}}
  {"inputs": {...}, "score": -12.5}                                        ('score')

"inputs" holding every `*_pretokenized` text of the task's example, whole ("aux" only with
'predict_with_aux'; "score" the log-likelihood of the example's target tokens). A decoder-only Llama
(configs/runs/llm_infer.gin) continues prompts instead (`upcycle.data.prompts`: a JSONL file's, or
the first window of each document of a task split), named after the file or the task, one object per
prompt:

  {"prompt": "...", "prediction": "...", "score": -9.1, "prompt_tokens": [...],
   "prediction_tokens": [...],
   "checkpoint": {"path": "/abs/hf_dir", "format": "hf", "step": null}}

its texts and tokens the checkpoint's tokenizer's, the continuation up to its first EOS. The
file is written as `<name>.tmp-<pid>-<random>` and renamed when complete; one decode of an
output runs at a time (a second is refused in one line, `locks/output_lock.py`), and a killed
one's partial file is removed by the next. A file of the same name is the same decode (same
data, checkpoint, method and limits): running it again decodes again and replaces it. Gin
files bind `infer_script.infer` (`import __main__ as infer_script`); see configs/runs/infer.gin
and llm_infer.gin.

A checkpoint that carries digests (a step of a training run, an output of convert or export)
is first compared with them, reading every parameter once: changed bytes stop it in one line
naming the array. --no_verify skips that and decodes with the checkpoint as it is.
"""

import contextlib
import hashlib
import json
import logging
import os
import secrets
import sys
from typing import IO, Any, Dict, Iterator, Mapping, Optional

from etils import epath
import jax

from upcycle import fields, gin_utils, predictions, progress, startup
from upcycle.locks import output_lock

log = logging.getLogger(__name__)

TOKENIZER_FIX = ("TOKENIZER = %CHECKPOINT_PATH (runs/llm_infer.gin's default: the checkpoint's "
                 "own); a run whose tokenizer/ was replaced needs the one it was trained with "
                 'put back.')


def output_name(source: str, step: int, decoding: Any, seed: int,
                identity: Mapping[str, Any], t5x_mode: Optional[str] = None) -> str:
  """'<source>-<step>-<method>-<digest>.jsonl', the method with what changes its predictions
  or scores ('greedy', 'beam4-alpha0.6', 'sample-t0.7-top40-topp0.9-seed0'; '-rescaled' for
  T5X's scores) and T5X's rows ('-t5x_predict'), the digest the first 8 hex digits of the sha256 of
  `identity` (`decode_identity`: the prompts' content, the checkpoint, the limits). Decodes that
  differ write different files, so a later one never replaces another's; one of the same name is
  the same decode run again."""
  if decoding.method == 'beam':
    method = f'beam{decoding.num_beams}-alpha{decoding.alpha:g}'
  elif decoding.method == 'sample':
    top = f'-top{decoding.topk}' if decoding.topk else ''
    nucleus = f'-topp{decoding.topp:g}' if 0 < decoding.topp < 1 else ''
    method = f'sample-t{decoding.temperature:g}{top}{nucleus}-seed{seed}'
  else:
    method = decoding.method
  if decoding.rescale_log_probs and decoding.method != 'beam':
    method += '-rescaled'
  if t5x_mode == 'score':
    method = 't5x_score'   # nothing decoded: the decoding's settings change nothing
  elif t5x_mode:
    method += f'-t5x_{t5x_mode}'
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
  return f'{source}-{step}-{method}-{digest}.jsonl'


def checkpoint_record(checkpoint: Any) -> Dict[str, Any]:
  """What every row says of the checkpoint decoded: {'path': absolute, 'format', 'step'
  (None for a checkpoint without one, such as an HF directory)}."""
  from upcycle.checkpoints import paths  # pylint: disable=g-import-not-at-top
  return {'path': paths.absolute(checkpoint.path), 'format': checkpoint.format,
          'step': checkpoint.step}


def decode_identity(infer_data: Any, checkpoint: Any, *, max_decode_length: int,
                    max_batches: int, seed: int) -> Dict[str, Any]:
  """What tells one decode's rows from another's, JSON-ready: the data (`describe()`: a
  prompts file by its bytes' sha256), the checkpoint (`checkpoint_record`, and a training
  step's digests recorded at save: a step rewritten in place is another checkpoint; other
  formats are known by their path), the decoded length, the batches and the seed (the data
  order)."""
  from upcycle.checkpoints import digests, formats  # pylint: disable=g-import-not-at-top
  recorded = digests.read(checkpoint.path) if formats.of(checkpoint.format).run_step else None
  return {'data': infer_data.describe(), 'checkpoint': checkpoint_record(checkpoint),
          'digests': recorded, 'max_decode_length': max_decode_length,
          'max_batches': max_batches, 'seed': seed}


def infer(*, model: Any, infer_data: Any, checkpoint_path: str, output_dir: str,
          batch_size: int, decoding: Any, max_decode_length: Optional[int] = None,
          format: Optional[str] = None,  # pylint: disable=redefined-builtin
          max_batches: int = 0, num_expert_partitions: int = 1, num_model_partitions: int = 1,
          logical_axis_rules: Any = 'default', seed: int = 0, verify: bool = True,
          t5x_mode: Optional[str] = None) -> str:
  """Decodes `infer_data` with the checkpoint; returns the path of the JSONL written.

  Every process of a slice runs it (`launch/tpu_vm.py infer`): the parameters are placed on
  the mesh of all devices, each process reading only its blocks, every batch is decoded by
  all of them (`upcycle.predictions`), and process 0 writes the one file, the rows and order
  a single process writes.

  Args:
    model: the `T5` or decoder-only `Llama` the checkpoint fits (gin: %MODEL).
    infer_data: a T5's unpacked (`pack=False`) `TextPipeline` split, or a Llama's `Prompts`.
    checkpoint_path: any checkpoint `upcycle.pretrained.load` reads.
    output_dir: the JSONL goes to `output_dir/inference/<output_name>`.
    batch_size: examples decoded at once.
    decoding: an `upcycle.decoding.DecodeConfig`.
    max_decode_length: tokens to decode at most (None: the task's 'targets' feature length;
      for prompts, as many as a prompt may hold).
    format: checkpoint format (None: detected).
    max_batches: stop after this many batches (0: the whole split).
    num_expert_partitions: devices the expert axis is split over (as in training).
    num_model_partitions: devices the model axis (MLP, heads, vocabulary) is split over.
    logical_axis_rules: where each logical axis lives on the mesh, the training run's (gin:
      LOGICAL_AXIS_RULES; `partitioning.rules`: 'default', 'fsdp' or a list of pairs).
    seed: data order and sampling randomness.
    verify: first compare the parameters with the digests the checkpoint carries
      (`checkpoints/verify.py`; changed bytes stop it in one line); `--no_verify` clears it.
    t5x_mode: None (this project's rows), or T5X's rows of its infer mode 'predict',
      'predict_with_aux' or 'score' (a T5's task examples only).
  """
  # pylint: disable=g-import-not-at-top
  from upcycle import partitioning, pretrained
  from upcycle.data.prompts import Prompts
  from upcycle.models import families
  from upcycle.train import objectives
  # pylint: enable=g-import-not-at-top
  if getattr(infer_data, 'pack', False):
    raise ValueError('infer_data: decoding needs one example per row; bind '
                     "infer/text.TextPipeline.pack = False (as runs/infer.gin does).")
  decodes = families.of(model).decodes
  if decodes == 'prompts' and not isinstance(infer_data, Prompts):
    raise fields.ConfigError(f'MODEL is a decoder-only {type(model).__name__}, which continues '
                             'prompts: decode with --gin_file=runs/llm_infer.gin, not '
                             'runs/infer.gin.')
  if decodes is None:
    raise fields.ConfigError(f'MODEL is a {type(model).__name__}, which infer does not decode. '
                             'Fix: evaluate it with python -m upcycle.eval.')
  if isinstance(infer_data, Prompts) and decodes != 'prompts':
    raise fields.ConfigError(
        f'infer_data is prompts (runs/llm_infer.gin), which a decoder-only model continues, but '
        f'MODEL is a {type(model).__name__}: give a models/llama/ file, or decode a split with '
        'runs/infer.gin.')
  _check_t5x_mode(t5x_mode, infer_data)
  fields.integer_value('BATCH_SIZE (infer_script.infer.batch_size)', batch_size, 1)
  fields.directory('MODEL_DIR (infer_script.infer.output_dir)', output_dir)
  rules = partitioning.rules(logical_axis_rules,
                             'LOGICAL_AXIS_RULES (infer_script.infer.logical_axis_rules)')
  max_decode_length = max_decode_length or infer_data.feature_lengths['targets']

  def checked(ckpt: Any) -> Dict[str, Any]:
    """The tokenizer's and prompts file's checks, before any array is read; the decode's
    identity (the digests of the step read)."""
    pretrained.check_tokenizer(infer_data, model.config, ckpt.path, ckpt.format,
                               fix=TOKENIZER_FIX)
    if isinstance(infer_data, Prompts):
      infer_data.check()
    return decode_identity(infer_data, ckpt, max_decode_length=max_decode_length,
                           max_batches=max_batches, seed=seed)

  mesh = partitioning.make_mesh(num_expert_partitions, num_model_partitions)
  checkpoint, params, identity = pretrained.load_on_mesh(
      checkpoint_path, model_config=model.config, mesh=mesh, rules=rules, format=format,
      verify=verify, check=checked, sizes=partitioning.mesh_sizes(
          expert='NUM_EXPERT_PARTITIONS (infer_script.infer.num_expert_partitions)',
          model='NUM_MODEL_PARTITIONS (infer_script.infer.num_model_partitions)'))
  path = epath.Path(output_dir) / 'inference' / output_name(
      predictions.source_name(infer_data), checkpoint.step or 0, decoding, seed, identity,
      t5x_mode=t5x_mode)
  source = {} if t5x_mode else {'checkpoint': checkpoint_record(checkpoint)}
  writer = jax.process_index() == 0
  with _output(path, writer) as f, partitioning.activate(mesh, rules):
    done = progress.Progress('infer', 'examples', total=predictions.expected_examples(
        infer_data, batch_size=batch_size, max_batches=max_batches))
    if t5x_mode == 'score':
      batches = predictions.scored_records(
          objectives.of(model), params, infer_data, batch_size=batch_size,
          mesh=mesh, max_batches=max_batches, seed=seed)
    else:
      batches = predictions.batch_records(
          model, params, infer_data, decoding, max_decode_length=max_decode_length,
          batch_size=batch_size, mesh=mesh, max_batches=max_batches, seed=seed,
          t5x_mode=t5x_mode)
    for records in batches:
      if writer:
        f.writelines(json.dumps({**record, **source}) + '\n' for record in records)
      done.update(len(records))
  done.finish()
  if writer:
    what = 'scores' if t5x_mode == 'score' else f'predictions ({decoding.method})'
    step = 'no step' if checkpoint.step is None else f'step {checkpoint.step}'
    print(f'Wrote {done.done} {what} of checkpoint {checkpoint_path} ({checkpoint.format}, '
          f'{step}) to {path}', flush=True)
  return os.fspath(path)


def _check_t5x_mode(t5x_mode: Optional[str], infer_data: Any) -> None:
  """Refuses a `t5x_mode` infer does not write, and T5X's rows of prompts (T5X's are of a
  task's examples)."""
  from upcycle.data.prompts import Prompts  # pylint: disable=g-import-not-at-top
  if t5x_mode is None:
    return
  if t5x_mode not in predictions.T5X_MODES:
    raise fields.ConfigError(
        f'T5X_MODE (infer_script.infer.t5x_mode) = {t5x_mode!r}: infer writes T5X\'s rows of '
        f"its infer modes {', '.join(map(repr, predictions.T5X_MODES))}, or None for this "
        "project's rows.")
  if isinstance(infer_data, Prompts):
    raise fields.ConfigError(
        f'T5X_MODE (infer_script.infer.t5x_mode) = {t5x_mode!r}: T5X\'s rows are of a task\'s '
        'examples; continued prompts (runs/llm_infer.gin) are written in this project\'s rows: '
        'bind T5X_MODE = None.')


@contextlib.contextmanager
def _output(path: epath.Path, writer: bool) -> Iterator[Optional[IO[str]]]:
  """The JSONL being written, on the process that writes it (None on the others): `path`'s
  lock held, the partial files of killed decodes removed, a partial file of its own renamed
  to `path` when the decode completes and removed when it fails."""
  if not writer:
    yield None
    return
  with output_lock.hold(os.fspath(path), 'decode', 'wait for it to finish, or decode into '
                        'another MODEL_DIR.'):
    _remove_killed(path)
    partial = path.parent / f'{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}'
    try:
      with partial.open('w') as f:
        yield f
    except BaseException:
      partial.unlink(missing_ok=True)
      raise
    partial.replace(path)


def _remove_killed(path: epath.Path) -> None:
  """Removes the partial files of killed decodes of `path` (the caller holds its lock)."""
  for killed in path.parent.glob(f'{path.name}.tmp-*'):
    killed.unlink(missing_ok=True)
    log.info('Removed %s, left by a decode of the same output that was killed.', killed)


def main(argv) -> str:
  """Runs `infer`; errors a user can cause (a bad binding, a checkpoint that does not fit, an
  empty split, the output being written by another decode) end in one line and exit status 1
  (gin_utils.run; --verbose shows the traceback)."""
  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import CheckpointError
  from upcycle.data.iterator import EmptySplit
  from upcycle.data.prompts import PromptsError
  from upcycle.data.tokenizer import TokenizerError
  # pylint: enable=g-import-not-at-top
  argv, given = gin_utils.no_verify(argv)
  return gin_utils.run(infer, argv, __doc__, given=given, expected=(
      fields.ConfigError, CheckpointError, EmptySplit, PromptsError, TokenizerError,
      output_lock.OutputInUse))


if __name__ == '__main__':
  startup.begin()
  main(sys.argv[1:])
