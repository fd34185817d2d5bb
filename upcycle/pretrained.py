"""A checkpoint together with the model it fits: where `checkpoints` and `models` meet.

Checkpoint readers know names and arrays (and, for HuggingFace, a plain description of
the model); `upcycle.families` knows shapes. This module wires the two:

  ckpt = pretrained.load(path, model_config=cfg)   # checked against cfg's shapes
  params, config = pretrained.load_hf(path)        # the config HF's config.json implies
  params = pretrained.on_mesh(ckpt.params, cfg, mesh)   # placed by the model's logical axes
"""

import os
from typing import Any, Dict, Optional, Tuple

import jax

from upcycle import checkpoints, families


def load(path: str, format: Optional[str] = None,  # pylint: disable=redefined-builtin
         model_config: Any = None, lazy: bool = False,
         with_optimizer_state: bool = True) -> checkpoints.Checkpoint:
  """`checkpoints.load`, every name and shape checked against the model.

  Args:
    path: file or directory, any supported format.
    format: one of `checkpoints.FORMATS`; None detects it.
    model_config: the model config (T5Config, ViTConfig, LlamaConfig) to check against. None: the config the
      checkpoint describes (HF), or no check for formats without one.
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
  ckpt.model_config = config_for(ckpt.description)
  return ckpt


def load_hf(path: str, lazy: bool = False) -> Tuple[Dict[str, Any], Any]:
  """HuggingFace directory -> (params in this project's names, the model config it describes);
  numpy leaves, or LazyArrays with `lazy=True`."""
  ckpt = load(path, 'hf', lazy=lazy)
  return ckpt.params, ckpt.model_config


def on_mesh(params: Any, model_config: Any, mesh: jax.sharding.Mesh) -> Any:
  """A checkpoint's parameters (lazy or not) placed on `mesh` by the model's logical axes
  under the rules active (`partitioning.activate`; the default rules outside it), each
  process reading only the blocks its devices hold (`upcycling.sharded.read`)."""
  # pylint: disable=g-import-not-at-top
  from upcycle.train import partitioning
  from upcycle.upcycling import sharded
  # pylint: enable=g-import-not-at-top
  shardings = partitioning.logical_sharding(families.logical_params(model_config), mesh)
  return jax.tree.map(sharded.read, params, shardings)
