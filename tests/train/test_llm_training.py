"""A decoder-only Llama trained on the offline default: its loss falls, the run keeps its
tokenizer, a run killed by SIGKILL resumes step for step as if it had not been, and a run
continuing another's step (runs/llm_continue.gin, RESTORE_DATASET) trains its next steps."""

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.helpers import REPO
from tests.train.helpers import ONE_DEVICE_XLA_FLAGS
from upcycle import export
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.data.lm import LmPipeline
from upcycle.models import Llama, LlamaConfig
from upcycle.train.objectives import CausalLm
from upcycle.train.optimizers import AdamW, warmup_decay_schedule
from upcycle.train.trainer import Trainer, TrainConfig

TINY_LLAMA = LlamaConfig(vocab_size=4096, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         d_ff=64, num_layers=2)


def _lm(split):
  return LmPipeline('offline_stdlib_text', split, {'targets': 64})


@pytest.mark.slow
def test_tiny_llama_learns_the_offline_stdlib_text(tmp_path):
  config = TrainConfig(str(tmp_path), train_steps=60, batch_size=8, log_every=1,
                       checkpoint_every=1000, eval_batches=2, async_checkpoints=False)
  optimizer = AdamW(schedule=warmup_decay_schedule(3e-3, 10, 60))
  result = Trainer(CausalLm(Llama(TINY_LLAMA)), optimizer, config, _lm('train'),
                   _lm('validation')).run()
  losses = [h['loss'] for h in result['history']]
  first, last = np.mean(losses[:3]), np.mean(losses[-3:])
  assert first > 7.5 and last < first - 1.5, (first, last)   # ln(4096) = 8.3 at the start
  assert np.isfinite(result['eval']['loss']) and result['eval']['loss'] < first - 1.0


@pytest.mark.parametrize('tied', [False, True])
def test_loss_chunks_give_the_whole_logits_loss_and_gradients(tied):
  """CausalLm.loss_chunks: the loss and its gradients of every parameter, on packed rows
  with padding, are those of the whole float32 logits (the tied output layer too)."""
  config = dataclasses.replace(TINY_LLAMA, vocab_size=96, logits_via_embedding=tied)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 96, (2, 16)).astype(np.int32)
  batch = {'decoder_input_tokens': tokens, 'decoder_target_tokens': np.roll(tokens, -1, 1),
           'decoder_segment_ids': np.array([[1] * 10 + [2] * 6, [1] * 12 + [0] * 4], np.int32)}
  params = Llama(config).init(jax.random.PRNGKey(0), tokens)['params']

  def loss_and_grads(chunks):
    objective = CausalLm(Llama(config), z_loss=1e-4, loss_chunks=chunks)
    fn = lambda p: objective.forward(p, batch, train=False)[0]['loss']
    return jax.jit(jax.value_and_grad(fn))(params)

  (whole, whole_grads), (chunked, chunked_grads) = loss_and_grads(1), loss_and_grads(4)
  np.testing.assert_allclose(chunked, whole, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(whole_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match=r'CausalLm.loss_chunks = 3 does not divide the '
                                       r'sequence length \(16\)\. Fix: a divisor of 16\.'):
    CausalLm(Llama(config), loss_chunks=3).forward(params, batch, train=False)


def _command(model_dir, steps, run='runs/llm_pretrain.gin'):
  return [sys.executable, '-m', 'upcycle.train', '--gin_file=models/llama/tiny.gin',
          f'--gin_file={run}', '--gin_file=data/offline_stdlib_lm.gin',
          f"--gin.MODEL_DIR='{model_dir}'", f'--gin.TRAIN_STEPS={steps}', '--gin.BATCH_SIZE=8',
          "--gin.TASK_FEATURE_LENGTHS={'targets': 32}", '--gin.models.LlamaConfig.num_layers=2',
          '--gin.trainer.TrainConfig.log_every=1', '--gin.trainer.TrainConfig.checkpoint_every=4',
          '--gin.__main__.train.eval_data=None']


def _losses(model_dir):
  rows = [json.loads(line) for line in open(os.path.join(model_dir, 'metrics.jsonl'))]
  return [(r['step'], r['loss']) for r in rows if r['split'] == 'train']


@pytest.mark.slow
def test_a_killed_llm_run_resumes_exactly_and_keeps_its_tokenizer(tmp_path, entry_points):
  env = {**os.environ, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS}
  straight, killed = tmp_path / 'straight', tmp_path / 'killed'
  subprocess.run(_command(straight, 12), cwd=REPO, env=env, check=True, capture_output=True)
  proc = subprocess.Popen(_command(killed, 12), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if ((killed / 'checkpoints' / '4').is_dir() and (killed / 'metrics.jsonl').exists()
        and max(step for step, _ in _losses(killed)) >= 6):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'the run ended before it could be killed'
  done = subprocess.run(_command(killed, 12), cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-5000:]
  assert 'Resuming from' in done.stdout
  assert [s for s, _ in _losses(killed)] == list(range(1, 13))   # each step logged once
  assert _losses(killed) == _losses(straight)
  kept = tokenizer_lib.load(str(killed / 'checkpoints' / '12'))
  assert kept.digest == tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).digest

  # `python -m upcycle.export` (its main, in this process) reads the run's model from its
  # config.gin (2 layers: the command line's override), with no gin file repeated.
  assert export.main(['--format=hf', f'--model_dir={straight}',
                      f'--output_dir={tmp_path / "hf"}']) == 0
  hf = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert (hf['num_hidden_layers'], hf['hidden_size']) == (2, 64)

  # Another run continuing step 8 (its parameters, AdamW moments, step and data position)
  # trains steps 9-12 as the straight run did.
  continued = tmp_path / 'continued'
  done = subprocess.run(_command(continued, 12, run='runs/llm_continue.gin') + [
      f"--gin.INITIAL_CHECKPOINT_PATH='{straight / 'checkpoints' / '8'}'",
      '--gin.RESTORE_DATASET=True'], cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-5000:]
  assert _losses(continued) == _losses(straight)[8:]


@pytest.mark.slow
def test_an_hf_llama_upcycled_in_the_restore_hook_starts_at_the_dense_loss(tmp_path):
  """runs/llm_upcycle.gin's hook: an HF LlamaForCausalLM directory becomes the Mixtral-routed
  MoE (copied experts, Drop-Upcycling's uniform router) in one sharded jit on 8 devices; its
  evaluation before the first step equals the dense checkpoint's (top-2 of identical
  experts, weights renormalized), and it trains. From a dense run's step instead, with
  reuse_optimizer_state, each expert starts with its dense MLP's AdamW moments."""
  import transformers  # pylint: disable=g-import-not-at-top
  from tests import hf_files  # pylint: disable=g-import-not-at-top
  from upcycle.models import llama_hf  # pylint: disable=g-import-not-at-top
  from upcycle.restore import Restore  # pylint: disable=g-import-not-at-top
  from upcycle.upcycling import modes  # pylint: disable=g-import-not-at-top
  hf_dir = str(tmp_path / 'hf_llama')
  hf_files.save_perturbed(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)),
      hf_dir)
  dense = LlamaConfig.from_hf_config(json.load(open(os.path.join(hf_dir, 'config.json'))))
  moe = dataclasses.replace(dense, moe=llama_hf.mixtral_moe(4, 2, 0.02))
  optimizer = AdamW(schedule=warmup_decay_schedule(1e-3, 1, 4))

  def run(config, initializer, name, steps=2):
    train_config = TrainConfig(str(tmp_path / name), train_steps=steps, batch_size=8, log_every=1,
                               checkpoint_every=1000, eval_batches=2, eval_at_start=True,
                               async_checkpoints=False)
    return Trainer(CausalLm(Llama(config)), optimizer, train_config, _lm('train'),
                   _lm('validation'), initializer).run()

  upcycled = run(moe, Restore(hf_dir, modes.Upcycle(experts='copy', router='uniform')), 'moe')
  reference = run(dense, Restore(hf_dir, modes.Continue(), reuse_optimizer_state=False), 'dense')
  np.testing.assert_allclose(upcycled['initial_eval']['loss'],
                             reference['initial_eval']['loss'], rtol=1e-5)
  assert [h['step'] for h in upcycled['history']] == [1, 2]
  assert all(np.isfinite(h['loss']) for h in upcycled['history'])

  # The dense run's AdamW moments, reused: every expert starts with its MLP's moments.
  reused = run(moe, Restore(str(tmp_path / 'dense' / 'checkpoints' / '2'), modes.Upcycle(),
                            reuse_optimizer_state=True), 'reused', steps=2)['state']
  dense_state = reference['state']
  adam = lambda state: [s for s in jax.tree.leaves(state.opt_state,
                                                   is_leaf=lambda s: hasattr(s, 'mu'))
                        if hasattr(s, 'mu')][0]
  for moment in ('mu', 'nu'):
    moe_moments, dense_moments = getattr(adam(reused), moment), getattr(adam(dense_state), moment)
    for name in ('wi_0', 'wi_1', 'wo'):
      tiled = np.asarray(moe_moments['decoder']['layers_1']['mlp']['expert'][name]['kernel'])
      source = np.asarray(dense_moments['decoder']['layers_1']['mlp'][name]['kernel'])
      assert np.abs(source).max() > 0
      np.testing.assert_array_equal(tiled, np.broadcast_to(source, tiled.shape))


@pytest.mark.slow
def test_a_tokenizer_that_is_not_the_weights_is_refused_before_any_step(tmp_path):
  """Resuming a run, or continuing its step, with another tokenizer (the offline BPE with two
  ids swapped), and an embedding with fewer rows than the tokenizer has ids: each refused in
  one line naming TOKENIZER before a step is trained or a file written; the run's own
  tokenizer resumes it."""
  from tests import helpers  # pylint: disable=g-import-not-at-top
  from upcycle.restore import Restore  # pylint: disable=g-import-not-at-top
  from upcycle.upcycling import modes  # pylint: disable=g-import-not-at-top
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  swapped = helpers.save_swapped_tokenizer(offline, str(tmp_path / 'swapped'))
  other = tokenizer_lib.load(swapped)

  def run(name, steps=2, tokenizer=tokenizer_lib.OFFLINE_BPE, initializer=None, **model):
    config = TrainConfig(str(tmp_path / name), train_steps=steps, batch_size=8,
                         checkpoint_every=2, async_checkpoints=False, tensorboard=False)
    return Trainer(CausalLm(Llama(dataclasses.replace(TINY_LLAMA, **model))),
                   AdamW(schedule=warmup_decay_schedule(1e-3, 1, 4)), config,
                   LmPipeline('offline_stdlib_text', 'train', {'targets': 16},
                              tokenizer=tokenizer), initializer=initializer).run()

  run('run')
  step = str(tmp_path / 'run' / 'checkpoints' / '2')
  said = []
  listener = logging.Handler()
  listener.emit = lambda record: said.append(record.getMessage())
  logging.getLogger('upcycle').addHandler(listener)
  try:
    with pytest.raises(tokenizer_lib.TokenizerError) as refused:
      run('run', steps=4, tokenizer=swapped)
  finally:
    logging.getLogger('upcycle').removeHandler(listener)
  assert not [line for line in said if line.startswith('Training on')]   # refused first
  assert str(refused.value) == (
      f'TOKENIZER (lm.LmPipeline.tokenizer) reads {swapped} (tokenizer digest '
      f'{other.short_digest}), but the weights of {step} were trained with tokenizer '
      f'{offline.short_digest} (the data position saved in {step}/dataset): they would read '
      f"another tokenizer's ids. Fix: resume with the tokenizer the run was trained with "
      f'(TOKENIZER in {tmp_path}/run/config.gin), or train in a new MODEL_DIR.')
  assert os.listdir(tmp_path / 'run' / 'checkpoints') == ['2']
  with pytest.raises(tokenizer_lib.TokenizerError, match=re.escape(
      f"Fix: TOKENIZER = '{step}', the checkpoint's own (runs/llm_continue.gin's and "
      "runs/llm_upcycle.gin's default).")):
    run('continued', steps=4, tokenizer=swapped,
        initializer=Restore(step, modes.Continue(), reuse_optimizer_state=True))
  with pytest.raises(tokenizer_lib.TokenizerError, match=re.escape(
      "reads offline_stdlib_bpe, whose 4096 pieces have ids up to 4095, but the model's "
      'embedding has 4000 rows (models.LlamaConfig.vocab_size = 4000).')):
    run('small', vocab_size=4000)
  assert not os.path.exists(tmp_path / 'continued' / 'checkpoints' / '4')
  assert not os.path.exists(tmp_path / 'small' / 'checkpoints')
  assert run('run', steps=4)['start_step'] == 2   # its own tokenizer resumes it
