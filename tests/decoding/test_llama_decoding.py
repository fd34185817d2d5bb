"""Decoding a decoder-only Llama read from a HuggingFace checkpoint: greedy and beam search
give `LlamaForCausalLM.generate`'s tokens on left-padded prompts of different lengths, sampling
draws from the distribution HF's warpers define, and the cache gives the uncached logits.

The checkpoint: 4 query heads over 2 key/value heads, head_dim 14 (not 40 / 4), untied, its
weights perturbed, saved with `save_pretrained` and read with `pretrained.load_hf`. HF pads
after EOS with `pad_token_id` 0, as our loops do. EOS is the token the second prompt's greedy
continuation reaches at its 4th step, so that one row ends early and the others decode on.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_files
from upcycle import pretrained, upcycling
from upcycle.decoding import DecodeConfig, sampling_logits
from upcycle.decoding import llama as llama_decoding
from upcycle.models.families import abstract_params
from upcycle.models import Llama, scan_layout
from upcycle.moe import MoeConfig, grouping, routers
from upcycle.predictions import through_eos

MAX_NEW = 8
LENGTHS = (7, 4, 1, 6)   # real tokens per prompt; left-padded to the longest
PAD = 0


@pytest.fixture(scope='module')
def hf_llama(tmp_path_factory):
  """(directory, reference torch model)."""
  import transformers  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path_factory.mktemp('hf_llama'))
  return directory, hf_files.save_perturbed(lambda: transformers.LlamaForCausalLM(
      transformers.LlamaConfig(
          vocab_size=211, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=14, rope_theta=1000.0,
          rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation='eager')),
      directory)


@pytest.fixture(scope='module')
def converted(hf_llama):
  params, config = pretrained.load_hf(hf_llama[0])
  return Llama(config), jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope='module')
def prompts(converted):
  """Tokens and HF's attention mask `[4, 7]`, each prompt at the end of its row."""
  width = max(LENGTHS)
  tokens = np.random.default_rng(0).integers(1, converted[0].config.vocab_size,
                                             (len(LENGTHS), width))
  mask = np.arange(width)[None, :] >= width - np.asarray(LENGTHS)[:, None]
  return np.where(mask, tokens, PAD).astype(np.int32), mask.astype(np.int32)


def _hf_generate(reference, prompts, eos, **kwargs):
  """HF's continuations `[4, MAX_NEW]` (`pad_token_id` after EOS; eos None: none) and output."""
  import torch  # pylint: disable=g-import-not-at-top
  tokens, mask = prompts
  reference.generation_config.eos_token_id = eos
  with torch.no_grad():
    out = reference.generate(
        input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
        max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=eos, output_scores=True,
        return_dict_in_generate=True, **kwargs)
  continuation = out.sequences[:, tokens.shape[1]:].numpy()
  return np.pad(continuation, ((0, 0), (0, MAX_NEW - continuation.shape[1]))), out


@pytest.fixture(scope='module')
def eos(hf_llama, prompts):
  continuation, _ = _hf_generate(hf_llama[1], prompts, None, do_sample=False)
  return int(continuation[1, 3])


def _decode(converted, prompts, config):
  model, params = converted
  decode = llama_decoding.make_decode_fn(model, config, MAX_NEW)
  tokens, scores = decode(params, *prompts, jax.random.PRNGKey(0))
  return np.asarray(tokens), np.asarray(scores)


def test_greedy_matches_hf_generate(hf_llama, converted, prompts, eos):
  tokens, scores = _decode(converted, prompts, DecodeConfig(method='greedy', eos_id=eos))
  theirs, out = _hf_generate(hf_llama[1], prompts, eos, do_sample=False, num_beams=1)
  np.testing.assert_array_equal(tokens, theirs)
  ended = [eos in row for row in tokens]
  assert ended[1] and not all(ended)   # EOS ends a row early, the others decode on
  # Scores: the model's log-probability of the tokens up to EOS, as HF's step logits give it.
  import torch  # pylint: disable=g-import-not-at-top
  step_log_probs = torch.log_softmax(torch.stack(out.scores, 1), -1).numpy()
  for i, row in enumerate(tokens):
    expected = sum(step_log_probs[i, t, token] for t, token in enumerate(through_eos(row, eos)))
    np.testing.assert_allclose(scores[i], expected, rtol=1e-5)


def _hf_log_prob(reference, prompts, row, continuation, eos):
  """Teacher-forced log-probability of `continuation` (up to EOS) after prompt `row`, unpadded."""
  import torch  # pylint: disable=g-import-not-at-top
  tokens, mask = prompts
  prompt = [int(t) for t in tokens[row][mask[row] == 1]]
  target = through_eos(continuation, eos)
  with torch.no_grad():
    logits = reference(torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:]
  log_probs = torch.log_softmax(logits.double(), -1).numpy()
  return float(sum(log_probs[i, t] for i, t in enumerate(target)))


def test_beam_search_matches_hf_generate(hf_llama, converted, prompts, eos):
  """alpha 0 vs `length_penalty=0.0` and `early_stopping='never'`; where the two differ it is
  by design (tests/decoding/test_hf_parity.py): T5X lets any of the 2 * beams candidates of a
  step finish, HF only the top `beams`, so ours may return a better sequence HF never finishes."""
  reference = hf_llama[1]
  tokens, scores = _decode(converted, prompts, DecodeConfig(method='beam', num_beams=3,
                                                            alpha=0.0, eos_id=eos))
  theirs, out = _hf_generate(reference, prompts, eos, do_sample=False, num_beams=3,
                             length_penalty=0.0, early_stopping='never')
  hf_scores = out.sequences_scores.numpy()
  different = []
  for i, (ours, hf) in enumerate(zip(tokens, theirs)):
    if through_eos(ours, eos) == through_eos(hf, eos):
      np.testing.assert_allclose(scores[i], hf_scores[i], rtol=1e-5)
    else:
      different.append(i)
      assert through_eos(ours, eos)[-1] == eos
      np.testing.assert_allclose(scores[i], _hf_log_prob(reference, prompts, i, ours, eos),
                                 rtol=1e-5)
      assert scores[i] > hf_scores[i]
  assert len(different) <= 1, different


@pytest.mark.parametrize('temperature, topk, topp', [
    (0.7, 0, 0.9), (1.5, 20, 0.5), (1.0, 5, 0.0), (0.4, 0, 0.3), (2.0, 50, 1.0)])
def test_the_sampling_distribution_is_hfs_warpers(temperature, topk, topp):
  """Our sampling distribution on the same logits as HF's `TemperatureLogitsWarper`,
  `TopKLogitsWarper` and `TopPLogitsWarper` (HF's order, as `generate` builds them)."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import generation  # pylint: disable=g-import-not-at-top
  logits = np.random.default_rng(1).normal(size=(6, 211)).astype(np.float32) * 3
  warpers = [generation.TemperatureLogitsWarper(temperature)]
  if topk:
    warpers.append(generation.TopKLogitsWarper(topk))
  if 0 < topp < 1:
    warpers.append(generation.TopPLogitsWarper(topp))
  theirs = torch.softmax(generation.LogitsProcessorList(warpers)(
      None, torch.tensor(logits)), -1).numpy()
  ours = np.asarray(jax.nn.softmax(sampling_logits(
      jnp.asarray(logits), temperature=temperature, topk=topk, topp=topp)))
  np.testing.assert_array_equal(ours > 0, theirs > 0)   # the same tokens may be drawn
  np.testing.assert_allclose(ours, theirs, atol=1e-6)
  if topk or 0 < topp < 1:
    assert (theirs == 0).any(axis=1).all()   # the cut is exercised


def _moe_scanned(model, params):
  """The model with every block an MoE of copied experts (no token dropped: capacity factor
  4 for k = 2 of 4), scanned, and its stacked params."""
  config = dataclasses.replace(model.config, scan_layers=True, moe=MoeConfig(
      num_experts=4, router=routers.TopK(k=2), eval_capacity_factor=4.0,
      normalize_combine_weights=True))
  unrolled = dataclasses.replace(config, scan_layers=False)
  moe_params, _ = upcycling.upcycle(params, abstract_params(unrolled), experts='copy',
                                    router='normal', rng=jax.random.PRNGKey(1))
  return Llama(config), scan_layout.stack(moe_params, config)


@pytest.mark.parametrize('variant', ['dense', 'moe_scanned'])
def test_cached_steps_give_the_uncached_logits(converted, prompts, variant):
  """Teacher forcing: the prompt, then given tokens one step at a time, against one forward
  pass over prompt + tokens with HF generate's positions (cumsum(mask) - 1)."""
  model, params = converted if variant == 'dense' else _moe_scanned(*converted)
  tokens, mask = prompts
  given = np.random.default_rng(2).integers(0, model.config.vocab_size, (len(LENGTHS), 5))
  full = np.concatenate([tokens, given], 1).astype(np.int32)
  full_mask = np.concatenate([mask, np.ones_like(given)], 1).astype(np.int32)
  positions = (np.cumsum(full_mask, 1) - 1) * full_mask
  expected = np.asarray(jax.jit(model.apply)({'params': params}, full, full_mask, positions))
  width = tokens.shape[1]
  prompt_logits, variables = jax.jit(lambda p: model.apply(
      {'params': p}, tokens, mask, full.shape[1], method=Llama.prefill, mutable=['cache']))(
          params)
  real = mask == 1
  np.testing.assert_allclose(np.asarray(prompt_logits)[real], expected[:, :width][real],
                             atol=2e-5, rtol=1e-5)
  step = jax.jit(lambda p, cache, token: model.apply(
      {'params': p, 'cache': cache}, token, method=Llama.decode_step, mutable=['cache']))
  cache = variables['cache']
  for t in range(given.shape[1] + 1):   # the last prompt token first, then the given ones
    logits, variables = step(params, cache, full[:, width - 1 + t:width + t])
    cache = variables['cache']
    np.testing.assert_allclose(logits, expected[:, width - 1 + t], atol=2e-5, rtol=1e-5)
  assert int(cache['decoder']['index']) == full.shape[1]
  np.testing.assert_array_equal(cache['decoder']['positions'], full_mask.sum(1))


def test_a_training_group_size_that_does_not_divide_the_prompts_decodes_per_sequence(
    converted, prompts, eos):
  """An MoE trained with groups of 8 tokens decodes 4 prompts of 7 (28 tokens): the prefill
  routes each sequence as a group of its own, as every decode step does, so it decodes as the
  model routed per sequence (`grouping.PerExample()`) does."""
  model, params = _moe_scanned(*converted)
  grouped = Llama(dataclasses.replace(model.config, moe=dataclasses.replace(
      model.config.moe, grouping=grouping.Fixed(8))))
  greedy = DecodeConfig(method='greedy', eos_id=eos)
  ours = [_decode((m, params), prompts, greedy) for m in (grouped, model)]
  np.testing.assert_array_equal(ours[0][0], ours[1][0])
  np.testing.assert_allclose(ours[0][1], ours[1][1], rtol=1e-6)
