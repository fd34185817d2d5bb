"""`python -m upcycle.eval` runs a seqio task's own metrics as T5X's evaluator does: a task
registered by the user's module (MIXTURE_OR_TASK_MODULE), its postprocess function and its
metric functions (scikit-learn's accuracy and F1 over the predictions, a mean of the targets'
log-likelihoods), on the predictions and scores of transformers' model with the same weights;
the values land in eval_results.json, metrics.jsonl and TensorBoard."""

import glob
import json
import keyword
import os
import sys

import gin
import numpy as np
import pytest

from tests.helpers import BYTE_T5_FLAGS
from upcycle import eval as eval_main
from upcycle import gin_utils

TASK = 'keyword_or_name'
WORDS = sorted(keyword.kwlist)[:12] + ['abs', 'all', 'any', 'ascii', 'bin', 'bool', 'bytes',
                                       'callable', 'chr', 'dict', 'dir', 'divmod']
LENGTHS = {'inputs': 32, 'targets': 8}
TEST_WORDS = 5   # the 'test' split: the first words only
# The user's task module: Python's keywords and builtins' names, each to be called one or the
# other ('validation'; 'test': the first TEST_WORDS of them); a postprocess that turns a text
# into a label (by its length, so that a random model's predictions fall on both sides) and
# scikit-learn's metrics over the labels.
MODULE = f'''
import keyword
import seqio, sklearn.metrics, tensorflow as tf, numpy as np

WORDS = {WORDS!r}

def dataset_fn(split, shuffle_files, seed=None):
  del shuffle_files, seed
  words = WORDS if split == 'validation' else WORDS[:{TEST_WORDS}]
  return tf.data.Dataset.from_tensor_slices({{
      'inputs': ['word: ' + w for w in words],
      'targets': ['keyword' if keyword.iskeyword(w) else 'name' for w in words]}})

def label(text, example=None, is_target=False):
  return len(text) % 2

def sklearn_metrics(targets, predictions):
  return {{'accuracy': sklearn.metrics.accuracy_score(targets, predictions),
          'f1': sklearn.metrics.f1_score(targets, predictions)}}

def mean_log_likelihood(targets, scores):
  return {{'mean_log_likelihood': float(np.mean(scores))}}

def mean_decode_score(targets, predictions, aux_values):
  return {{'mean_decode_score': float(np.mean(aux_values['scores']))}}

def labels_text(targets, predictions):
  return {{'labels': seqio.metrics.Text(textdata=''.join(str(p) for p in predictions))}}

vocabulary = seqio.ByteVocabulary(extra_ids=100)
seqio.TaskRegistry.add(
    '{TASK}', source=seqio.FunctionDataSource(dataset_fn, splits=('validation', 'test')),
    preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
    output_features={{'inputs': seqio.Feature(vocabulary), 'targets': seqio.Feature(vocabulary)}},
    postprocess_fn=label,
    metric_fns=[sklearn_metrics, mean_log_likelihood, mean_decode_score, labels_text])
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  (tmp_path / 'keyword_tasks.py').write_text(MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys.modules['__main__'], 'evaluate', eval_main.evaluate, raising=False)
  yield 'keyword_tasks'
  gin.clear_config(clear_constants=True)


def _argv(checkpoint, module, *flags):
  return ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/eval.gin',
          f"--gin.CHECKPOINT_PATH='{checkpoint}'", f"--gin.MIXTURE_OR_TASK_NAME='{TASK}'",
          f"--gin.MIXTURE_OR_TASK_MODULE='{module}'", f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}',
          '--gin.BATCH_SIZE=8', '--gin.EVAL_DECODE_BATCHES=0', *BYTE_T5_FLAGS, *flags]


def _reference(reference):
  """transformers' greedy predictions and target log-likelihoods on the task's examples ->
  the metrics computed by scikit-learn."""
  import sklearn.metrics  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  encode = lambda text: [b + 3 for b in text.encode()] + [1]    # ByteVocabulary, then EOS
  decode = lambda ids: bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors='ignore')
  labels, predicted, scores, decode_scores = [], [], [], []
  for word in WORDS:
    target = 'keyword' if keyword.iskeyword(word) else 'name'
    with torch.no_grad():
      out = reference.generate(input_ids=torch.tensor([encode('word: ' + word)]),
                               max_new_tokens=LENGTHS['targets'], decoder_start_token_id=0,
                               eos_token_id=1, pad_token_id=0, num_beams=1,
                               do_sample=False)[0, 1:].tolist()
      ids = out[:out.index(1)] if 1 in out else out
      decoded = out[:out.index(1) + 1] if 1 in out else out    # EOS scored with the decode
      logits = reference(input_ids=torch.tensor([encode('word: ' + word)]),
                         decoder_input_ids=torch.tensor([[0] + decoded[:-1]])).logits
      decode_scores.append(float(torch.log_softmax(logits.double(), -1)[0].gather(
          -1, torch.tensor(decoded)[:, None]).sum()))
      labels_ids = torch.tensor([encode(target)])
      logits = reference(input_ids=torch.tensor([encode('word: ' + word)]),
                         decoder_input_ids=torch.tensor([[0] + encode(target)[:-1]])).logits
      log_probs = torch.log_softmax(logits.double(), -1)[0]
      scores.append(float(log_probs.gather(-1, labels_ids[0][:, None]).sum()))
    labels.append(len(target) % 2)
    predicted.append(len(decode(ids)) % 2)
  return {f'{TASK}/accuracy': sklearn.metrics.accuracy_score(labels, predicted),
          f'{TASK}/f1': sklearn.metrics.f1_score(labels, predicted),
          f'{TASK}/mean_log_likelihood': float(np.mean(scores)),
          f'{TASK}/mean_decode_score': float(np.mean(decode_scores))}, predicted


def test_eval_runs_the_tasks_metric_functions_on_transformers_predictions(
    byte_vocab_t5, user_module, tmp_path):
  directory, reference = byte_vocab_t5
  out = tmp_path / 'eval'
  results = gin_utils.run(eval_main.evaluate, _argv(directory, user_module,
                                                   f"--gin.EVAL_OUTPUT_DIR='{out}'"), 'test')
  expected, predicted = _reference(reference)
  assert 0 < sum(predicted) < len(predicted)    # the predictions fall on both labels
  assert results['decoded_examples'] == 24
  for name, value in expected.items():
    assert results[name] == pytest.approx(value, rel=1e-4), name
  assert results[f'{TASK}/labels'] == ''.join(str(p) for p in predicted)   # a seqio Text
  rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
  assert len(rows) == 1 and rows[0]['split'] == 'eval' and rows[0]['step'] == 0
  assert rows[0][f'{TASK}/f1'] == pytest.approx(expected[f'{TASK}/f1'])
  assert rows[0][f'{TASK}/labels'] == results[f'{TASK}/labels']
  assert json.loads((out / 'eval_results.json').read_text())[f'{TASK}/accuracy'] == (
      results[f'{TASK}/accuracy'])
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  logged = {}
  for path in glob.glob(os.path.join(out, 'tensorboard', 'eval', 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        logged[value.tag] = array.item().decode() if array.dtype == object else float(array)
  assert logged[f'{TASK}/labels'] == results[f'{TASK}/labels']
  assert logged[f'{TASK}/mean_log_likelihood'] == pytest.approx(
      expected[f'{TASK}/mean_log_likelihood'], rel=1e-4)


def test_eval_split_evaluates_another_split_of_the_task(byte_vocab_t5, user_module):
  """T5X's DatasetConfig.split: EVAL_SPLIT is the split of the loss and of the decodes."""
  results = gin_utils.run(eval_main.evaluate, _argv(byte_vocab_t5[0], user_module,
                                                    "--gin.EVAL_SPLIT='test'"), 'test')
  assert results['decoded_examples'] == TEST_WORDS


def test_a_split_the_task_lacks_is_one_line_naming_its_splits(byte_vocab_t5, user_module):
  with pytest.raises(SystemExit) as refused:
    eval_main.main(_argv(byte_vocab_t5[0], user_module, "--gin.EVAL_SPLIT='train'"))
  assert refused.value.code == (
      f"error: text.TextPipeline.split = 'train': the task '{TASK}' has the splits "
      "('validation', 'test'). Fix: one of those (python -m upcycle.eval: "
      '--gin.EVAL_SPLIT="\'<split>\'").')
