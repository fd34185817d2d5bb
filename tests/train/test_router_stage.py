"""UpIT's router stage (`router_stage.RouterStage` + `optimizers.RoutersOnly`): the bucket rule
by hand, each example's expert against transformers' losses of the expert models, and the
trainer's step moving the routers alone towards those experts."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_files
from upcycle import convert, pretrained, tree
from upcycle.models import Llama, llama_hf
from upcycle.train import objectives, optimizers
from upcycle.train.router_stage import RouterStage, assign_buckets
from upcycle.train.step import make_train_step
from upcycle.upcycling import sources

E = 4
ASSIGNMENT = (0, 1, 0, 1)   # experts 0 and 2: branch a's MLP; 1 and 3: branch b's


def test_assign_buckets_by_hand_with_ties_full_buckets_and_padding():
  losses = jnp.array([
      [1.0, 2.0, 3.0],   # -> 0
      [0.5, 0.5, 2.0],   # tie 0/1 -> 0 (lower index); bucket 0 now full
      [0.1, 0.9, 0.2],   # 0 full -> next lowest 2
      [0.3, 0.3, 0.3],   # all tied, 0 full -> 1
      [0.0, 5.0, 4.0],   # 0 full -> 2 (4.0 < 5.0); bucket 2 now full
      [0.0, 9.0, 1.0],   # 0 and 2 full -> 1
  ])
  real = jnp.ones(6, bool)
  np.testing.assert_array_equal(assign_buckets(losses, real, capacity=2), [0, 0, 2, 1, 2, 1])
  np.testing.assert_array_equal(assign_buckets(losses, real, capacity=6), [0] * 6)
  # A padding example takes no place: with example 1 padding, example 2 still gets 0, the
  # tie of example 3 goes to 1, and 2 takes examples 4 and 5.
  padded = real.at[1].set(False)
  np.testing.assert_array_equal(assign_buckets(losses, padded, capacity=2), [0, 0, 0, 1, 2, 2])


@pytest.fixture(scope='module')
def upcycled(tmp_path_factory):
  """Two HF Llama branches, the Mixtral made from them by Branch-Train-MiX (non-expert
  parameters from branch a, routers zero), its config and params."""
  import transformers  # pylint: disable=g-import-not-at-top
  build = lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=False))
  root = tmp_path_factory.mktemp('router_stage')
  dirs = {name: str(root / name) for name in ('a', 'b')}
  models = {name: hf_files.save_perturbed(build, dirs[name], seed=seed)
            for seed, name in enumerate(dirs, 1)}
  dense = pretrained.load(dirs['a']).model_config
  config = dataclasses.replace(dense, moe=llama_hf.mixtral_moe(E, 2, 0.02))
  convert.convert([dirs['a'], dirs['b']], config, str(root / 'moe'), router='zeros',
                  experts=functools.partial(sources.FromCheckpoints, assignment=ASSIGNMENT,
                                            base=0))
  params = pretrained.load(str(root / 'moe'), model_config=config).params
  return models, config, jax.tree.map(jnp.asarray, params)


def _batch(num_examples=8, length=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 64, (num_examples, length + 1))
  weights = np.ones((num_examples, length), np.float32)
  weights[3, length // 2:] = 0   # example 3 ends early
  return {'decoder_input_tokens': jnp.asarray(tokens[:, :-1], jnp.int32),
          'decoder_target_tokens': jnp.asarray(tokens[:, 1:], jnp.int32),
          'decoder_loss_weights': jnp.asarray(weights)}


def _reference_losses(models, batch):
  """`[examples, E]`: transformers' mean token loss of each example under expert model e
  (branch a with the MLPs of the branch expert e was copied from)."""
  import torch  # pylint: disable=g-import-not-at-top
  a_with_b = type(models['a'])(models['a'].config).eval()
  state = dict(models['a'].state_dict())
  state.update({k: v for k, v in models['b'].state_dict().items() if '.mlp.' in k})
  a_with_b.load_state_dict(state)
  inputs = torch.tensor(np.asarray(batch['decoder_input_tokens']), dtype=torch.long)
  targets = torch.tensor(np.asarray(batch['decoder_target_tokens']), dtype=torch.long)
  weights = torch.tensor(np.asarray(batch['decoder_loss_weights']))
  per_model = []
  for model in (models['a'], a_with_b):
    with torch.no_grad():
      logits = model(inputs).logits.float()
    token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction='none')
    per_model.append(((token * weights).sum(1) / weights.sum(1)).numpy())
  return np.stack([per_model[source] for source in ASSIGNMENT], axis=1)


def _greedy(losses, capacity):
  """UpIT's rule: in order, the lowest-loss expert whose bucket is not full."""
  filled, labels = np.zeros(losses.shape[1], int), []
  for row in losses:
    expert = next(e for e in np.argsort(row, kind='stable') if filled[e] < capacity)
    filled[expert] += 1
    labels.append(expert)
  return np.array(labels)


@pytest.mark.slow
def test_each_example_goes_to_the_expert_model_transformers_scores_best(upcycled):
  models, config, params = upcycled
  stage = RouterStage(objectives.CausalLm(Llama(config)))
  batch = _batch()
  want_losses = _reference_losses(models, batch)
  assert np.min(np.abs(want_losses[:, 0] - want_losses[:, 1])) > 1e-4   # no near-ties
  losses = jax.jit(stage.example_losses)(params, batch)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  labels = jax.jit(stage.expert_labels)(params, batch)
  want = _greedy(want_losses, capacity=math.ceil(8 / E))
  np.testing.assert_array_equal(labels, want)
  assert sorted(np.bincount(want, minlength=E)) == [2, 2, 2, 2]   # buckets filled, twins used


@pytest.mark.slow
def test_the_train_step_moves_the_routers_alone_towards_the_experts(upcycled):
  _, config, params = upcycled
  stage = RouterStage(objectives.CausalLm(Llama(config)))
  optimizer = optimizers.RoutersOnly(optimizers.AdamW(optimizers.constant_schedule(0.05),
                                                      weight_decay=0.0))
  transform = optimizer.build(None)
  step = jax.jit(make_train_step(stage, transform, optimizer.schedule))
  from upcycle.train_state import TrainState  # pylint: disable=g-import-not-at-top
  state = TrainState(jnp.zeros((), jnp.int32), params, transform.init(params))
  batch, rng = _batch(length=4, seed=1), jax.random.PRNGKey(0)
  history = []
  for _ in range(40):
    state, metrics = step(state, batch, rng)
    history.append((float(metrics['loss']), float(metrics['accuracy'])))
  # Zero routers: uniform probabilities, the cross-entropy log E exactly, no auxiliary loss.
  assert history[0][0] == pytest.approx(math.log(E), abs=1e-6)
  assert float(metrics['moe/total']) == 0.0
  assert history[-1][0] < 0.5 * math.log(E) and history[-1][1] > 0.9, history[-1]
  before, after = tree.flatten(params), tree.flatten(state.params)
  for path, leaf in before.items():
    if '/router/' in path:
      assert not np.array_equal(after[path], leaf), path
    else:
      np.testing.assert_array_equal(after[path], leaf, err_msg=path)
