"""UpIT's router stage as a training objective: the trainer trains the routers alone to send
each example to the expert that models it best.

UpIT (Upcycling Instruction Tuning) builds experts that differ (`sources.Merge` /
`FromCheckpoints` from intermediate checkpoints), then, before ordinary training, labels every
example with its expert (expert-specific data selection: the expert model with the lowest
loss, i.e. perplexity, takes it unless its bucket is full, then the next lowest) and trains
the routers, everything else frozen, to send every token of an example to its expert
(cross-entropy of each MoE layer's router logits against the label, averaged over real
tokens and over layers). Here that stage is a run of the trainer (`runs/upit_router_stage.gin`):
its sharded jit steps, checkpoints, resumption, metrics and evaluation; a second run
continues from its last step with the MoE loss (`runs/llm_continue.gin`, or
`runs/continue_dense.gin`, with the MoE's model files).

Expert model e is the upcycled model with expert e as every MoE layer's MLP (router and
other experts left out, everything else shared): for UpIT's experts 0..n-1 the MLPs of the
n source checkpoints, for the merged ones their merges: with `sources.Merge(pair_scope=
'model')` one pair's merge in every layer, with 'layer' (the default) each layer's own
pick, so a merged expert model may be stitched from different pairs. (The paper scores with
the source checkpoints themselves; with `base=None` the sources' attention and embeddings are
averaged here, as they are in the MoE the routers are trained for.) Labels are made in the
step from the batch: each example's mean token loss (the inner objective's loss without its
z-loss) under every expert model, then the buckets filled in batch order, each holding at
most ceil(`bucket_capacity_factor` x examples / E) examples of a (micro)batch: UpIT's rule
with the buckets per batch instead of per dataset. Train it with `optimizers.RoutersOnly`.

An example is a row: with instruction samples (`upcycle.data.sft`, `pack=False`: one sample
per row) a whole sample, scored by its mean loss on its response tokens (the rows' loss
weights), and every token of it, prompt included, routed to its expert; with packed text
(`lm.LmPipeline`) a row of windows.

The loss and metrics take the trainer's names: 'loss' and 'cross_entropy' are the router
cross-entropy, 'accuracy' the fraction of real tokens whose top router choice is their
example's expert; the MoE auxiliary losses are left out (not in UpIT's stage).
"""

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax

from upcycle import fields, tree
from upcycle.moe import MOE_COLLECTIONS, ROUTER_LOGITS, MoeConfig, router_logits
from upcycle.train.objectives import EXAMPLE_MASK, LossOfOutputs

Array = jax.Array
Batch = Mapping[str, Array]
EXPERT_LABELS = 'expert_labels'


def dense_config(config: Any) -> Any:
  """The model config with every MoE field (`MoeConfig`) None: the dense model."""
  return dataclasses.replace(config, **{
      f.name: None for f in dataclasses.fields(config)
      if isinstance(getattr(config, f.name), MoeConfig)})


def expert_params(params: Mapping[str, Any], expert: Array) -> Dict[str, Any]:
  """The dense model's params with expert `expert` (an int scalar, may be traced) as the MLP
  of every MoE layer: 'X/mlp/expert/NAME' `[E, ...]` -> 'X/mlp/NAME' (its `expert` entry);
  routers dropped; every other leaf as it is."""
  out = {}
  for path, leaf in tree.flatten(params).items():
    parts = path.split('/')
    if tree.ROUTER in parts:
      continue
    if tree.EXPERT in parts:
      parts.remove(tree.EXPERT)
      leaf = jnp.take(leaf, expert, axis=0)
    out['/'.join(parts)] = leaf
  return tree.unflatten(out)


def assign_buckets(losses: Array, real: Array, capacity: int) -> Array:
  """UpIT's data selection within a batch: `[examples, E]` losses -> `[examples]` experts.

  In order, each real example goes to its lowest-loss expert whose bucket holds fewer than
  `capacity` examples (equal losses: the lower index). Padding examples (`real` False) take
  no place; their label is their lowest-loss expert.
  """
  preference = jnp.argsort(losses, axis=1, stable=True)

  def place(filled, inputs):
    order, is_real = inputs
    free = filled[order] < capacity
    choice = order[jnp.argmax(free)]
    return filled.at[choice].add(is_real.astype(filled.dtype)), choice

  _, labels = jax.lax.scan(place, jnp.zeros(losses.shape[1], jnp.int32), (preference, real))
  return labels


def _num_experts(params: Mapping[str, Any], binding: str) -> int:
  counts = {tree.shape_of(leaf)[0] for path, leaf in tree.flatten(params).items()
            if f'/{tree.EXPERT}/' in f'/{path}'}
  if len(counts) != 1:
    found = 'no MoE layer' if not counts else f'MoE layers of {sorted(counts)} experts'
    raise fields.ConfigError(f'{binding}: the router stage labels each example with one '
                             f'expert of every MoE layer, and the model has {found}. Fix: '
                             f'train the routers of a model whose MoE layers have one E.')
  return counts.pop()


@dataclasses.dataclass(frozen=True)
class RouterStage(LossOfOutputs):
  """The router stage of UpIT (module docstring) around the run's own objective.

  Attributes:
    inner: the model family's objective (`objectives.CausalLm`, `Seq2Seq`, `Classification`):
      its model, its inputs and its per-example loss.
    bucket_capacity_factor: a bucket holds at most ceil(factor x examples / E) examples of a
      (micro)batch (1.0: equal buckets, as UpIT's; larger lets better experts take more).
  """

  inner: Any
  bucket_capacity_factor: float = 1.0

  def __post_init__(self):
    fields.number(self, 'bucket_capacity_factor', 1.0)
    config = self.inner.model.config
    if getattr(config, 'scan_layers', False):
      raise fields.ConfigError(
          f'{fields.binding(self, "inner")}: the router stage reads every MoE layer\'s '
          f'experts by name, and this model scans its layers. Fix: scan_layers = False for '
          f'the router stage (its checkpoint reads into a scanned model afterwards).')
    shared = [f.name for f in dataclasses.fields(config)
              if isinstance(getattr(config, f.name), MoeConfig)
              and getattr(config, f.name).shared_expert]
    if shared:
      raise fields.ConfigError(
          f'{fields.binding(self, "inner")}: {shared[0]}.shared_expert = True: an expert '
          f'model is one MLP per layer, and a shared expert adds a second. Fix: train the '
          f'routers of a model without a shared expert.')
    dense = dataclasses.replace(self.inner, model=self.inner.model.clone(
        config=dense_config(config)))
    object.__setattr__(self, '_dense', dense)

  @property
  def model(self):
    return self.inner.model

  def init_batch(self, batch: Batch) -> Tuple[Array, ...]:
    return self.inner.init_batch(batch)

  def tokens_per_batch(self, batch) -> int:
    return self.inner.tokens_per_batch(batch)

  def train_flops(self, batch) -> int:
    """The inner objective's count: the E scoring forwards are not in it, and the backward
    (to the routers only) costs less than a training step's, so the logged FLOPs are a
    stand-in for the stage's, not its count."""
    return self.inner.train_flops(batch)

  def loss_weight_sum(self, batch: Batch) -> Array:
    return self.inner.loss_weight_sum(batch)

  def example_losses(self, params: Any, batch: Batch) -> Array:
    """`[examples, E]`: each example's mean token loss (classification: its loss) under
    every expert model."""
    num_experts = _num_experts(params, fields.binding(self, 'inner'))

    def one_example(logits, example):
      stats = self._dense.loss(logits[None], jax.tree.map(lambda x: x[None], example))
      return (stats['loss'] - stats['z_loss']) / jnp.maximum(stats['weight_sum'], 1.0)

    def under(expert):
      logits, _ = self._dense.apply(expert_params(params, expert), batch, train=False,
                                    mutable=())
      return jax.vmap(one_example)(logits, dict(batch))

    return jax.lax.map(under, jnp.arange(num_experts)).T

  def expert_labels(self, params: Any, batch: Batch) -> Array:
    """`[examples]`: each example's expert (UpIT's data selection within the batch)."""
    losses = jax.lax.stop_gradient(self.example_losses(params, batch))
    examples, num_experts = losses.shape
    real = batch.get(EXAMPLE_MASK)
    real = jnp.ones((examples,), bool) if real is None else real.astype(bool)
    capacity = math.ceil(self.bucket_capacity_factor * examples / num_experts)
    return assign_buckets(losses, real, capacity)

  def apply(self, params: Any, batch: Batch, *, train: bool,
            rngs: Optional[Mapping[str, Array]] = None,
            mutable: Sequence[str] = MOE_COLLECTIONS) -> Tuple[Dict[str, Any], Any]:
    """-> ({'router_logits': {layer: [batch, length, E]}, 'labels': [batch]}, the MoE
    collections but the auxiliary losses). Gradients reach the routers only."""
    del mutable
    frozen = {path: leaf if f'/{tree.ROUTER}/' in f'/{path}' else jax.lax.stop_gradient(leaf)
              for path, leaf in tree.flatten(params).items()}
    _, state = self.inner.apply(tree.unflatten(frozen), batch, train=train, rngs=rngs,
                                mutable=MOE_COLLECTIONS + (ROUTER_LOGITS,))
    outputs = {'router_logits': router_logits(state),
               'labels': self.expert_labels(params, batch)}
    return outputs, {k: v for k, v in state.items() if k not in ('aux_loss', ROUTER_LOGITS)}

  def _token_mask(self, layer: str, logits: Array, batch: Batch) -> Array:
    """`[batch, length]`: the tokens layer `layer` routes that count (padding does not)."""
    if layer.startswith('encoder') and 'encoder_input_tokens' in batch:
      mask = batch['encoder_input_tokens'] > 0
    elif 'decoder_segment_ids' in batch:   # every token of the sample, its prompt's too
      mask = batch['decoder_segment_ids'] > 0
    elif hasattr(self.inner, 'target_weights'):
      mask = self.inner.target_weights(batch) > 0
    else:
      mask = jnp.ones(logits.shape[:2], bool)
    example = batch.get(EXAMPLE_MASK)
    return mask if example is None else mask & example.astype(bool)[:, None]

  def loss(self, outputs: Mapping[str, Any], batch: Batch) -> Dict[str, Array]:
    """The router cross-entropy and routing accuracy, as sums over the batch's weight (what
    the trainer divides by)."""
    labels = outputs['labels']
    losses, correct = [], []
    for layer, logits in outputs['router_logits'].items():
      mask = self._token_mask(layer, logits, batch).astype(jnp.float32)
      target = jnp.broadcast_to(labels[:, None], logits.shape[:2])
      count = jnp.maximum(jnp.sum(mask), 1.0)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, target)
      losses.append(jnp.sum(ce * mask) / count)
      correct.append(jnp.sum((jnp.argmax(logits, -1) == target) * mask) / count)
    weight = self.inner.loss_weight_sum(batch)
    return {'loss': jnp.mean(jnp.stack(losses)) * weight, 'z_loss': jnp.zeros(()),
            'correct': jnp.mean(jnp.stack(correct)) * weight, 'weight_sum': weight}
