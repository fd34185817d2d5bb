"""What the trainer's pluggable parts must provide: an objective, an optimizer, an initializer.

`objectives.Seq2Seq` / `CausalLm` / `Classification` (and `router_stage.RouterStage` around
one), `optimizers.T5XAdafactor` / `BigVisionAdafactor` / `Adafactor` / `AdamW` / `RoutersOnly` and
`restore.Restore` (one hook, its mode bound in gin: `@modes.Upcycle()`, `@modes.Continue()`,
`@modes.GrowExperts()`, `@modes.GrowDepth()`) are the implementations here; a new one
needs only these members (structural typing, nothing to inherit).
"""

from typing import (Any, Dict, Mapping, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

import flax.linen as nn
import jax
import numpy as np
import optax

from upcycle.train_state import TrainState

Array = jax.Array
Batch = Mapping[str, Array]


@runtime_checkable
class Objective(Protocol):
  """Batch -> model inputs, logits -> loss, for one model family."""

  model: nn.Module

  def init_batch(self, batch: Batch) -> Tuple[Array, ...]:
    """The positional inputs `model.init` takes, from a batch."""

  def apply(self, params: Any, batch: Batch, *, train: bool,
            rngs: Optional[Mapping[str, Array]] = None,
            mutable: Sequence[str] = ...) -> Tuple[Array, Any]:
    """-> (logits, the mutated collections: the MoE ones by default, `mutable` if given)."""

  def loss(self, logits: Array, batch: Batch) -> Dict[str, Array]:
    """-> summed 'loss' (and other summed metrics) over the batch's real examples/tokens."""

  def forward(self, params: Any, batch: Batch, *, train: bool,
              rngs: Optional[Mapping[str, Array]] = None) -> Tuple[Dict[str, Array], Any]:
    """-> (`loss` of the batch's outputs, the MoE collections): what the train and eval steps
    run (`objectives.LossOfOutputs`: `apply` then `loss`; a family may compute the loss
    without its whole outputs, `CausalLm.loss_chunks`)."""

  def loss_weight_sum(self, batch: Batch) -> Array:
    """What the summed loss is divided by (real target tokens, or images)."""

  def tokens_per_batch(self, batch: Mapping[str, np.ndarray]) -> int:
    """Tokens one batch feeds the model, for the tokens/s shown while training."""

  def train_flops(self, batch: Mapping[str, Any]) -> int:
    """Matmul FLOPs of one training step on `batch` (arrays or shapes), as the step groups
    and routes it (`upcycle.models.flops`)."""


@runtime_checkable
class Optimizer(Protocol):
  """An optax transformation and the schedule it follows (for the logged learning rate)."""

  schedule: optax.Schedule

  def build(self, param_axes: Mapping[str, Optional[Sequence[Optional[str]]]]
            ) -> optax.GradientTransformation:
    """The transformation; its state's step count drives `schedule`.

    `param_axes`: param path -> the logical axis names the model gives it
    (`partitioning.logical_axes` of the boxed abstract params; None for unnamed leaves), for
    optimizers that treat axes by name (T5XAdafactor factors by them); others ignore it.
    `built_run.build_run` calls it once it knows the params' shapes.
    """


@runtime_checkable
class Initializer(Protocol):
  """The first state of a run that has no checkpoint of its own (e.g. the upcycling hook).

  Optionally also `dataset_state() -> Optional[dict]`: data positions (as a training step
  saves them) the run reads on from (the restore hooks' `restore_dataset`).
  """

  def __call__(self, abstract_state: TrainState, optimizer: optax.GradientTransformation,
               model_config: Optional[Any] = None) -> TrainState:
    """`abstract_state`'s leaves are jax.ShapeDtypeStruct with `.sharding`; the returned
    state must be placed accordingly. `model_config`: the model's config (its layer layout)."""

  def lower(self, abstract_state: TrainState, optimizer: optax.GradientTransformation,
            model_config: Optional[Any] = None) -> jax.stages.Lowered:
    """The same, lowered on abstract inputs without reading arrays (for `upcycle.aot`)."""
