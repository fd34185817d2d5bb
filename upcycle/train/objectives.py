"""What a model is trained on: batch -> model inputs, logits -> loss. One per model family.

`of(model)` is the objective its family names (`families.Family.objective`, a key of
`OBJECTIVES`), with its defaults.
"""

import dataclasses
from typing import Any, Dict, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from upcycle import fields
from upcycle.models import T5, ViT, families, flops
from upcycle.models.llama import Llama
from upcycle.moe import MOE_COLLECTIONS
from upcycle.train import losses

EXAMPLE_MASK = 'example_mask'   # [batch]: 1 for a real example, 0 for padding (evaluation)

Array = jax.Array
Batch = Mapping[str, Array]

T5_INPUTS = ('encoder_input_tokens', 'decoder_input_tokens', 'decoder_target_tokens',
             'encoder_segment_ids', 'decoder_segment_ids')


class LossOfOutputs:
  """`forward` as the model's outputs (`apply`) and their loss (`loss`)."""

  def forward(self, params: Any, batch: Batch, *, train: bool,
              rngs: Mapping[str, Array] = None) -> Tuple[Dict[str, Array], Any]:
    """-> (`loss`'s summed statistics of the batch, the MoE collections)."""
    outputs, state = self.apply(params, batch, train=train, rngs=rngs)
    return self.loss(outputs, batch), state


class TargetTokenLoss(LossOfOutputs):
  """Cross-entropy over `decoder_target_tokens`, summed over the target tokens that count and
  normalized by their number (T5X's seq2seq and decoder-only losses); a subclass says which
  count when the batch has no `decoder_loss_weights` (`_unweighted_tokens`)."""

  def loss(self, logits: Array, batch: Batch) -> Dict[str, Array]:
    return losses.cross_entropy(logits, batch['decoder_target_tokens'], self.target_weights(batch),
                                self.z_loss, self.label_smoothing)

  def loss_weight_sum(self, batch: Batch) -> Array:
    """Real target tokens: what the summed loss is divided by."""
    return jnp.sum(self.target_weights(batch).astype(jnp.float32))

  def target_weights(self, batch: Batch) -> Array:
    """`[batch, length]`: the target tokens that count (padding examples' none)."""
    weights = batch.get('decoder_loss_weights')
    weights = self._unweighted_tokens(batch) if weights is None else weights
    mask = batch.get(EXAMPLE_MASK)
    return weights if mask is None else weights * mask[:, None].astype(weights.dtype)


@dataclasses.dataclass(frozen=True)
class Seq2Seq(TargetTokenLoss):
  """T5 span corruption / any seq2seq task; loss normalized by real target tokens."""

  model: T5
  z_loss: float = 1e-4
  label_smoothing: float = 0.0

  def apply(self, params: Any, batch: Batch, *, train: bool,
            rngs: Mapping[str, Array] = None,
            mutable: Sequence[str] = MOE_COLLECTIONS) -> Tuple[Array, Any]:
    """-> logits `[batch, target_len, vocab]` and the MoE collections (`mutable`)."""
    kwargs = {k: batch[k] for k in T5_INPUTS[2:] if k in batch}
    return self.model.apply({'params': params}, batch['encoder_input_tokens'],
                            batch['decoder_input_tokens'], enable_dropout=train, rngs=rngs,
                            mutable=mutable, **kwargs)

  @staticmethod
  def _unweighted_tokens(batch: Batch) -> Array:
    """Without `decoder_loss_weights`: every non-padding target (T5 pads with 0)."""
    return batch['decoder_target_tokens'] > 0

  def init_batch(self, batch: Batch) -> Tuple[Array, ...]:
    return (batch['encoder_input_tokens'], batch['decoder_input_tokens'])

  def tokens_per_batch(self, batch: Mapping[str, np.ndarray]) -> int:
    return int(np.size(batch['encoder_input_tokens']) + np.size(batch['decoder_input_tokens']))

  def train_flops(self, batch: Mapping[str, Any]) -> int:
    batch_size, inputs = np.shape(batch['encoder_input_tokens'])
    return flops.train_flops(self.model.config.forward_flops(
        batch_size, inputs, np.shape(batch['decoder_input_tokens'])[1]))


LM_INPUTS = ('decoder_input_tokens', 'decoder_segment_ids', 'decoder_positions')


@dataclasses.dataclass(frozen=True)
class CausalLm(TargetTokenLoss):
  """Decoder-only language modelling on packed rows (`upcycle.data.lm`); loss normalized by
  the real target tokens (T5X's `DecoderOnly`)."""

  model: Llama
  z_loss: float = 0.0
  label_smoothing: float = 0.0
  loss_chunks: int = 1
  unroll_loss_chunks: bool = False   # the counting copies' (`fit/step_count.py`)

  def __post_init__(self):
    fields.integer(self, 'loss_chunks', 1)

  def forward(self, params: Any, batch: Batch, *, train: bool,
              rngs: Mapping[str, Array] = None) -> Tuple[Dict[str, Array], Any]:
    """-> (the summed loss statistics, the MoE collections); with `loss_chunks` > 1 the
    logits are made a slice of the sequence at a time (`losses.chunked_cross_entropy`), never
    the whole `[batch, length, vocab]` in float32."""
    if self.loss_chunks == 1:
      return super().forward(params, batch, train=train, rngs=rngs)
    kwargs = {k: batch[k] for k in LM_INPUTS[1:] if k in batch}
    features, state = self.model.apply(
        {'params': params}, batch['decoder_input_tokens'], enable_dropout=train, rngs=rngs,
        mutable=MOE_COLLECTIONS, method=Llama.features, **kwargs)
    project = lambda head, x: self.model.apply({'params': head}, x, method=Llama.project)
    targets = batch['decoder_target_tokens']
    fields.divisor_value(fields.binding(self, 'loss_chunks'), self.loss_chunks,
                         total=targets.shape[1], of='the sequence length')
    return losses.chunked_cross_entropy(
        features, project, self.model.output_params(params), targets,
        self.target_weights(batch), num_chunks=self.loss_chunks,
        z_loss=self.z_loss, label_smoothing=self.label_smoothing,
        unroll=self.unroll_loss_chunks), state

  def apply(self, params: Any, batch: Batch, *, train: bool,
            rngs: Mapping[str, Array] = None,
            mutable: Sequence[str] = MOE_COLLECTIONS) -> Tuple[Array, Any]:
    """-> logits `[batch, length, vocab]` and the MoE collections (`mutable`)."""
    kwargs = {k: batch[k] for k in LM_INPUTS[1:] if k in batch}
    return self.model.apply({'params': params}, batch['decoder_input_tokens'],
                            enable_dropout=train, rngs=rngs, mutable=mutable, **kwargs)

  @staticmethod
  def _unweighted_tokens(batch: Batch) -> Array:
    """Without `decoder_loss_weights`: the real tokens by segment id (every token id, 0
    included, is a real token), else all."""
    if 'decoder_segment_ids' in batch:
      return batch['decoder_segment_ids'] > 0
    return jnp.ones_like(batch['decoder_target_tokens'])

  def init_batch(self, batch: Batch) -> Tuple[Array, ...]:
    return (batch['decoder_input_tokens'],)

  def tokens_per_batch(self, batch: Mapping[str, np.ndarray]) -> int:
    return int(np.size(batch['decoder_input_tokens']))

  def train_flops(self, batch: Mapping[str, Any]) -> int:
    return flops.train_flops(self.model.config.forward_flops(
        *np.shape(batch['decoder_input_tokens'])))


@dataclasses.dataclass(frozen=True)
class Classification(LossOfOutputs):
  """ViT image classification; loss averaged over images."""

  model: ViT
  label_smoothing: float = 0.0

  def apply(self, params: Any, batch: Batch, *, train: bool,
            rngs: Mapping[str, Array] = None,
            mutable: Sequence[str] = MOE_COLLECTIONS) -> Tuple[Array, Any]:
    """-> logits `[batch, classes]` and the MoE collections (`mutable`)."""
    return self.model.apply({'params': params}, batch['image'], train=train, rngs=rngs,
                            mutable=mutable)

  def features(self, params: Any, batch: Batch) -> Array:
    """Pre-logit features `[batch, width]` for linear probes."""
    return self.model.apply({'params': params}, batch['image'], method=ViT.features)

  def loss(self, logits: Array, batch: Batch) -> Dict[str, Array]:
    return losses.cross_entropy(logits, batch['label'], batch.get(EXAMPLE_MASK), 0.0,
                                self.label_smoothing)

  def loss_weight_sum(self, batch: Batch) -> Array:
    """Images that count (padding examples do not)."""
    mask = batch.get(EXAMPLE_MASK)
    return (jnp.asarray(batch['label'].shape[0], jnp.float32) if mask is None
            else jnp.sum(mask.astype(jnp.float32)))

  def init_batch(self, batch: Batch) -> Tuple[Array, ...]:
    return (batch['image'],)

  def tokens_per_batch(self, batch: Mapping[str, np.ndarray]) -> int:
    cfg = self.model.config
    return int(batch['image'].shape[0] * np.prod(cfg.grid))

  def train_flops(self, batch: Mapping[str, Any]) -> int:
    return flops.train_flops(self.model.config.forward_flops(np.shape(batch['image'])[0]))


# The objectives by the name a family gives (`families.Family.objective`).
OBJECTIVES = {cls.__name__: cls for cls in (Seq2Seq, CausalLm, Classification)}


def of(model: Any) -> LossOfOutputs:
  """The objective of `model`'s family, with its defaults, over `model`."""
  return OBJECTIVES[families.of(model).objective](model)


def init_params(objective, rng: Array, batch: Batch) -> Any:
  """Boxed (logically partitioned) params of the objective's model."""
  return objective.model.init(rng, *objective.init_batch(batch))['params']


