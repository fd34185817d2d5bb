"""An lm-evaluation-harness `LM` over this project's decoder-only models: any checkpoint
`upcycle.pretrained.load` reads (dense or MoE, scanned or not), scored on a mesh without
exporting it (`python -m upcycle.lm_eval`).

  lm = harness.ProjectLM(Llama(config), params, tokenizer, mesh=mesh, rules=rules,
                         batch_size=8)
  lm_eval.simple_evaluate(model=lm, tasks=['hellaswag'])

Requests are answered as lm-eval's HuggingFace backend (`hf`, `HFLM`) answers them, so the
scores are those it gives on the model exported with `python -m upcycle.export --format=hf`:

  loglikelihood: context and continuation encoded together and split (lm-eval's
    `TemplateLM`; an empty context is BOS), the context cut from the left so that both fit
    in `max_length` tokens; the summed log-probability of the continuation's tokens given
    what precedes them, and whether each is the most likely one.
  loglikelihood_rolling: a document's disjoint windows of at most `max_length` tokens, the
    first after BOS (lm-eval's `get_rolling_token_windows`), their log-likelihoods summed.
  generate_until: the context cut from the left to `max_length - max_gen_toks` tokens and
    continued greedily for `max_gen_toks` tokens at most (`decoding.llama`), up to EOS; the
    text up to the first of the request's stop sequences.

Text is framed as transformers' tokenizer frames it by default (`Tokenizer.encode` with
`add_special_tokens`). Rows of a batch are padded (on the right to score, on the left to
generate) to a length rounded up to a power of two, one compiled shape per length, and the
batch to `predictions.padded_rows` rows; the mesh runs each batch as one program
(`predictions.on_mesh`) under the rules the parameters were placed with. MoE blocks route
each sequence as a group of its own, as decoding does (docs/inference.md). Needs lm-eval
(`pip install -e '.[eval]'`).
"""

import functools
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from etils import epath
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as lm_eval_models
import numpy as np

from upcycle import decoding, fields, partitioning, predictions
from upcycle.checkpoints import formats
from upcycle.models import families, llama_hf
from upcycle.models.llama import Llama

MODEL_MACRO = 'MODEL'   # the gin macro of the model, as a run's gin files bind it
DEFAULT_MAX_LENGTH = 2048   # lm-eval's hf backend's, where a model says nothing
# transformers' `max_position_embeddings` default of each family's config class: what lm-eval's
# hf backend scores at for a config.json that does not say.
HF_CONTEXT_DEFAULTS = {'llama': 2048, 'mistral': 131072, 'mixtral': 131072, 'qwen2': 32768,
                       'qwen2_moe': 32768}
# (request, context ids, continuation ids) of one loglikelihood request, as TemplateLM has it.
Request = Tuple[Any, List[int], List[int]]


class HarnessError(ValueError):
  """A request this LM does not answer (one line: which, and what to do)."""


def padded_length(length: int, limit: int) -> int:
  """`length` rounded up to a power of two (8 at least), at most `limit`: the columns of a
  batch, so that few shapes are compiled."""
  return min(max(8, 1 << (length - 1).bit_length()), max(limit, length))


def token_log_probs(model: Llama, params: Any, tokens: jax.Array, mask: jax.Array,
                    targets: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """Right-padded rows `[batch, length]` (`mask` 1 on the tokens) -> (log p(targets[i, t] |
  tokens[i, :t + 1]) `[batch, length]` float32, whether each target is the most likely token
  `[batch, length]`). The rows run as decoding's prompts do (`Llama.prefill`)."""
  logits, _ = model.apply({'params': params}, tokens, mask, tokens.shape[1],
                          method=Llama.prefill, mutable=['cache'])
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == targets


def scoring_rows(requests: Sequence[Request], max_length: int
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(tokens, mask, targets, continuation weights), each `[len(requests), columns]`: each
  request's context and continuation cut from the left to `max_length + 1` tokens, all but
  the last as the input and all but the first as the targets, on the right padding; the
  weights 1 on the targets that are continuation tokens (HFLM's `_loglikelihood_tokens`)."""
  rows = [(context + continuation)[-(max_length + 1):] for _, context, continuation in requests]
  columns = padded_length(max(len(r) - 1 for r in rows), max_length)
  tokens, mask, targets, weights = (np.zeros((len(rows), columns), np.int32) for _ in range(4))
  for i, (row, (_, _, continuation)) in enumerate(zip(rows, requests)):
    n = len(row) - 1
    tokens[i, :n], targets[i, :n], mask[i, :n] = row[:-1], row[1:], 1
    weights[i, n - len(continuation):n] = 1
  return tokens, mask, targets, weights


def _by_length(items: Sequence[Any], length: Callable[[Any], int], batch_size: int
               ) -> Iterator[List[int]]:
  """Indices of `items` in batches of `batch_size`, longest first (few padded columns)."""
  order = sorted(range(len(items)), key=lambda i: -length(items[i]))
  for start in range(0, len(order), batch_size):
    yield order[start:start + batch_size]


class ProjectLM(TemplateLM):
  """lm-eval's `LM` for a decoder-only `Llama` and its parameters (placed on `mesh`), with the
  checkpoint's tokenizer (module docstring).

  Args:
    model: the Llama (dense or MoE, scanned or not) the parameters fit.
    params: its parameters, placed on `mesh` under `rules` (`pretrained.on_mesh`).
    tokenizer: an `upcycle.data.tokenizer.Tokenizer`, the one the weights were trained with.
    mesh: the devices every batch runs on.
    rules: the logical axis rules (`partitioning.rules`) the parameters were placed with.
    batch_size: requests per batch.
    max_length: the longest row scored (context cut from the left), as HFLM's `max_length`.
    max_gen_toks: new tokens per generation at most, unless a task asks for other.
  """

  def __init__(self, model: Llama, params: Any, tokenizer: Any, *, mesh: Mesh,
               rules: partitioning.Rules, batch_size: int = 8,
               max_length: int = DEFAULT_MAX_LENGTH, max_gen_toks: int = 256):
    super().__init__()
    self.model, self.params, self.tok = model, params, tokenizer
    self.mesh, self.rules = mesh, rules
    self.batch_size, self.max_length, self.max_gen_toks = batch_size, max_length, max_gen_toks
    self._score = jax.jit(functools.partial(token_log_probs, model))
    self._decoders: Dict[int, Callable] = {}

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id

  def tok_encode(self, string: str, add_special_tokens: Any = None,
                 left_truncate_len: Any = None, **kwargs) -> List[int]:
    """`string`'s ids as HFLM encodes them: framed by default (None) or as asked, the last
    `left_truncate_len` only."""
    del kwargs
    ids = self.tok.encode(string, add_special_tokens=add_special_tokens is not False)
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def _on_mesh(self, fn: Callable, inputs: Sequence[np.ndarray], *extra: Any) -> Any:
    """`fn(params, *inputs, *extra)` on the mesh under the rules (`predictions.on_mesh`)."""
    with partitioning.activate(self.mesh, self.rules):
      return predictions.on_mesh(fn, self.params, inputs, *extra,
                                 rows=predictions.padded_rows(self.batch_size, self.mesh),
                                 mesh=self.mesh)

  def _loglikelihood_tokens(self, requests: Sequence[Request], disable_tqdm: bool = False,
                            **kwargs) -> List[Tuple[float, bool]]:
    """(summed log-probability of the continuation, whether it is the greedy one) per
    request, in order."""
    del disable_tqdm, kwargs
    results: List[Tuple[float, bool]] = [(0.0, False)] * len(requests)
    for batch in _by_length(requests, lambda r: len(r[1]) + len(r[2]), self.batch_size):
      tokens, mask, targets, weights = scoring_rows([requests[i] for i in batch],
                                                    self.max_length)
      picked, greedy = self._on_mesh(self._score, [tokens, mask, targets])
      for row, i in enumerate(batch):
        scored = weights[row] == 1
        results[i] = (float(picked[row][scored].sum()), bool(greedy[row][scored].all()))
    return results

  def loglikelihood_rolling(self, requests: Sequence[Any],
                            disable_tqdm: bool = False) -> List[float]:
    """Each document's log-likelihood: the sum over its windows (module docstring)."""
    windows, owners = [], []
    for i, request in enumerate(requests):
      for window in lm_eval_utils.get_rolling_token_windows(
          token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1):
        windows.append((None, *lm_eval_utils.make_disjoint_window(window)))
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
      totals[owner] += score
    return totals

  def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> List[str]:
    """Each request's greedy continuation (module docstring), in order; requests with the
    same generation arguments run in batches together."""
    del disable_tqdm
    groups: Dict[str, List[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
    results = [''] * len(requests)
    for indices in groups.values():
      until, max_new = self._generation_args(requests[indices[0]].args[1])
      contexts = [self.tok_encode(requests[i].args[0],
                                  left_truncate_len=self.max_length - max_new)
                  for i in indices]
      for batch in _by_length(contexts, len, self.batch_size):
        texts = self._generate([contexts[j] for j in batch], max_new)
        for j, text in zip(batch, texts):
          results[indices[j]] = lm_eval_models.postprocess_generated_text(
              generation=text, stop=until, think_end_token=None)
    return results

  def _generation_args(self, gen_kwargs: Dict[str, Any]) -> Tuple[List[str], int]:
    """(stop sequences, new tokens at most) of a task's `generation_kwargs`, as lm-eval reads
    them (`normalize_gen_kwargs`); HarnessError for sampling, which this LM does not do."""
    kwargs = lm_eval_models.normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
    if kwargs['do_sample']:
      raise HarnessError(
          f'generation_kwargs {gen_kwargs}: the task samples, and upcycle.lm_eval decodes '
          'greedily. Fix: --gen_kwargs=do_sample=False,temperature=0, or score that task with '
          "lm-eval's hf backend on the exported model.")
    max_new = kwargs['max_gen_toks']
    if not 0 < max_new < self.max_length:
      raise HarnessError(f'max_gen_toks = {max_new} (the task\'s generation_kwargs or '
                         f'--max_gen_toks): expected 1 to --max_length - 1 = '
                         f'{self.max_length - 1} (the context takes the rest).')
    return kwargs['until'], max_new

  def _decode_fn(self, max_new: int):
    """The jitted greedy decode of `max_new` tokens (`decoding.llama.make_decode_fn`), made
    once per length."""
    if max_new not in self._decoders:
      self._decoders[max_new] = decoding.llama.make_decode_fn(
          self.model, decoding.DecodeConfig(method='greedy', eos_id=self.tok.eos_id), max_new)
    return self._decoders[max_new]

  def _generate(self, contexts: Sequence[List[int]], max_new: int) -> List[str]:
    """Greedy continuations of `contexts` (left-padded), as text up to EOS."""
    columns = padded_length(max(len(c) for c in contexts), self.max_length - max_new)
    tokens = np.zeros((len(contexts), columns), np.int32)
    mask = np.zeros_like(tokens)
    for i, context in enumerate(contexts):
      tokens[i, columns - len(context):], mask[i, columns - len(context):] = context, 1
    continued, _ = self._on_mesh(self._decode_fn(max_new), [tokens, mask], None)
    return [self.tok.decode(predictions.through_eos(row, self.tok.eos_id)) for row in continued]


def scores(output: Dict[str, Any]) -> Dict[str, float]:
  """lm-eval's results (`simple_evaluate`'s {'results': {task: {'acc,none': 0.5, ...}}})
  -> {'<task>/<metric>': value}, '<task>/<metric>/<filter>' for a filter other than 'none';
  the numbers only (a stderr lm-eval could not compute is 'N/A')."""
  flat = {}
  for task, metrics in output['results'].items():
    for key, value in metrics.items():
      metric, _, kept = key.partition(',')
      if kept and isinstance(value, (int, float)) and not isinstance(value, bool):
        flat['/'.join([task, metric] + ([kept] if kept != 'none' else []))] = float(value)
  return flat


def context_length(checkpoint: Any) -> int:
  """The longest row lm-eval's hf backend scores for the checkpoint as HF has it: its
  config.json's `max_position_embeddings` (an HF directory's, or the one `upcycle.export`
  writes), else its transformers config class's default (`HF_CONTEXT_DEFAULTS`), else
  DEFAULT_MAX_LENGTH."""
  if formats.of(checkpoint.format).hf_directory:
    hf = json.loads((epath.Path(checkpoint.path) / 'config.json').read_text())
  else:
    try:
      hf = llama_hf.hf_config(checkpoint.model_config, dtype='float32', token_ids={})
    except fields.ConfigError:   # no HF family computes it: lm-eval's own default
      hf = {}
  return int(hf.get('max_position_embeddings')
             or HF_CONTEXT_DEFAULTS.get(hf.get('model_type'), DEFAULT_MAX_LENGTH))


def load_lm(checkpoint_path: str, *, model_config: Any = None,
            format: Optional[str] = None,  # pylint: disable=redefined-builtin
            tokenizer: Optional[str] = None, mesh: Mesh, rules: partitioning.Rules,
            batch_size: int = 8,
            max_length: Optional[int] = None, max_gen_toks: int = 256, verify: bool = True
            ) -> Tuple['ProjectLM', Any]:
  """(the `ProjectLM` of a checkpoint, its parameters placed on `mesh` under `rules`, and the
  checkpoint).

  Read as eval and infer read theirs (`pretrained.load_on_mesh`): a live run's latest step
  read again when retention deletes it mid-read, and with `verify` (`--no_verify` clears it)
  the arrays compared with their digests, changed bytes refused in one line (CheckpointError).
  `model_config`: the LlamaConfig (or Llama) the checkpoint holds; None: the one it describes
  (HF). `tokenizer`: None reads the checkpoint's own. HarnessError for a checkpoint that
  names no model or one that is not decoder-only; TokenizerError for a tokenizer the weights
  were not trained with or whose ids do not fit the embedding."""
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  model_config = getattr(model_config, 'config', model_config)
  if model_config is not None:
    _check_decoder_only(model_config)
  checkpoint, params, tok = pretrained.load_on_mesh(
      checkpoint_path, model_config=model_config, mesh=mesh, rules=rules, format=format,
      verify=verify, check=functools.partial(_checked_tokenizer, tokenizer=tokenizer),
      sizes=partitioning.mesh_sizes(expert='--num_expert_partitions',
                                    model='--num_model_partitions'))
  lm = ProjectLM(Llama(checkpoint.model_config), params, tok, mesh=mesh, rules=rules,
                 batch_size=batch_size, max_length=max_length or context_length(checkpoint),
                 max_gen_toks=max_gen_toks)
  return lm, checkpoint


def _checked_tokenizer(checkpoint: Any, tokenizer: Optional[str]) -> Any:
  """The tokenizer to score `checkpoint` with (`tokenizer`, None: the checkpoint's own), once
  the checkpoint is known to name a decoder-only model and the tokenizer to fit it and be the
  one its weights were trained with (the errors of `load_lm`)."""
  # pylint: disable=g-import-not-at-top
  from upcycle import pretrained
  from upcycle.data import tokenizer as tokenizer_lib
  # pylint: enable=g-import-not-at-top
  config = checkpoint.model_config
  if config is None:
    raise HarnessError(
        f'{checkpoint.path}: this {checkpoint.format} checkpoint does not say which model it '
        'holds. Fix: give the gin files of its model, e.g. --gin_file=models/llama/tiny.gin '
        "(a run's MODEL_DIR/config.gin shows its bindings).")
  _check_decoder_only(config)
  tok = tokenizer_lib.load(tokenizer or checkpoint.path)
  tokenizer_lib.check_fits(tok, config.vocab_size, binding=f'--tokenizer={tok.source}',
                           rows_binding=fields.binding(config, 'vocab_size'))
  pretrained.check_trained(tok, checkpoint.path, binding=f'--tokenizer={tok.source}',
                           format=checkpoint.format,
                           fix='leave out --tokenizer (the checkpoint\'s own), or give the '
                               'one the weights were trained with.')
  return tok


def _check_decoder_only(config: Any) -> None:
  if families.of(config).decodes != 'prompts':
    raise HarnessError(
        f'The model is a {type(config).__name__}: lm-eval scores decoder-only models (Llama, '
        'Mistral, Qwen2, Mixtral, Qwen2-MoE). Fix: give a models/llama/ gin file, or evaluate '
        'it with python -m upcycle.eval.')


@functools.lru_cache(maxsize=4)
def _indexed_tasks(include_path: Optional[str]) -> Any:
  """lm-eval's TaskManager with the YAML tasks of `include_path`: it reads every task file
  lm-eval has (seconds), so a process makes one per directory."""
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  return TaskManager(include_path=include_path)


def task_manager(tasks: str, include_path: Optional[str]) -> Tuple[List[str], Any]:
  """(the task names of the comma-separated `tasks`, lm-eval's TaskManager that knows them,
  with the YAML tasks of `include_path`); HarnessError naming those it does not know."""
  if include_path is not None and not epath.Path(include_path).is_dir():
    raise HarnessError(f'--include_path={include_path}: no such directory. Fix: a directory '
                       'of lm-eval task YAML files.')
  names = [name.strip() for name in tasks.split(',') if name.strip()]
  manager = _indexed_tasks(include_path)
  unknown = [name for name in names if not manager.match_tasks([name])]
  if unknown or not names:
    raise HarnessError(
        f'--tasks={tasks}: lm-eval knows no task {", ".join(unknown) or "(none given)"}. Fix: '
        'a name `lm-eval ls tasks` lists, or a YAML task in --include_path.')
  return names, manager


def evaluate_checkpoint(checkpoint_path: str, tasks: str, *, model_config: Any = None,
                        format: Optional[str] = None,  # pylint: disable=redefined-builtin
                        tokenizer: Optional[str] = None, include_path: Optional[str] = None,
                        num_fewshot: Optional[int] = None, limit: Optional[float] = None,
                        gen_kwargs: Optional[str] = None, batch_size: int = 8,
                        max_length: Optional[int] = None, max_gen_toks: int = 256,
                        num_expert_partitions: int = 1, num_model_partitions: int = 1,
                        logical_axis_rules: str = 'default', output_dir: Optional[str] = None,
                        log_samples: bool = False, tensorboard: bool = True,
                        verify: bool = True) -> Dict[str, Any]:
  """Scores the checkpoint on lm-eval's `tasks` (`python -m upcycle.lm_eval`, whose flags
  these are); returns and prints {'checkpoint', 'format', 'step', `scores`..., 'lm_eval':
  lm-eval's per-task results, n-shot and versions}, and with `output_dir` writes it
  (`logger.write_eval_results`) and with `log_samples` each task's samples as
  samples/<task>.jsonl there."""
  # pylint: disable=g-import-not-at-top
  import lm_eval
  from upcycle.train.logger import write_eval_results
  # pylint: enable=g-import-not-at-top
  for name, value in (('--batch_size', batch_size), ('--max_gen_toks', max_gen_toks)):
    fields.integer_value(name, value, 1)
  if max_length is not None:
    fields.integer_value('--max_length', max_length, 2)
  rules = partitioning.rules(logical_axis_rules, '--logical_axis_rules')
  names, manager = task_manager(tasks, include_path)
  mesh = partitioning.make_mesh(num_expert_partitions, num_model_partitions)
  lm, checkpoint = load_lm(checkpoint_path, model_config=model_config, format=format,
                           tokenizer=tokenizer, mesh=mesh, rules=rules, batch_size=batch_size,
                           max_length=max_length, max_gen_toks=max_gen_toks, verify=verify)
  if limit is not None and limit >= 1:
    limit = int(limit)
  output = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit,
                                   gen_kwargs=gen_kwargs, task_manager=manager,
                                   log_samples=log_samples)
  results = {'checkpoint': os.fspath(checkpoint_path), 'format': checkpoint.format,
             'step': checkpoint.step, **scores(output),
             'lm_eval': json.loads(json.dumps(
                 {key: output[key] for key in ('results', 'n-shot', 'versions')},
                 default=lm_eval_utils.handle_non_serializable))}
  print(json.dumps(results, indent=2), flush=True)
  if output_dir and jax.process_index() == 0:
    write_eval_results(output_dir, results, tensorboard=tensorboard)
    if log_samples:
      _write_samples(epath.Path(output_dir) / 'samples', output['samples'])
  return results


def _write_samples(directory: epath.Path, samples: Dict[str, List[Dict[str, Any]]]) -> None:
  """samples/<task>.jsonl: lm-eval's record of each document (its requests' arguments,
  responses, filtered responses, target and metrics), one per line."""
  directory.mkdir(parents=True, exist_ok=True)
  for task, records in samples.items():
    (directory / f'{task}.jsonl').write_text(''.join(
        json.dumps(record, default=lm_eval_utils.handle_non_serializable) + '\n'
        for record in records))
