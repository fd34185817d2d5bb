"""`python -m upcycle.infer` (in process, as gin_utils.run runs it) writes T5X-style JSONL on
the offline task whose predictions are transformers' greedy `generate` for the same inputs;
`upcycle.eval`'s sequence accuracy decodes the same split."""

import json
import os
import sys

import gin
import pytest

from tests import hf_files
from upcycle import eval as eval_main
from upcycle import gin_utils
from upcycle import infer as infer_main

LENGTHS = "{'inputs': 32, 'targets': 8}"


@pytest.fixture(scope='module')
def byte_vocab_t5(tmp_path_factory):
  """(directory, reference) of a tiny untied HF T5 v1.1 over the offline task's 384 ids."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  config = transformers.T5Config(
      vocab_size=384, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1,
      num_heads=2, feed_forward_proj='gated-gelu', tie_word_embeddings=False, dropout_rate=0.0)
  model = transformers.T5ForConditionalGeneration(config)
  directory = str(tmp_path_factory.mktemp('byte_t5'))
  return directory, hf_files.save_untied_t5(model, directory)


@pytest.fixture
def main_module(monkeypatch):
  monkeypatch.setattr(sys.modules['__main__'], 'infer', infer_main.infer, raising=False)
  yield
  gin.clear_config(clear_constants=True)


def test_infer_writes_jsonl_with_hf_greedy_predictions(byte_vocab_t5, tmp_path, main_module):
  directory, reference = byte_vocab_t5
  argv = ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/infer.gin',
          '--gin_file=data/offline_span_corruption.gin',
          f"--gin.CHECKPOINT_PATH='{directory}'", f"--gin.MODEL_DIR='{tmp_path}'",
          f'--gin.TASK_FEATURE_LENGTHS={LENGTHS}', '--gin.BATCH_SIZE=3',
          '--gin.INFER_BATCHES=2',
          '--gin.models.T5Config.d_model=8', '--gin.models.T5Config.d_ff=12',
          '--gin.models.T5Config.num_heads=2', '--gin.models.T5Config.d_kv=4',
          '--gin.models.T5Config.num_encoder_layers=1',
          '--gin.models.T5Config.num_decoder_layers=1']
  path = gin_utils.run(infer_main.infer, argv, 'test')
  assert path == os.path.join(str(tmp_path), 'inference', 'offline_span_corruption-0.jsonl')
  with open(path) as f:
    records = [json.loads(line) for line in f]
  assert len(records) == 6
  import torch  # pylint: disable=g-import-not-at-top
  vocabulary = infer_main.target_vocabulary('offline_span_corruption')
  for record in records:
    assert set(record) == {'inputs', 'targets', 'prediction', 'score', 'input_tokens',
                           'target_tokens', 'prediction_tokens'}
    assert record['inputs'] == vocabulary.decode(record['input_tokens']) and record['inputs']
    with torch.no_grad():
      hf = reference.generate(input_ids=torch.tensor([record['input_tokens']]),
                              max_new_tokens=8, decoder_start_token_id=0, eos_token_id=1,
                              pad_token_id=0, num_beams=1, do_sample=False)[0, 1:].tolist()
    hf = hf[:hf.index(0)] if 0 in hf else hf
    assert record['prediction_tokens'] == hf
    assert record['score'] < 0


def test_eval_sequence_accuracy_counts_exact_matches(byte_vocab_t5):
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.data.text import TextPipeline  # pylint: disable=g-import-not-at-top
  from upcycle.decoding import DecodeConfig  # pylint: disable=g-import-not-at-top
  from upcycle.models import T5  # pylint: disable=g-import-not-at-top
  params, config = pretrained.load_hf(byte_vocab_t5[0])
  pipeline = TextPipeline('offline_span_corruption', 'validation',
                          {'inputs': 32, 'targets': 8}, pack=False, shuffle=False)
  result = eval_main.sequence_accuracy(T5(config), params, pipeline, DecodeConfig(),
                                       batch_size=3, max_batches=2, seed=0)
  assert result['decoded_examples'] == 6
  assert result['sequence_accuracy'] == 0.0   # a random model reproduces no span
