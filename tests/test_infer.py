"""`python -m upcycle.infer` (in process, as gin_utils.run runs it) writes T5X-style JSONL on
the offline task whose predictions are transformers' greedy `generate` for the same inputs;
`upcycle.eval`'s sequence accuracy decodes the same split; under a run's 'fsdp' rules both
place the parameters split over 'data' and give the numbers of 'default'. gs:// outputs of
both land on the GCS emulator, an unreachable GCS stops in bounded time with one line, an
empty split is one line with no partial file left, and decoding reports its progress."""

import json
import os
import re
import socket
import time
import urllib.parse
import urllib.request

import gin
import pytest

from tests.helpers import byte_t5_argv, refusal
from upcycle import convert, export
from upcycle import eval as eval_main
from upcycle import gin_utils
from upcycle import infer as infer_main
from upcycle import describe as describe_main
from upcycle import predictions, progress, reachability
from upcycle.data import iterator


def test_infer_writes_jsonl_with_hf_greedy_predictions(byte_vocab_t5, tmp_path, entry_points,
                                                       capsys):
  directory, reference = byte_vocab_t5
  argv = byte_t5_argv('infer', directory, f"--gin.MODEL_DIR='{tmp_path}'",
                      '--gin.BATCH_SIZE=3', '--gin.INFER_BATCHES=2')
  path = gin_utils.run(infer_main.infer, argv, 'test')
  assert re.fullmatch(re.escape(os.path.join(str(tmp_path), 'inference', '')) +
                      r'offline_span_corruption-0-greedy-[0-9a-f]{8}\.jsonl', path)
  assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
  assert 'infer: 6/6 examples (100%), ' in capsys.readouterr().out   # the progress line
  with open(path) as f:
    records = [json.loads(line) for line in f]
  assert len(records) == 6
  import torch  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  vocabulary = seqio.get_mixture_or_task('offline_span_corruption').output_features[
      'targets'].vocabulary
  for record in records:
    assert set(record) == {'inputs', 'targets', 'prediction', 'score', 'input_tokens',
                           'target_tokens', 'prediction_tokens', 'checkpoint'}
    assert record['checkpoint'] == {'path': directory, 'format': 'hf', 'step': None}
    assert record['inputs'] == vocabulary.decode(record['input_tokens']) and record['inputs']
    # span corruption's targets are spans of the text, not its targets_pretokenized
    assert record['targets'] == vocabulary.decode(record['target_tokens'])
    with torch.no_grad():
      hf = reference.generate(input_ids=torch.tensor([record['input_tokens']]),
                              max_new_tokens=8, decoder_start_token_id=0, eos_token_id=1,
                              pad_token_id=0, num_beams=1, do_sample=False)[0, 1:].tolist()
    hf = hf[:hf.index(0)] if 0 in hf else hf
    assert record['prediction_tokens'] == hf
    assert record['score'] < 0


LONG_TASK = 'long_texts'
LONG_TEXTS = {'inputs': ['translate: ' + 'abc' * 20, 'translate: short', 'translate: ' + 'xy' * 30],
              'targets': ['a target longer than eight bytes', 'tgt', 'another long target text']}


@pytest.fixture
def long_texts_task():
  """A seq2seq task over ByteVocabulary whose texts are longer than BYTE_T5_LENGTHS, its
  preprocessors keeping the texts (`tokenize`) as T5's tasks do."""
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  vocabulary = seqio.ByteVocabulary(extra_ids=100)
  seqio.TaskRegistry.add(
      LONG_TASK, source=seqio.FunctionDataSource(
          lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(LONG_TEXTS),
          splits=('validation',)),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      output_features={'inputs': seqio.Feature(vocabulary), 'targets': seqio.Feature(vocabulary)})
  yield LONG_TASK
  seqio.TaskRegistry.remove(LONG_TASK)


def _hf_greedy(reference, input_tokens):
  """transformers' greedy decode of 8 tokens (padding after EOS) and its log-likelihood, EOS
  included (this project's and T5X's decode score)."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    out = reference.generate(input_ids=torch.tensor([input_tokens]), max_new_tokens=8,
                             decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
                             num_beams=1, do_sample=False)[0, 1:].tolist()
    decoded = out[:out.index(1) + 1] if 1 in out else out
    logits = reference(input_ids=torch.tensor([input_tokens]),
                       decoder_input_ids=torch.tensor([[0] + decoded[:-1]])).logits
  score = float(torch.log_softmax(logits.double(), -1)[0].gather(
      -1, torch.tensor(decoded)[:, None]).sum())
  return out + [0] * (8 - len(out)), score


def _hf_target_log_likelihood(reference, input_tokens, target_tokens):
  """transformers' log-likelihood of `target_tokens` with the reference fed back (T5X's
  `score_batch`)."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    logits = reference(input_ids=torch.tensor([input_tokens]),
                       decoder_input_ids=torch.tensor([[0] + target_tokens[:-1]])).logits
  return float(torch.log_softmax(logits.double(), -1)[0].gather(
      -1, torch.tensor(target_tokens)[:, None]).sum())


def test_infer_writes_t5x_rows_and_whole_targets(byte_vocab_t5, long_texts_task, entry_points,
                                                 tmp_path):
  import seqio  # pylint: disable=g-import-not-at-top
  directory, reference = byte_vocab_t5
  task = seqio.get_mixture_or_task(long_texts_task)
  examples = list(task.get_dataset({'inputs': 32, 'targets': 8}, split='validation',
                                   shuffle=False).as_numpy_iterator())
  vocabulary = task.output_features['targets'].vocabulary
  rows = {}
  for mode in ('None', "'predict_with_aux'", "'predict'", "'score'"):
    gin.clear_config(clear_constants=True)
    path = gin_utils.run(infer_main.infer, byte_t5_argv(
        'infer', directory, f"--gin.MODEL_DIR='{tmp_path}'", '--gin.BATCH_SIZE=2',
        f"--gin.MIXTURE_OR_TASK_NAME='{long_texts_task}'", f'--gin.T5X_MODE={mode}'), 'test')
    with open(path) as f:
      rows[mode] = (path, [json.loads(line) for line in f])
  assert rows["'predict'"][0].endswith('.jsonl') and '-greedy-t5x_predict-' in rows["'predict'"][0]
  assert '-t5x_score-' in rows["'score'"][0]
  assert len({path for path, _ in rows.values()}) == 4   # each its own file
  assert len(examples) == 3 == len(rows['None'][1])
  for i, example in enumerate(examples):
    tokens, score = _hf_greedy(reference, example['inputs'].tolist())
    until_padding = tokens[:tokens.index(0)] if 0 in tokens else tokens
    texts = {k: v.decode() for k, v in example.items() if k.endswith('_pretokenized')}
    assert set(texts) == {'inputs_pretokenized', 'targets_pretokenized'}
    t5x = {'inputs': texts, 'prediction': vocabulary.decode(tokens),
           'prediction_tokens': until_padding}
    aux = rows["'predict_with_aux'"][1][i]
    assert aux.pop('aux')['scores'] == pytest.approx(score, rel=1e-4)
    assert aux == t5x
    assert rows["'predict'"][1][i] == t5x
    scored = rows["'score'"][1][i]
    assert scored.pop('score') == pytest.approx(_hf_target_log_likelihood(
        reference, example['inputs'].tolist(), example['targets'].tolist()), rel=1e-4)
    assert scored == {'inputs': texts}
    own = rows['None'][1][i]
    assert own['targets'] == LONG_TEXTS['targets'][i]   # whole, as seqio keeps it
    assert own['target_tokens'] == example['targets'].tolist()   # truncated, as decoded
    assert own['inputs'] == vocabulary.decode(example['inputs'].tolist())
  assert len(rows['None'][1][0]['target_tokens']) == 8 < len(LONG_TEXTS['targets'][0])


def test_eval_sequence_accuracy_counts_exact_matches(byte_vocab_t5):
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.data.text import TextPipeline  # pylint: disable=g-import-not-at-top
  from upcycle.decoding import DecodeConfig  # pylint: disable=g-import-not-at-top
  from upcycle.models import T5  # pylint: disable=g-import-not-at-top
  from upcycle import partitioning  # pylint: disable=g-import-not-at-top
  params, config = pretrained.load_hf(byte_vocab_t5[0])
  pipeline = TextPipeline('offline_span_corruption', 'validation',
                          {'inputs': 32, 'targets': 8}, pack=False, shuffle=False)
  records, result, scores = predictions.decoded_split(
      T5(config), params, pipeline, DecodeConfig(), batch_size=3, mesh=partitioning.make_mesh(),
      max_batches=2, seed=0)
  assert result['decoded_examples'] == len(records) == 6
  assert result['sequence_accuracy'] == 0.0   # a random model reproduces no span
  assert scores is None   # not asked for


def _placed(monkeypatch):
  """The parameters that each `pretrained.on_mesh` call of the test places, in order."""
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  placed, on_mesh = [], pretrained.on_mesh

  def spy(*args, **kwargs):
    placed.append(on_mesh(*args, **kwargs))
    return placed[-1]

  monkeypatch.setattr(pretrained, 'on_mesh', spy)
  return placed


def _shard_shapes(params):
  """{the shape each device holds} of the embedding `[vocab, d_model]` and an MLP input
  kernel `[d_model, d_ff]`."""
  return [{shard.data.shape for shard in x.addressable_shards}
          for x in (params['token_embedder']['embedding'],
                    params['encoder']['layers_0']['mlp']['wi_0']['kernel'])]


def test_eval_and_infer_place_the_parameters_by_the_runs_logical_axis_rules(
    byte_vocab_t5, entry_points, tmp_path, monkeypatch):
  """LOGICAL_AXIS_RULES='fsdp', as a run trained with it binds it, splits every d_model axis
  over 'data' (each of the 8 devices holds 1 of the 8 columns), where 'default' replicates
  it; the loss and the decoded rows are the same."""
  directory, _ = byte_vocab_t5
  placed = _placed(monkeypatch)
  results, rows = {}, {}
  for rules in ('default', 'fsdp'):
    gin.clear_config(clear_constants=True)
    results[rules] = gin_utils.run(eval_main.evaluate, byte_t5_argv(
        'eval', directory, '--gin.BATCH_SIZE=8', '--gin.EVAL_BATCHES=1',
        '--gin.upcycle.eval.evaluate.decode_data=None', f"--gin.LOGICAL_AXIS_RULES='{rules}'"),
        'test')
    gin.clear_config(clear_constants=True)
    path = gin_utils.run(infer_main.infer, byte_t5_argv(
        'infer', directory, f"--gin.MODEL_DIR='{tmp_path / rules}'", '--gin.BATCH_SIZE=8',
        '--gin.INFER_BATCHES=1', f"--gin.LOGICAL_AXIS_RULES='{rules}'"), 'test')
    with open(path) as f:
      rows[rules] = [json.loads(line) for line in f]
  assert [_shard_shapes(params) for params in placed] == [
      [{(384, 8)}, {(8, 12)}]] * 2 + [[{(384, 1)}, {(1, 12)}]] * 2
  loss = results['default']['loss']
  assert results['fsdp'] == {**results['default'], 'loss': pytest.approx(loss, rel=1e-5)}
  scores = [[row.pop('score') for row in rows[rules]] for rules in ('default', 'fsdp')]
  assert scores[1] == pytest.approx(scores[0], rel=1e-5)
  assert rows['fsdp'] == rows['default'] and len(rows['default']) == 8



def test_eval_reports_what_the_loss_owes_to_the_input(byte_vocab_t5, entry_points):
  """other_row_inputs: the swapped pass runs over the batches of the loss it is compared with,
  so the two losses differ by exactly input_use."""
  directory, _ = byte_vocab_t5
  results = gin_utils.run(eval_main.evaluate, byte_t5_argv(
      'eval', directory, '--gin.BATCH_SIZE=8', '--gin.EVAL_BATCHES=2',
      '--gin.upcycle.eval.evaluate.decode_data=None',
      '--gin.upcycle.eval.evaluate.other_row_inputs=True'), 'test')
  assert results['batches'] == 2 and results['input_use_stderr'] > 0
  assert results['other_row_inputs/loss'] - results['loss'] == pytest.approx(
      results['input_use'], abs=1e-6)
  assert results['other_row_inputs/loss'] != pytest.approx(results['loss'], abs=1e-4)


@pytest.mark.parametrize('main, script, flags', [
    (eval_main.main, 'eval_script.evaluate', ()),
    (infer_main.main, 'infer_script.infer', ("--gin.MODEL_DIR='{tmp_path}'",))])
def test_partitions_that_do_not_divide_a_parameter_are_named_in_one_line(
    main, script, flags, byte_vocab_t5, entry_points, tmp_path, capsys):
  """The byte T5's MLP kernels are [8, 12] ('embed', 'mlp'); 8 model partitions do not divide
  12, and the setting to change is named before anything is read onto the mesh."""
  directory, _ = byte_vocab_t5
  message = refusal(main, byte_t5_argv(
      script.split('_')[0], directory, *(f.format(tmp_path=tmp_path) for f in flags),
      '--gin.BATCH_SIZE=8', '--gin.NUM_MODEL_PARTITIONS=8'), capsys)
  assert message == (
      "error: decoder/layers_0/mlp/wi_0/kernel has 12 along 'mlp', "
      f'split over NUM_MODEL_PARTITIONS ({script}.num_model_partitions) = 8, which does not '
      "divide it. Fix: make its 'mlp' size a multiple of 8, or NUM_MODEL_PARTITIONS "
      f'({script}.num_model_partitions) a divisor of 12.')

def _gcs_object(gcs_emulator, url: str) -> bytes:
  """gs://`url`'s bytes, read from the emulator's JSON API (not through the code under test)."""
  bucket, _, name = url[len('gs://'):].partition('/')
  return urllib.request.urlopen(f"{gcs_emulator['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}"
                                f"/o/{urllib.parse.quote(name, safe='')}?alt=media").read()


@pytest.mark.slow
def test_gs_outputs_of_infer_and_eval_land_on_gcs(byte_vocab_t5, entry_points, on_gcs, tmp_path,
                                                  monkeypatch):
  monkeypatch.chdir(tmp_path)   # where a local ./gs:/ folder would appear
  directory, _ = byte_vocab_t5
  path = gin_utils.run(infer_main.infer, byte_t5_argv(
      'infer', directory, "--gin.MODEL_DIR='gs://bucket/infer'", '--gin.BATCH_SIZE=3',
      '--gin.INFER_BATCHES=1'), 'test')
  assert re.fullmatch(r'gs://bucket/infer/inference/offline_span_corruption-0-greedy-'
                      r'[0-9a-f]{8}\.jsonl', path)
  records = [json.loads(line) for line in _gcs_object(on_gcs, path).decode().splitlines()]
  assert len(records) == 3 and records[0]['prediction_tokens']
  listing = json.load(urllib.request.urlopen(
      f"{on_gcs['STORAGE_EMULATOR_HOST']}/storage/v1/b/bucket/o?prefix=infer/"))
  assert [o['name'] for o in listing['items']] == [path[len('gs://bucket/'):]]   # no .tmp
  gin.clear_config(clear_constants=True)
  results = gin_utils.run(eval_main.evaluate, byte_t5_argv(
      'eval', directory, "--gin.EVAL_OUTPUT_DIR='gs://bucket/eval'",
      '--gin.BATCH_SIZE=8', '--gin.upcycle.eval.evaluate.eval_batches=1',
      '--gin.EVAL_DECODE_BATCHES=1',
      '--gin.upcycle.eval.evaluate.tensorboard=False'), 'test')   # TF's GCS: not the emulator
  assert json.loads(_gcs_object(on_gcs, 'gs://bucket/eval/eval_results.json')) == results
  (row,) = [json.loads(line) for line in _gcs_object(
      on_gcs, 'gs://bucket/eval/metrics.jsonl').decode().splitlines()]
  assert row == {'step': 0, 'split': 'eval', **{
      k: v for k, v in results.items() if k not in ('checkpoint', 'format', 'step')}}
  assert results['decoded_examples'] == 8
  assert os.listdir(tmp_path) == []   # nothing written locally


@pytest.fixture
def unreachable_gcs(on_gcs, monkeypatch):  # pylint: disable=redefined-outer-name,unused-argument
  """GCS at a port nothing listens on, waited for 2 s."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    closed = f'http://127.0.0.1:{s.getsockname()[1]}'
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', closed)
  monkeypatch.setenv(reachability.TIMEOUT_ENV, '2')


def test_an_unreachable_gcs_fails_in_bounded_time_with_one_line(entry_points, unreachable_gcs,
                                                                capfd):
  began = time.time()
  with pytest.raises(SystemExit) as stopped:
    gin_utils.run(infer_main.infer, byte_t5_argv('infer', '/nonexistent',
                                                 "--gin.MODEL_DIR='gs://bucket/run'"), 'test')
  assert time.time() - began < 10
  assert str(stopped.value) == (
      'MODEL_DIR=gs://bucket/run: gs://bucket did not answer within 2 s; check the network and '
      'the credentials: `gcloud auth application-default login` here, or on a VM a service '
      'account that may read and write the bucket (UPCYCLE_GCS_TIMEOUT_SECONDS sets the wait).')
  said = [line for line in capfd.readouterr().err.splitlines()   # TensorFlow's first import
          if not line.startswith(('WARNING: All log messages', 'I0000', 'W0000', 'E0000'))]
  assert said == []   # the storage client's retries say nothing


@pytest.mark.slow
@pytest.mark.parametrize('tool, argv, flag', [
    (convert.main, ['--source=gs://bucket/dense', '--output_dir=/nonexistent/moe',
                    '--gin_file=models/t5_1_1/tiny.gin'], '--source=gs://bucket/dense'),
    (export.main, ['--model_dir=gs://bucket/run', '--output_dir=/nonexistent/t5x'],
     '--model_dir=gs://bucket/run'),
    (describe_main.main, ['gs://bucket/run/checkpoints/4', '--verify'],
     'path=gs://bucket/run/checkpoints/4'),
])
def test_the_checkpoint_tools_stop_in_bounded_time_on_an_unreachable_gcs(
    tool, argv, flag, unreachable_gcs, capsys):
  began = time.time()
  assert tool(argv) == 1
  assert time.time() - began < 10
  assert capsys.readouterr().err == (
      f'error: {flag}: gs://bucket did not answer within 2 s; check the network and the '
      'credentials: `gcloud auth application-default login` here, or on a VM a service account '
      'that may read and write the bucket (UPCYCLE_GCS_TIMEOUT_SECONDS sets the wait).\n')


def test_a_bucket_that_does_not_exist_is_named(entry_points, on_gcs):
  with pytest.raises(SystemExit) as stopped:
    gin_utils.run(infer_main.infer, byte_t5_argv(
        'infer', '/nonexistent', "--gin.MODEL_DIR='gs://no-such-bucket/out'"), 'test')
  assert str(stopped.value) == (
      'MODEL_DIR=gs://no-such-bucket/out: the bucket gs://no-such-bucket does '
      'not exist or these credentials cannot see it; check its name and that the account may '
      'read and write it.')


def test_infer_on_an_empty_split_says_so_and_leaves_no_partial_file(byte_vocab_t5, entry_points,
                                                                    tmp_path):
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top
  tasks.add_span_corruption_task(
      'empty_span_corruption', seqio.FunctionDataSource(
          lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(
              {'text': tf.constant([], tf.string)}), splits=('validation',)),
      seqio.ByteVocabulary(extra_ids=100))
  try:
    with pytest.raises(SystemExit) as stopped:
      gin_utils.run(infer_main.infer, byte_t5_argv(
          'infer', byte_vocab_t5[0], f"--gin.MODEL_DIR='{tmp_path}'",
          "--gin.MIXTURE_OR_TASK_NAME='empty_span_corruption'"), 'test',
                    expected=(iterator.EmptySplit,))
  finally:
    seqio.TaskRegistry.remove('empty_span_corruption')
  assert str(stopped.value) == (
      "error: {'kind': 'text', 'task': 'empty_span_corruption', 'split': 'validation', "
      "'feature_lengths': {'inputs': 32, 'targets': 8}, 'pack': False, 'shuffle': False} has no "
      'examples on shard 0 of 1: check the task, its split and where its data is read '
      '(TFDS_DATA_DIR).')
  assert os.listdir(tmp_path / 'inference') == []   # no partial file or lock left behind


def test_progress_lines_count_rate_and_time_left():
  now = [0.0]
  done = progress.Progress('infer', 'examples', total=200, every=10, clock=lambda: now[0])
  now[0] = 10.0
  done.update(50)
  assert done.line() == 'infer: 50/200 examples (25%), 5.0 examples/s, ETA 0:00:30'
  now[0] = 3700.0
  assert done.line() == 'infer: 50/200 examples (25%), 0.0 examples/s, ETA 3:05:00'
  now[0] = 0.0
  unknown = progress.Progress('infer', 'examples', clock=lambda: now[0])
  now[0] = 4.0
  unknown.update(8)
  assert unknown.line() == 'infer: 8 examples, 2.0 examples/s'


def test_progress_rate_leaves_out_the_start_and_the_last_line_is_logged_once(monkeypatch):
  """60 s before the first unit (compiling), then 10 units/s: the rate and time left are
  those of the work, and a finish right after a logged line does not log it again."""
  now = [0.0]
  done = progress.Progress('convert', 'arrays', total=200, every=10, clock=lambda: now[0])
  for second in range(60, 71):
    now[0] = float(second)
    done.update(10)
  assert done.line() == 'convert: 110/200 arrays (55%), 10.0 arrays/s, ETA 0:00:09'
  logged = []
  monkeypatch.setattr(progress.log, 'info', logged.append)
  now[0] = 80.0
  done.update(90)
  done.finish()
  assert logged == ['convert: 200/200 arrays (100%), 9.5 arrays/s, ETA 0:00:00']
