"""A checkpoint together with the model it fits: where `checkpoints` and `models` meet.

Checkpoint readers know names and arrays (and, for HuggingFace, a plain description of
the model); `upcycle.models.families` knows shapes. This module wires the two:

  ckpt = pretrained.load(path, model_config=cfg)   # checked against cfg's shapes
  params, config = pretrained.load_hf(path)        # the config HF's config.json implies
  params = pretrained.on_mesh(ckpt.params, model_config=cfg, mesh=mesh, rules=rules)
  ckpt, params, _ = pretrained.load_on_mesh(path, model_config=cfg, mesh=mesh, rules=rules)
  pretrained.check_tokenizer(data, cfg, ckpt.path, ckpt.format, fix=...)   # the weights' ids
"""

import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax

from upcycle import checkpoints, fields, partitioning
from upcycle.checkpoints import formats
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.models import families
from upcycle.upcycling import sharded


def load(path: str, format: Optional[str] = None,  # pylint: disable=redefined-builtin
         model_config: Any = None, lazy: bool = False,
         with_optimizer_state: bool = True) -> checkpoints.Checkpoint:
  """`checkpoints.load`, every name and shape checked against the model.

  Args:
    path: file or directory, any supported format.
    format: one of `checkpoints.FORMATS`; None detects it.
    model_config: the model config (T5Config, ViTConfig, LlamaConfig) to check against. None: the
      config the checkpoint describes (HF), or no check for formats without one.
    lazy: LazyArray leaves, read on demand (see `checkpoints.load`); default numpy arrays.
    with_optimizer_state: False: the optimizer state is neither opened nor read (None).

  Returns:
    The Checkpoint, `model_config` set to the config it was checked against (or None).
  """

  def config_for(description: Optional[Dict[str, Any]]):
    if model_config is not None:
      return model_config
    return None if description is None else families.config_from_description(description)

  def expected(description):
    config = config_for(description)
    return None if config is None else families.abstract_params(config)

  ckpt = checkpoints.load(os.fspath(path), format, expected, lazy, with_optimizer_state)
  check_config(ckpt, model_config)
  ckpt.model_config = config_for(ckpt.description)
  return ckpt


def check_config(ckpt: checkpoints.Checkpoint, model_config: Any) -> None:
  """Refuses a model config that disagrees with the config the checkpoint describes (an HF
  config.json) on what changes the function but not the shapes (the config class's
  `FUNCTION_FIELDS`: rope theta and scaling, epsilon, tied embeddings, biases, sliding
  window, ...), which a shape check cannot see: one line naming the binding, both values and
  the file. Nothing to compare: a checkpoint without a description (ours, T5X's), another
  family (refused elsewhere), or no model config."""
  if model_config is None or ckpt.description is None:
    return
  described = families.config_from_description(ckpt.description)
  if type(described) is not type(model_config):
    return
  source = ckpt.description.get('config_path', ckpt.path)
  for name in getattr(model_config, 'FUNCTION_FIELDS', ()):
    ours, theirs = getattr(model_config, name), getattr(described, name)
    if ours != theirs:
      raise fields.ConfigError(
          f'{fields.binding(model_config, name)} = {ours!r}, but the checkpoint\'s {source} '
          f'says {theirs!r}: the model would compute another function of the same weights. '
          f'Fix: bind it as the checkpoint has it ({theirs!r}), or use the model file made for '
          f'that checkpoint.')


def load_hf(path: str, lazy: bool = False) -> Tuple[Dict[str, Any], Any]:
  """HuggingFace directory -> (params in this project's names, the model config it describes);
  numpy leaves, or LazyArrays with `lazy=True`."""
  ckpt = load(path, 'hf', lazy=lazy)
  return ckpt.params, ckpt.model_config


MESH_SIZES = partitioning.mesh_sizes(expert='num_expert_partitions',
                                     model='num_model_partitions')


def on_mesh(params: Any, *, model_config: Any, mesh: jax.sharding.Mesh, rules: Any,
            sizes: Mapping[str, str] = MESH_SIZES) -> Any:
  """A checkpoint's parameters (lazy or not) placed on `mesh` by the model's logical axes
  under `rules` (`partitioning.rules`: the training run's, e.g. 'fsdp' splits every d_model
  axis over 'data' x 'expert'), each process reading only the blocks its devices hold
  (`upcycling.sharded.read`). A dimension its mesh axes do not divide is refused in one line
  naming the setting of `sizes` (mesh axis -> the flag or binding that sets its size) to
  change (`partitioning.check_divisible`)."""
  logical = families.logical_params(model_config)
  partitioning.check_divisible(logical, mesh, sizes, rules)
  return jax.tree.map(sharded.read, params, partitioning.logical_sharding(logical, mesh, rules))


def load_on_mesh(path: str, *, model_config: Any, mesh: jax.sharding.Mesh, rules: Any,
                 format: Optional[str] = None,  # pylint: disable=redefined-builtin
                 verify: bool = True,
                 check: Callable[[checkpoints.Checkpoint], Any] = lambda ckpt: None,
                 sizes: Mapping[str, str] = MESH_SIZES
                 ) -> Tuple[checkpoints.Checkpoint, Any, Any]:
  """The whole read of a checkpoint that eval and infer run with: opened lazily without its
  optimizer state and checked against `model_config` (`load`), `check(checkpoint)` (the
  caller's own checks, e.g. its tokenizer's), its arrays compared with their digests
  (`verify`: `verify.check`) and its parameters placed on `mesh` under `rules` (`on_mesh`,
  which names `sizes`' settings when the mesh does not divide a parameter) by
  the checkpoint's `model_config`: `model_config`, or where that is None the config the
  checkpoint describes (HF; `check` refuses a checkpoint that describes none, as lm_eval's
  does).

  A MODEL_DIR of a running trainer is read at its latest step, all of it through
  `orbax.read_live`: when retention deletes that step at any point of the read (opening,
  digests, placing), everything is read again at the new latest step, and the console says
  which step was read; a step that stays but is damaged is refused with its own diagnosis.

  Returns:
    (the Checkpoint, its parameters on `mesh`, what `check` returned).
  """
  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import orbax
  from upcycle.checkpoints import verify as verify_lib
  # pylint: enable=g-import-not-at-top
  path = os.fspath(path)
  format = format or checkpoints.detect_format(path)

  def read(source: str) -> Tuple[checkpoints.Checkpoint, Any, Any]:
    ckpt = load(source, format, model_config=model_config, lazy=True,
                with_optimizer_state=False)
    checked = check(ckpt)
    if verify:
      verify_lib.check(ckpt)
    return ckpt, on_mesh(ckpt.params, model_config=ckpt.model_config, mesh=mesh,
                         rules=rules, sizes=sizes), checked

  return orbax.read_live(path, read) if formats.of(format, path).run_step else read(path)


def data_tokenizer(data: Any, model_config: Any
                   ) -> Optional[Tuple[tokenizer_lib.Tokenizer, str]]:
  """(the tokenizer `data` reads, 'TOKENIZER (<its binding>)') for data that tokenizes text
  itself (`load_tokenizer`: `lm.LmPipeline`, `prompts.Prompts`), else None; TokenizerError
  (one line) where its ids exceed the rows of the model's embedding (`vocab_size`)."""
  if not hasattr(data, 'load_tokenizer'):
    return None
  tok, binding = data.load_tokenizer(), f'TOKENIZER ({fields.binding(data, "tokenizer")})'
  tokenizer_lib.check_fits(tok, model_config.vocab_size, binding=binding,
                           rows_binding=fields.binding(model_config, 'vocab_size'))
  return tok, binding


def trained_with(path: str, format: Optional[str] = None  # pylint: disable=redefined-builtin
                 ) -> Optional[Tuple[str, str]]:
  """(digest, where it was found) of the tokenizer the weights of checkpoint `path` were
  trained with (`tokenizer.DIGEST_CHARS` long): a step of a run of ours (or its MODEL_DIR: the
  latest step) by the digest its data position records, else by the run's `tokenizer/`; an
  HF directory by its own tokenizer files. None where that is not known (no record, no files,
  other formats). `format`: `upcycle.checkpoints.FORMATS`' name, None detects it."""
  from upcycle.checkpoints import orbax  # pylint: disable=g-import-not-at-top
  format = format or checkpoints.detect_format(path)
  if formats.of(format, path).run_step:
    step_dir = orbax.latest(path)
    try:
      digest = tokenizer_lib.recorded_digest(orbax.dataset_state(step_dir))
    except Exception:  # pylint: disable=broad-except  (a damaged step: resuming sets it aside)
      digest = None
    if digest is not None:
      return digest, f'the data position saved in {os.path.join(step_dir, orbax.DATASET)}'
    found = tokenizer_lib.files_digest(step_dir)
  elif formats.of(format).hf_directory:
    found = tokenizer_lib.files_digest(path, run=False)
  else:
    return None
  return None if found is None else (found[0], f'the tokenizer files in {found[1]}')


def check_trained(tokenizer: tokenizer_lib.Tokenizer, path: str, *, binding: str, fix: str,
                  format: Optional[str] = None) -> None:  # pylint: disable=redefined-builtin
  """TokenizerError (one line naming `binding`, ending in `fix`) unless `tokenizer` is the one
  checkpoint `path`'s weights were trained with, where that is known (`trained_with`)."""
  found = trained_with(path, format)
  if found is None or found[0] == tokenizer.short_digest:
    return
  raise tokenizer_lib.TokenizerError(
      f'{binding} reads {tokenizer.source} (tokenizer digest {tokenizer.short_digest}), but the '
      f'weights of {path} were trained with tokenizer {found[0]} ({found[1]}): they would '
      f'read another tokenizer\'s ids. Fix: {fix}')


def check_tokenizer(data: Any, model_config: Any, path: str,
                    format: Optional[str],  # pylint: disable=redefined-builtin
                    fix: str) -> None:
  """`data_tokenizer`'s checks, and TokenizerError (one line ending in `fix`) where the
  tokenizer is not the one the weights of checkpoint `path` were trained with."""
  found = data_tokenizer(data, model_config)
  if found is not None:
    check_trained(found[0], path, binding=found[1], format=format, fix=fix)
