"""Training on the offline data: loss falls, sharded == single device, exact resume after kill."""

import dataclasses
import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from tests.helpers import REPO, refusal, with_flags
from tests.train.helpers import (ONE_DEVICE_XLA_FLAGS, TEXT_LENGTHS, TRAINING_T5, TRAINING_VIT,
                                 losses, run_t5, text, train_command)
from upcycle import eval as eval_main
from upcycle import fields, tree
from upcycle.data.images import DIGITS, ImagePipeline
from upcycle.data.text import TextPipeline
from upcycle.models import T5, ViT
from upcycle.moe import MoeConfig, routers
from upcycle.train import __main__ as train_main
from upcycle.train.objectives import Classification, Seq2Seq
from upcycle.train.optimizers import Adafactor, AdamW, rsqrt_schedule, warmup_decay_schedule
from upcycle.train.trainer import Trainer, TrainConfig


@pytest.mark.slow
def test_tiny_t5_learns_the_offline_span_corruption(dense_t5_run):
  tmp_path, result = dense_t5_run
  first, last = np.mean(losses(result)[:3]), np.mean(losses(result)[-3:])
  assert last < first - 1.0, (first, last)
  assert 0 < result['eval']['accuracy'] <= 1 and np.isfinite(result['eval']['loss'])
  assert result['eval']['batches'] == 2 and 0 < result['eval']['loss_stderr'] < 1
  logged = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['step'] for r in logged if r['split'] == 'train'] == list(range(1, 31))
  assert {'loss', 'accuracy', 'learning_rate', 'z_loss', 'grad_norm'} <= set(logged[-2])
  assert os.listdir(tmp_path / 'tensorboard' / 'train')


@pytest.mark.slow
def test_inference_evaluation_during_training_reports_what_eval_reports(tmp_path):
  """TrainConfig.infer_eval (T5X's infer_eval): every evaluation also decodes the unpacked
  validation split and logs sequence accuracy as split 'infer_eval'; `python -m upcycle.eval`
  of the step's checkpoint, decoding the same batches, reports the same, and the loss the
  run's eval step gave in 2 microbatches (`eval_microbatches`) over the whole batch."""
  decode = TextPipeline('offline_span_corruption', 'validation', TEXT_LENGTHS, pack=False,
                        shuffle=False)
  config = TrainConfig(str(tmp_path), train_steps=4, batch_size=8, log_every=2,
                       checkpoint_every=4, eval_every=4, eval_batches=1, infer_eval=True,
                       infer_eval_batches=2, async_checkpoints=False, tensorboard=False,
                       eval_microbatches=2)
  Trainer(Seq2Seq(T5(TRAINING_T5)), Adafactor(schedule=rsqrt_schedule(1.0, 100)), config,
          text('train'), text('validation'), decode_data=decode,
          devices=jax.devices()[:1]).run()
  rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  (decoded,) = [r for r in rows if r['split'] == 'infer_eval']
  assert decoded['step'] == 4 and decoded['decoded_examples'] == 16
  evaluated = eval_main.evaluate(
      objective=Seq2Seq(T5(TRAINING_T5)), eval_data=text('validation'), eval_batches=1,
      checkpoint_path=str(tmp_path / 'checkpoints' / '4'), batch_size=8, decode_data=decode,
      decode_batches=2)
  assert decoded['sequence_accuracy'] == evaluated['sequence_accuracy']
  assert decoded['decoded_examples'] == evaluated['decoded_examples']
  (validation,) = [r for r in rows if r['split'] == 'eval']
  assert validation['step'] == 4
  assert validation['loss'] == pytest.approx(evaluated['loss'], rel=1e-5)
  with pytest.raises(ValueError, match=r'trainer.TrainConfig.infer_eval = True, and the run '
                                       r'has no decode data \(train_script.train.decode_data\)'):
    Trainer(Seq2Seq(T5(TRAINING_T5)), Adafactor(schedule=rsqrt_schedule(1.0, 100)), config,
            text('train'), text('validation'))


@pytest.mark.slow
def test_tiny_vit_learns_the_digits(tmp_path):
  images = lambda split, train: ImagePipeline(DIGITS, split, image_size=16, train=train,
                                              random_flip=False)
  config = TrainConfig(str(tmp_path), train_steps=100, batch_size=32, log_every=1,
                       checkpoint_every=1000, async_checkpoints=False)
  optimizer = AdamW(schedule=warmup_decay_schedule(3e-3, 10, 100))
  result = Trainer(Classification(ViT(TRAINING_VIT)), optimizer, config,
                   images('train', True), images('validation', False)).run()
  first, last = np.mean(losses(result)[:5]), np.mean(losses(result)[-5:])
  assert last < first - 0.5, (first, last)
  assert result['eval']['accuracy'] > 0.35   # 10 classes: chance is 0.1


@pytest.mark.slow
def test_validation_data_the_model_refuses_stops_the_run_before_its_first_step(tmp_path):
  """The eval step is compiled before training, as T5X's trainer does: validation images of
  another size than the model's stop the run at its start, not after `eval_every` steps (a
  validation batch too large for the devices' memory would stop it there likewise)."""
  config = TrainConfig(str(tmp_path), train_steps=20, batch_size=8, eval_every=10,
                       checkpoint_every=5, async_checkpoints=False)
  trainer = Trainer(Classification(ViT(TRAINING_VIT)),
                    AdamW(schedule=warmup_decay_schedule(3e-3, 10, 100)), config,
                    ImagePipeline(DIGITS, 'train', image_size=16, train=True),
                    ImagePipeline(DIGITS, 'validation', image_size=32, train=False))
  with pytest.raises(fields.ConfigError) as raised:
    trainer.run()
  assert str(raised.value) == (
      'The validation data (train_script.train.eval_data) does not fit the model: ViT got '
      'images of (32, 32) -> a 8x8 patch grid; the config (image_size=(16, 16)) expects (4, 4).')
  assert os.listdir(tmp_path / 'checkpoints') == []
  assert not (tmp_path / 'metrics.jsonl').exists()


@pytest.mark.slow
def test_moe_training_on_8_devices_matches_one_device(tmp_path):
  moe = dataclasses.replace(
      TRAINING_T5, encoder_moe=MoeConfig(num_experts=4, train_capacity_factor=1.0),
      decoder_moe=MoeConfig(num_experts=4, router=routers.TopK(k=2)))
  sharded = run_t5(tmp_path / 'sharded', moe, steps=4, num_expert_partitions=2,
                   num_model_partitions=2)
  single = run_t5(tmp_path / 'single', moe, devices=jax.devices()[:1], steps=4)
  np.testing.assert_allclose(losses(sharded), losses(single), rtol=2e-5)
  # TensorBoard's tags are T5X's where T5X logs the quantity (t5x/contrib/moe/models.py's
  # experts/* are means over the MoE layers); metrics.jsonl keeps this project's names.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tags = {}
  for path in (tmp_path / 'sharded' / 'tensorboard' / 'train').glob('events.*'):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        tags[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
  row = [json.loads(line) for line in open(tmp_path / 'sharded' / 'metrics.jsonl')][3]
  assert row['step'] == 4 and (4, 'cross_entropy') not in tags
  assert tags[(4, 'cross_ent_loss')] == pytest.approx(row['cross_entropy'], rel=1e-6)
  for ours, t5x in (('expert_usage', 'experts/expert_usage'),
                    ('fraction_dropped_tokens', 'experts/fraction_tokens_left_behind')):
    layers = [v for k, v in row.items() if k.startswith('moe/') and k.endswith('/' + ours)]
    assert len(layers) == 2   # encoder and decoder layer 1
    assert tags[(4, t5x)] == pytest.approx(np.mean(layers), rel=1e-6)
  np.testing.assert_allclose(sharded['history'][-1]['moe/total'],
                             single['history'][-1]['moe/total'], rtol=1e-4)
  # The run's routing health, the last row of metrics.jsonl: a block per MoE layer, from the
  # training rows of the last tenth of the steps (of 4: step 4's row).
  written = [json.loads(line) for line in open(tmp_path / 'single' / 'metrics.jsonl')]
  health, last = written[-1], [r for r in written if r['split'] == 'train'][-1]
  assert health == single['routing_health'] and health['split'] == 'routing_health'
  assert health['layers'].keys() == {'encoder/layers_1/mlp', 'decoder/layers_1/mlp'}
  for layer, h in health['layers'].items():
    assert h['top1_probability'] == last[f'moe/{layer}/router_top1_probability']
    assert h['unrouted_fraction'] == last[f'moe/{layer}/fraction_dropped_tokens']
    assert (h['uniform_probability'], h['num_experts']) == (0.25, 4)
    # At init, N(0, 0.02^2) over d_model x E = 32 x 4 draws: within 5 standard errors.
    assert abs(h['router_kernel_rms_at_init'] / 0.02 - 1) < 5 / np.sqrt(2 * 32 * 4)
    # The experts' spread, numpy's over the trained params' expert leaves (the layer's
    # [E, ...] arrays), the same from the run on 8 devices.
    experts = [np.asarray(v, np.float64) for p, v in tree.flatten(single['state'].params).items()
               if p.startswith(layer + '/expert/')]
    means = [w.mean(axis=0, keepdims=True) for w in experts]
    expected = np.sqrt(sum(np.sum((w - m) ** 2) for w, m in zip(experts, means)) /
                       sum(w.shape[0] * np.sum(m ** 2) for w, m in zip(experts, means)))
    assert len(experts) >= 2 and h['expert_spread'] == pytest.approx(expected, rel=1e-5)
    assert sharded['routing_health']['layers'][layer]['expert_spread'] == pytest.approx(
        expected, rel=1e-4)
    # At init, E = 4 experts drawn independently around 0: sqrt(E - 1), over thousands of
    # draws per leaf; the first row logs it.
    assert h['expert_spread_at_init'] == pytest.approx(np.sqrt(3), rel=0.05)
    assert h['expert_spread_at_init'] == written[0][f'moe/{layer}/expert_spread']


def _train_losses(model_dir):
  rows = [json.loads(line) for line in open(os.path.join(model_dir, 'metrics.jsonl'))]
  return {r['step']: r['loss'] for r in rows if r['split'] == 'train'}


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path, straight_run):
  env = {**os.environ, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS}
  killed = tmp_path / 'killed'
  proc = subprocess.Popen(train_command(killed, 12), cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    # After the step-4 checkpoint is committed (under load its background save can outlast
    # steps 5 and 6), before step 8's.
    if (killed / 'checkpoints' / '4').is_dir() and max(_train_losses(killed)) >= 6:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'the run ended before it could be killed'
  assert max(_train_losses(killed)) < 12
  done = subprocess.run(train_command(killed, 12), cwd=REPO, env=env, capture_output=True,
                        text=True)
  assert done.returncode == 0, done.stderr[-5000:]
  assert 'Resuming from' in done.stdout
  expected, resumed = _train_losses(straight_run), _train_losses(killed)
  rows = [json.loads(line) for line in open(killed / 'metrics.jsonl')]
  assert [r['step'] for r in rows if r['split'] == 'train'] == list(range(1, 13))  # each once
  for step in range(1, 13):
    assert resumed[step] == expected[step], step


@pytest.mark.slow
def test_sigterm_saves_the_step_it_arrives_at_and_the_restart_loses_nothing(tmp_path,
                                                                          straight_run):
  """A preempted TPU VM, `launch/tpu_vm.py stop` or `kill`: SIGTERM between checkpoints."""
  env = {**os.environ, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS}
  stopped = tmp_path / 'stopped'
  proc = subprocess.Popen(train_command(stopped, 12), cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if (stopped / 'metrics.jsonl').exists() and max(_train_losses(stopped), default=0) >= 5:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-5000:]
  step = max(int(d) for d in os.listdir(stopped / 'checkpoints') if d.isdigit())
  assert 5 <= step < 12, step   # the step it stopped at (checkpoint_every is 4)
  assert stderr.rstrip().endswith(
      f'Stopped at step {step} on SIGTERM, with step {step} saved in {stopped}/checkpoints; run '
      f'the same command again to resume from it.')
  done = subprocess.run(train_command(stopped, 12), cwd=REPO, env=env, capture_output=True,
                        text=True)
  assert done.returncode == 0, done.stderr[-5000:]
  assert f'Resuming from {stopped}/checkpoints at step {step}.' in done.stdout, done.stdout
  expected, resumed = _train_losses(straight_run), _train_losses(stopped)
  for s in range(1, 13):
    assert resumed[s] == expected[s], s


@pytest.mark.slow
def test_trains_from_a_working_directory_with_folders_named_like_config_groups(tmp_path):
  """`include 'moe/experts_choose.gin'` once crashed gin when the working directory held `moe/`
  (read as a Python namespace package); config lookup no longer looks at the cwd's folders."""
  for folder in ('data', 'models', 'moe', 'runs', 'upcycling'):
    (tmp_path / folder).mkdir()
  model_dir = tmp_path / 'runs' / 'moe'
  command = train_command(model_dir, 1) + ['--gin_file=moe/paper_t5.gin',
                                           '--gin.NUM_EXPERTS=2']
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=1 '
                                    '--xla_backend_optimization_level=0'}
  done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert list(_train_losses(model_dir)) == [1]


def _assert_the_console_is_short(done, model_dir, source):
  """What a continuation of `source` to step 12 (checkpoint_every 4) shows: the restore
  report's summary (every leaf in MODEL_DIR/upcycling_report.txt), a line per checkpoint, the
  end-of-run summary; on stderr nothing (no TensorFlow start-up lines, no seqio warning)."""
  from upcycle import checkpoints, tree  # pylint: disable=g-import-not-at-top
  lines = done.stdout.splitlines()
  report = (model_dir / 'upcycling_report.txt').read_text().splitlines()
  assert report[0] in lines   # the summary
  assert f'Full upcycling report (every leaf): {model_dir}/upcycling_report.txt' in lines
  rows = [line.split()[1] for line in report if line.startswith('copied ')]
  assert rows == sorted(tree.flatten(checkpoints.load(source).params))
  assert not [line for line in lines if line.startswith('copied ')]   # not on the console
  saved = [line for line in lines if line.startswith('Saved step ')]
  assert [line.split(' in ')[0] for line in saved] == [
      f'Saved step {step} to {model_dir}/checkpoints/{step}' for step in (8, 12)]
  assert lines[-4].startswith('Done: step 12 in 0:'), lines[-4:]
  assert lines[-3:] == [f'  checkpoints:  {model_dir}/checkpoints (latest: '
                        f'{model_dir}/checkpoints/12)',
                        f'  metrics:      {model_dir}/metrics.jsonl',
                        f'  TensorBoard:  tensorboard --logdir {model_dir}/tensorboard']
  assert done.stderr == ''


@pytest.mark.slow
def test_a_continuation_that_restores_the_dataset_trains_like_the_uninterrupted_run(
    tmp_path, straight_run, entry_points, capsys):
  """RESTORE_DATASET=True: the dense continuation of step 4 (optimizer state and step kept)
  reads on from step 4's data position, so steps 5-12 equal the uninterrupted run's, loss for
  loss; the position comes from the checkpoint and its batches are not read twice."""
  model_dir = tmp_path / 'continued'
  command = [c.replace('runs/pretrain.gin', 'runs/continue_dense.gin')
             for c in train_command(model_dir, 12)]
  command += [f"--gin.INITIAL_CHECKPOINT_PATH='{straight_run}/checkpoints/4'",
              '--gin.RESTORE_DATASET=True']
  # As a user runs it: TensorFlow's log level unset.
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  done = subprocess.run(command, cwd=REPO, env={**env, 'XLA_FLAGS': ONE_DEVICE_XLA_FLAGS},
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  assert ("Reading the data on from the initial checkpoint's position: epoch 0, batch 4 of 8 "
          'examples (shard 0)') in done.stdout + done.stderr
  _assert_the_console_is_short(done, model_dir, f'{straight_run}/checkpoints/4')
  expected, continued = _train_losses(straight_run), _train_losses(model_dir)
  assert sorted(continued) == list(range(5, 13))
  for step in range(5, 13):
    assert continued[step] == expected[step], step
  # 4 batches of 8 are not a whole number of batches of 24: one line, before any step (train's
  # main in this process, on its 8 devices, which divide 24).
  odd = [c.replace(str(model_dir), str(tmp_path / 'odd')) for c in command[3:]]
  assert refusal(train_main.main, with_flags(odd, '--gin.BATCH_SIZE=24'), capsys) == (
      'error: restore.Restore.restore_dataset=True: The data position 4 batches of 8 '
      'examples into epoch 0 (32 examples) is not a whole number of batches of 24; continue '
      'with a batch size that divides 32. Or read the data from its beginning: '
      'restore.Restore.restore_dataset = False.')
  assert not (tmp_path / 'odd' / 'metrics.jsonl').exists()
