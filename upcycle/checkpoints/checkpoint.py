"""`Checkpoint`: what every reader returns."""

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

# description (or None) -> nested tree of leaves with `.shape` the params must fit, or None
# when there is nothing to check them against.
ExpectedFn = Callable[[Optional[Dict[str, Any]]], Dict[str, Any]]

from upcycle.checkpoints import formats
from upcycle.checkpoints.lazy import materialize


@dataclasses.dataclass
class Checkpoint:
  """A checkpoint read into this project's parameter names.

  Attributes:
    params: nested dict in this project's parameter names. Leaves are numpy arrays, or,
      from a reader called with `lazy=True`, LazyArrays (shape/dtype known, data read
      on `np.asarray` or block by block).
    step: training step, or None when the format has none.
    optimizer_state: the source's optimizer slots in the source's structure,
      or None.
    format: the name of its format, one of `formats.FORMATS` (what each implies).
    path: the directory or file that was read.
    description: the model hyperparameters the format stores (HF config.json), as
      {'model': 't5' | 'vit', <T5Config / ViTConfig field>: value}, or for the Llama family
      config.json itself, {'model': 'llama', 'hf_config': {...}, 'config_path': ...}; else None.
    model_config: the T5Config / ViTConfig / LlamaConfig the params were checked against, set by
      `upcycle.pretrained.load` (checkpoint readers never import the models).
    notes: every change the reader made beyond renaming and reshaping (a tied
      head materialized, a position embedding resized, a head dropped), in words.
  """

  params: dict
  step: Optional[int]
  optimizer_state: Optional[Any]
  format: str
  path: str
  description: Optional[Dict[str, Any]] = None
  model_config: Optional[Any] = None
  notes: Tuple[str, ...] = ()

  @property
  def optimizer_layout(self) -> Optional[str]:
    """The layout of the optimizer state its format holds: 't5x', 'optax' or None."""
    return formats.of(self.format).optimizer_layout

  def read(self) -> 'Checkpoint':
    """This checkpoint with every lazy leaf read into a numpy array."""
    return dataclasses.replace(self, params=materialize(self.params),
                               optimizer_state=materialize(self.optimizer_state))
