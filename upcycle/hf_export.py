"""A checkpoint written as a HuggingFace model directory that transformers loads with the same
logits (`python -m upcycle.export --format=hf`):

  Llama family        -> LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases alone),
                         MistralForCausalLM (a sliding window), MixtralForCausalLM (an MoE
                         in every layer as Mixtral routes), or Qwen2MoeForCausalLM (an MoE
                         Mixtral cannot express: in some layers only, with a shared expert,
                         raw top-k weights or q/k/v biases; `checkpoints.hf_qwen2_moe`):
                         `llama_hf.hf_model_type`; the tokenizer the run keeps
                         (MODEL_DIR/tokenizer/, or an HF source's own) copied with its chat
                         template; generation_config.json; config.json's bos / eos (a list
                         stays one) / pad ids and max_position_embeddings those of the HF
                         checkpoint the tokenizer came from (`tokenizer.hf_ids`), else the
                         tokenizer's own ids
  dense T5 v1.1       -> T5ForConditionalGeneration with its own lm_head
                         (`tie_word_embeddings` false); no tokenizer (T5 runs read seqio's)

The source is a run of ours (MODEL_DIR, its checkpoints/: the step `step`, default the
latest) or any checkpoint `checkpoints.load` reads (one step of a run, T5X, HF). The model is
`model_config` (gin's MODEL on the command line), else the one the checkpoint describes (HF);
the parameters are checked against it before anything is written. Scanned layers are
unrolled (`scan_layout.unstack`, lazily). ViT, MoE T5 and an MoE Llama that neither Mixtral
nor Qwen2-MoE computes (an output bias, capacity that drops tokens) are refused in one line
before any array is read. The weights are written in `dtype` (default: the HF source's
dtype, kept beside the run's tokenizer, else the stored one), read and cast one at a time
(`hf_writer`), which also makes the output appear whole or not at all. README.md is a model
card (`hf_card`). A source that carries digests is first compared with them (`verify.check`),
and the output records the digests of the tensors it holds (`digests/process_0.json`).
"""

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from upcycle import checkpoints, hf_card, pretrained, tree
from upcycle.checkpoints import (atomic_dir, hf_llama, hf_qwen2_moe, hf_t5, hf_writer, paths,
                                 safetensors_file, t5x_export, validate, verify as verify_lib)
from upcycle.checkpoints.lazy import LazyArray
from upcycle.checkpoints.t5x_export import ExportError
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.models import LlamaConfig, T5Config, families, llama_hf, scan_layout

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = '5GB'   # transformers' `save_pretrained` default
DTYPES = ('bfloat16', 'float32')


# (config.json, {HF tensor name: leaf}, {file name: bytes}) of dense, unrolled params.
HfFiles = Tuple[Dict[str, Any], Dict[str, Any], Dict[str, bytes]]


@dataclasses.dataclass(frozen=True)
class HfExport:
  """How `python -m upcycle.export --format=hf` writes a family.

  check: config -> None; raises ExportError / fields.ConfigError, in one line, for a config
    HuggingFace has no class for (called before any array is read).
  files: (params, config, source checkpoint path) -> HfFiles.
  """
  check: Callable[[Any], None]
  files: Callable[[Mapping[str, Any], Any, str], HfFiles]


def _dtype(params: Mapping[str, Any]) -> str:
  return np.dtype(params['token_embedder']['embedding'].dtype).name


def _t5_hf_check(config: T5Config) -> None:
  if config.encoder_moe or config.decoder_moe:
    raise ExportError('an MoE T5 has no HuggingFace class (T5ForConditionalGeneration is '
                      'dense). Fix: export it with --format=t5x (Flaxformer\'s MoE names).')


def _t5_hf_files(params: Mapping[str, Any], config: T5Config, source: str) -> HfFiles:
  hf_config = hf_t5.hf_config(dataclasses.asdict(config), dtype=_dtype(params))
  return hf_config, hf_t5.to_hf(params, source), {}


def _generation_config(tokenizer: tokenizer_lib.Tokenizer, ids: Mapping[str, Any]) -> bytes:
  """generation_config.json: the source's, kept beside the run's tokenizer, else the ids
  `generate` stops on and pads with (`ids`, config.json's)."""
  kept = tokenizer.files.get('generation_config.json')
  return kept if kept is not None else json.dumps(dict(ids), indent=2).encode('utf-8')


def _weights_source(tokenizer: tokenizer_lib.Tokenizer, config: LlamaConfig) -> Dict[str, Any]:
  """The config.json of the HF checkpoint the tokenizer came from where the weights came from
  it too (its hidden_size and vocab_size the model's), else {}: a model trained from scratch
  with an HF model's tokenizer takes that model's token ids, not its context or dtype."""
  kept = tokenizer_lib.source_config(tokenizer)
  same = (kept.get('hidden_size'), kept.get('vocab_size')) == (config.d_model, config.vocab_size)
  return kept if same else {}


def _llama_hf_files(params: Mapping[str, Any], config: LlamaConfig, source: str) -> HfFiles:
  """config.json with the token ids of the HF checkpoint the run's tokenizer came from
  (`tokenizer.hf_ids`) and the context length and dtype of the one its weights came from
  (`_weights_source`), else the tokenizer's own ids and the stored dtype; the tokenizer's
  files and companions (chat template) and generation_config.json. None of them, with a
  warning, where the source keeps no tokenizer; `tokenizer.TokenizerError` where the
  tokenizer it keeps is not the one its weights were trained with (a replaced tokenizer/)."""
  try:
    tokenizer = tokenizer_lib.load(source)
  except tokenizer_lib.TokenizerError as e:
    log.warning('Exporting %s without a tokenizer (config.json gets no BOS / EOS ids): %s',
                source, e)
    tokenizer = None
  else:
    pretrained.check_trained(
        tokenizer, source, binding='The HF export',
        fix=f'put the tokenizer {source} was trained with in {tokenizer.source}.')
  ids = {} if tokenizer is None else tokenizer_lib.hf_ids(tokenizer)
  kept = {} if tokenizer is None else _weights_source(tokenizer, config)
  hf_config = llama_hf.hf_config(
      config, dtype=kept.get('dtype') or kept.get('torch_dtype') or _dtype(params),
      token_ids=ids, max_position_embeddings=kept.get('max_position_embeddings'))
  files = {}
  if tokenizer is not None:
    files = {name: data for name, data in tokenizer.files.items()
             if name != tokenizer_lib.SOURCE_CONFIG}
    files['generation_config.json'] = _generation_config(tokenizer, ids)
  if hf_config['model_type'] == 'qwen2_moe':   # its gated shared expert: hf_qwen2_moe
    return hf_config, hf_qwen2_moe.to_hf(params, source), files
  return hf_config, hf_llama.to_hf(params, source, hf_config['architectures'][0]), files


# The HuggingFace writer of each family that has one, by `families.Family.name`.
WRITERS = {'t5': HfExport(check=_t5_hf_check, files=_t5_hf_files),
           'llama': HfExport(check=llama_hf.hf_model_type, files=_llama_hf_files)}


def check_exportable(config: Any) -> None:
  """Refuses, in one line, a model HuggingFace has no class for (or this export no writer)."""
  family = families.of(config)
  if family.name not in WRITERS:
    raise ExportError(f'--format=hf writes Llama-family models (Llama, Qwen2, Mistral, '
                      f'Mixtral, Qwen2-MoE) and dense T5 v1.1; {family.module.__name__} is not '
                      f'written as HuggingFace yet. Fix: export it with --format=t5x.')
  WRITERS[family.name].check(config)


def _checkpoint_path(model_dir: str, step: Optional[int]) -> Tuple[str, str]:
  """-> (the checkpoint to read, the directory the output may not touch): a run's step
  (`step`, default the latest) and its checkpoints/, or `model_dir` itself."""
  try:
    root, steps = t5x_export.run_steps(model_dir)
  except ExportError:   # not a run of ours: any checkpoint the readers know
    if step is not None:
      raise ExportError(f'--step={step}: {model_dir} holds no run of ours (checkpoints/<step>/ '
                        f'directories) to pick a step from. Fix: pass the checkpoint itself as '
                        f'--model_dir, without --step.') from None
    path = paths.absolute(model_dir)
    return path, path
  return steps[t5x_export.pick_step(root, steps, step)], root


def _check_output(output_dir: str, source: str) -> None:
  t5x_export.check_output(output_dir, source, writer='the HuggingFace export',
                          source_name='the checkpoint')
  if atomic_dir.is_taken(output_dir):
    raise ExportError(f'{output_dir} already exists and is not empty; an export never '
                      f'overwrites. Fix: delete it, or pass another --output_dir.')


def _dense_params(ckpt: checkpoints.Checkpoint, config: Any) -> Dict[str, Any]:
  """The checkpoint's parameters checked against `config` (in the layout they are stored in,
  scanned or not) and unrolled."""
  scanned = tree.is_scanned(ckpt.params)
  stored = dataclasses.replace(config, scan_layers=scanned)
  validate.check_params(ckpt.params, families.abstract_params(stored), ckpt.path,
                        fix='Pass the gin files of the model it was trained with')
  return scan_layout.unstack(ckpt.params, config) if scanned else ckpt.params


def _cast(tensors: Dict[str, Any], dtype: str) -> Dict[str, Any]:
  """`tensors` with their floating-point ones in `dtype` ('bfloat16', 'float32', ...), lazily:
  each is read and cast as it is written."""
  target = np.dtype(ml_dtypes.bfloat16 if dtype == 'bfloat16' else dtype)

  def cast(name: str, leaf: Any) -> Any:
    if leaf.dtype == target or not jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf
    return LazyArray(leaf.shape, target, lambda: np.asarray(leaf).astype(target),
                     getattr(leaf, 'source', name), name)

  return {name: cast(name, leaf) for name, leaf in tensors.items()}


def export(model_dir: str, output_dir: str, model_config: Any = None,
           step: Optional[int] = None, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
           verify: bool = True, dtype: Optional[str] = None) -> str:
  """Writes the checkpoint in `model_dir` (module docstring) as the HuggingFace directory
  `output_dir`; returns its absolute path.

  Args:
    model_dir: a run's MODEL_DIR (or its checkpoints/), or any checkpoint the readers know.
    output_dir: a local directory that does not exist or is empty.
    model_config: the T5Config / LlamaConfig of the checkpoint (a module's `.config` works
      too); None: the one an HF checkpoint describes.
    step: a step of the run (default: its latest); only for runs.
    max_shard_size: the largest safetensors file, e.g. '5GB', '200KB' (`hf_writer.parse_size`).
    verify: first compare the parameters with the digests the checkpoint carries
      (`verify.check`); the output records the digests of the tensors it holds.
    dtype: the weights' dtype, one of `DTYPES`; None: the HF source's (as the run keeps it
      beside its tokenizer), else the stored one.

  Raises:
    ExportError: a model HuggingFace has no class for, no model config, a bad size or step,
      an output that is taken, remote or touches the source, a full disk (nothing left).
    CheckpointError: the checkpoint does not fit the model, cannot be read, or its bytes
      differ from its digests.
    fields.ConfigError: a Llama config no HF family computes (`llama_hf.hf_model_type`).
  """
  try:
    max_shard_bytes = hf_writer.parse_size(max_shard_size)
  except ValueError as e:
    raise ExportError(f'--max_shard_size: {e}') from None
  if dtype is not None and dtype not in DTYPES:
    raise ExportError(f'--dtype={dtype!r}: expected one of {list(DTYPES)}.')
  path, source = _checkpoint_path(model_dir, step)
  output_dir = paths.absolute(output_dir)
  _check_output(output_dir, source)
  ckpt = pretrained.load(path, lazy=True)
  config = getattr(model_config, 'config', model_config) or ckpt.model_config
  if config is None:
    raise ExportError(f'{ckpt.path}: this {ckpt.format} checkpoint does not say which model it '
                      f'holds. Fix: give the gin files of its model, e.g. '
                      f'--gin_file=models/llama/tiny.gin (the export reads a run\'s own '
                      f'MODEL_DIR/config.gin where it has one).')
  check_exportable(config)
  params = _dense_params(ckpt, config)
  if verify:
    verify_lib.check(dataclasses.replace(ckpt, optimizer_state=None))
  family = families.of(config)
  hf_config, tensors, files = WRITERS[family.name].files(params, config, ckpt.path)
  tokenizer = (', with its tokenizer' if files else
               ', without a tokenizer: copy the one its weights were trained with into it'
               if family.carries_tokenizer else '')
  dtype = dtype or hf_config['dtype']
  hf_config.update(dtype=dtype, torch_dtype=dtype)
  tensors = _cast(tensors, dtype)
  files = {**files, hf_card.CARD: hf_card.text(
      hf_config, config, ckpt, hf_card.run_directories(source) if source != path else (),
      name=os.path.basename(output_dir)).encode('utf-8')}
  written = t5x_export.written(
      lambda: hf_writer.write(output_dir, hf_config, tensors, files, max_shard_bytes),
      what=f'Exporting {ckpt.path} to {output_dir}',
      nbytes=lambda: sum(safetensors_file.nbytes(t) for t in tensors.values()))
  log.info('Wrote %s (%s, %d tensors%s).', written, hf_config['architectures'][0], len(tensors),
           tokenizer)
  return written
