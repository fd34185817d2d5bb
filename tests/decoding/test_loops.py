"""The decoding loops on hand-made step functions whose probabilities are known exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import fields
from upcycle.decoding import (DecodeConfig, beam_search, brevity_penalty, exact_match,
                              temperature_sample)

EOS = 1


def table_step(log_probs):
  """A step function whose next-token log-probabilities depend only on the input token:
  `log_probs[token]` `[vocab]`. Its cache counts the steps (a scalar, shared by beams)."""
  table = jnp.asarray(log_probs, jnp.float32)

  def step(tokens, cache):
    return table[tokens], {'steps': cache['steps'] + 1}

  return step


def test_t5x_brevity_penalty():
  np.testing.assert_allclose(brevity_penalty(0.6, 7), (12 / 6) ** 0.6, rtol=1e-6)
  assert float(brevity_penalty(0.0, 30)) == 1.0


def test_alpha_decides_between_a_short_and_a_long_finished_sequence():
  # From the start (token 0): EOS 0.4, token 2 0.6; after token 2: EOS 0.6, token 2 0.4.
  # [EOS]: log 0.4 = -0.916 at length 1; [2, EOS]: 2 log 0.6 = -1.022 at length 2.
  # alpha = 0 keeps the short one; alpha = 1 divides the long one by 7/6 -> -0.876: it wins.
  never = -1e9
  step = table_step([[never, np.log(0.4), np.log(0.6)],
                     [never, 0.0, never],
                     [never, np.log(0.6), np.log(0.4)]])
  run = lambda alpha: beam_search(step, {'steps': jnp.zeros((), jnp.int32)}, batch_size=1,
                                  max_length=3, eos_id=EOS, num_beams=2, alpha=alpha)
  sequences, scores = run(0.0)
  np.testing.assert_array_equal(sequences[0], [[1, 0, 0], [2, 1, 0]])
  np.testing.assert_allclose(scores[0], [np.log(0.4), 2 * np.log(0.6)], rtol=1e-6)
  sequences, scores = run(1.0)
  np.testing.assert_array_equal(sequences[0, 0], [2, 1, 0])
  np.testing.assert_allclose(scores[0, 0], 2 * np.log(0.6) / (7 / 6), rtol=1e-6)
  np.testing.assert_allclose(scores[0, 1], np.log(0.4), rtol=1e-6)


def test_greedy_stops_at_eos_and_pads():
  # 0 -> 3 -> 4 -> EOS, then padding; the loop ends early (3 steps of max 6).
  never = -1e9
  table = np.full((5, 5), never)
  table[0, 3], table[3, 4], table[4, EOS], table[EOS, 2] = 0.0, 0.0, np.log(0.9), 0.0
  table[4, 2] = np.log(0.1)
  cache = {'steps': jnp.zeros((), jnp.int32)}
  tokens, log_prob = temperature_sample(table_step(table), cache, batch_size=2, max_length=6,
                                        eos_id=EOS, rng=jax.random.PRNGKey(0), temperature=0.0)
  np.testing.assert_array_equal(tokens, [[3, 4, 1, 0, 0, 0]] * 2)
  np.testing.assert_allclose(log_prob, [np.log(0.9)] * 2, rtol=1e-6)


def test_an_eos_list_ends_a_decode_at_any_of_its_ids():
  # 0 -> 3 -> 4 -> EOS: with the eos list (4, 1), as generate's, greedy ends at 4; beam search
  # finishes [3, 4] too (its score is the same path's, without the EOS step).
  never = -1e9
  table = np.full((5, 5), never)
  table[0, 3], table[3, 4], table[4, EOS], table[EOS, 2] = 0.0, np.log(0.8), 0.0, 0.0
  table[3, 2], table[2, EOS] = np.log(0.2), 0.0
  cache = {'steps': jnp.zeros((), jnp.int32)}
  tokens, log_prob = temperature_sample(table_step(table), cache, batch_size=1, max_length=6,
                                        eos_id=(4, EOS), rng=jax.random.PRNGKey(0),
                                        temperature=0.0)
  np.testing.assert_array_equal(tokens, [[3, 4, 0, 0, 0, 0]])
  np.testing.assert_allclose(log_prob, [np.log(0.8)], rtol=1e-6)
  sequences, _ = beam_search(table_step(table), cache, batch_size=1, max_length=6,
                             eos_id=(4, EOS), num_beams=2, alpha=0.0)
  np.testing.assert_array_equal(sequences[0], [[3, 4, 0, 0, 0, 0], [3, 2, 1, 0, 0, 0]])
  assert DecodeConfig(eos_id=[2, 4]).eos_id == (2, 4)
  with pytest.raises(fields.ConfigError, match=r'^decoding.DecodeConfig.eos_id = \(\): expected '
                     r'an id >= 0 or a non-empty tuple of them.$'):
    DecodeConfig(eos_id=())


def test_sampling_follows_temperature_and_top_k():
  logits = np.log(np.array([0.0001, 0.1, 0.2, 0.3, 0.3999]))
  step = table_step(np.tile(logits, (5, 1)))
  n = 4000
  sample = lambda **kw: np.asarray(temperature_sample(
      step, {'steps': jnp.zeros((), jnp.int32)}, batch_size=n, max_length=1, eos_id=EOS,
      rng=jax.random.PRNGKey(1), **kw)[0][:, 0])
  frequencies = lambda t: np.bincount(t, minlength=5) / n
  # Temperature 2: p ~ sqrt(p); top-k 2 keeps tokens 3 and 4 only, renormalized.
  expected = np.sqrt(np.exp(logits)) / np.sqrt(np.exp(logits)).sum()
  np.testing.assert_allclose(frequencies(sample(temperature=2.0)), expected, atol=0.03)
  top2 = frequencies(sample(temperature=1.0, topk=2))
  np.testing.assert_allclose(top2, [0, 0, 0, 0.3 / 0.6999, 0.3999 / 0.6999], atol=0.03)
  assert top2[:3].sum() == 0


def test_sampling_follows_top_p():
  # Descending 0.3999, 0.3, 0.2, ...: with top-p 0.6 the mass above token 2 (0.6999) is not
  # below 0.6, so tokens 3 and 4 are drawn, renormalized; rescaled scores are under that.
  p = np.array([0.0001, 0.1, 0.2, 0.3, 0.3999])
  step = table_step(np.tile(np.log(p), (5, 1)))
  tokens, rescaled = temperature_sample(step, {'steps': jnp.zeros((), jnp.int32)},
                                        batch_size=4000, max_length=1, eos_id=EOS,
                                        rng=jax.random.PRNGKey(3), temperature=1.0, topp=0.6,
                                        rescale_log_probs=True)
  token = np.asarray(tokens)[:, 0]
  np.testing.assert_allclose(np.bincount(token, minlength=5) / token.size,
                             [0, 0, 0, 0.3 / 0.6999, 0.3999 / 0.6999], atol=0.03)
  np.testing.assert_allclose(rescaled, np.log(p[token] / 0.6999), rtol=1e-5)


def test_top_p_is_a_probability():
  with pytest.raises(fields.ConfigError, match=r'^decoding.DecodeConfig.topp = 1.5: expected '
                     r'a probability in \[0, 1\]'):
    DecodeConfig(method='sample', topp=1.5)


def test_scores_under_the_model_or_rescaled_as_t5x():
  p = np.array([0.0001, 0.1, 0.2, 0.3, 0.3999])
  step = table_step(np.tile(np.log(p), (5, 1)))
  run = lambda **kw: temperature_sample(step, {'steps': jnp.zeros((), jnp.int32)},
                                        batch_size=64, max_length=1, eos_id=EOS,
                                        rng=jax.random.PRNGKey(2), **kw)
  tokens, model_scores = run(temperature=2.0, topk=2)
  rescaled_tokens, rescaled = run(temperature=2.0, topk=2, rescale_log_probs=True)
  np.testing.assert_array_equal(rescaled_tokens, tokens)
  token = np.asarray(tokens)[:, 0]
  assert set(token.tolist()) == {3, 4}
  # Temperature 2 and top-2: tokens 3 and 4 with probabilities proportional to sqrt(p).
  np.testing.assert_allclose(model_scores, np.log(p[token]), rtol=1e-5)
  np.testing.assert_allclose(rescaled, np.log(np.sqrt(p[token]) / np.sqrt(p[3:]).sum()),
                             rtol=1e-5)
  _, greedy = run(temperature=0.0, rescale_log_probs=True)
  np.testing.assert_array_equal(greedy, np.zeros(64))


def test_exact_match_compares_tokens_eos_and_padding():
  targets = np.array([[5, 6, 1, 0], [5, 6, 1, 0], [5, 6, 1, 0], [7, 8, 9, 2]])
  predictions = np.array([[5, 6, 1, 0], [5, 6, 6, 1], [5, 1, 0, 0], [7, 8, 9, 2]])
  np.testing.assert_array_equal(exact_match(predictions, targets), [True, False, False, True])
  np.testing.assert_array_equal(exact_match(predictions[:, :3], targets), [True] + [False] * 3)
