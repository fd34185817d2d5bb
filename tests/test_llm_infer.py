"""`python -m upcycle.infer` with a decoder-only Llama (runs/llm_infer.gin): the prompts of a
JSONL file, or the first window of each document of a task split, tokenized with the
checkpoint's own tokenizer and continued; the JSONL holds what `decoding.llama`'s decode
function gives on the same prompts, its text the tokenizer's decoding of those tokens.

The checkpoint: an HF Llama of models/llama/tiny.gin's shape at 2 layers, weights perturbed,
saved with the offline BPE's tokenizer files beside it (BOS 1, EOS 2, in config.json)."""

import json
import os
import re

import gin
import jax
import numpy as np
import pytest

from tests import hf_files
from upcycle import pretrained
from upcycle import infer as infer_main
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.data.prompts import Prompts
from upcycle.decoding import DecodeConfig
from upcycle.decoding import llama as llama_decoding
from upcycle.models import Llama
from upcycle.predictions import through_eos

PROMPTS = ['def main():', 'import os\n', 'class Point:\n    """A point."""\n    x = 0']
LENGTH = 16
NEW = 6


@pytest.fixture(scope='module')
def hf_llama_with_tokenizer(tmp_path_factory):
  import transformers  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path_factory.mktemp('llama_bpe'))
  hf_files.save_perturbed(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
      directory)
  tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).save(directory)
  return directory


@pytest.fixture
def infer(entry_points, tmp_path):  # pylint: disable=unused-argument
  """Runs `python -m upcycle.infer` in process on the checkpoint with `flags`; returns (path,
  records)."""

  def run(checkpoint, *flags):
    try:
      path = infer_main.main([
          '--gin_file=models/llama/tiny.gin', '--gin_file=runs/llm_infer.gin',
          '--gin_file=data/offline_stdlib_lm.gin', f"--gin.CHECKPOINT_PATH='{checkpoint}'",
          f"--gin.MODEL_DIR='{tmp_path}'", '--gin.models.LlamaConfig.num_layers=2',
          f"--gin.TASK_FEATURE_LENGTHS={{'targets': {LENGTH}}}", '--gin.BATCH_SIZE=2',
          f'--gin.MAX_DECODE_LENGTH={NEW}', *flags])
    finally:
      gin.clear_config(clear_constants=True)
    with open(path) as f:
      return path, [json.loads(line) for line in f]

  return run


def _ours(directory, prompts, config, batch_size, rng):
  """Our decode of the first `batch_size` prompts as one batch: continuations through EOS."""
  params, model_config = pretrained.load_hf(directory)
  batch = next(prompts.batches(batch_size))
  decode = llama_decoding.make_decode_fn(Llama(model_config), config, NEW)
  tokens, _ = decode(jax.tree.map(np.asarray, params), batch['prompt_tokens'],
                     batch['prompt_mask'], rng)
  return [through_eos(row, config.eos_id) for row in np.asarray(tokens)]


def test_prompts_file_is_continued_as_our_decode_does(hf_llama_with_tokenizer, infer, tmp_path,
                                                      capsys):
  directory = hf_llama_with_tokenizer
  prompts_file = tmp_path / 'prompts.jsonl'
  prompts_file.write_text(''.join(json.dumps({'prompt': p}) + '\n' for p in PROMPTS))
  path, records = infer(directory, f"--gin.PROMPTS_FILE='{prompts_file}'")
  assert capsys.readouterr().out.splitlines()[-1] == (
      f'Wrote 3 predictions (greedy) of checkpoint {directory} (hf, no step) to {path}')
  assert re.fullmatch(re.escape(os.path.join(str(tmp_path), 'inference', '')) +
                      r'prompts-0-greedy-[0-9a-f]{8}\.jsonl', path)
  tokenizer = tokenizer_lib.load(directory)
  prompts = Prompts('offline_stdlib_text', 'validation', {'targets': LENGTH}, directory,
                    prompts_file=str(prompts_file))
  # All 3 in one batch (infer decodes 2, then 1 padded to 2): rows do not depend on each other.
  expected = _ours(directory, prompts, DecodeConfig(eos_id=tokenizer.eos_id), 3, None)
  assert [r['prompt'] for r in records] == PROMPTS
  for record, text, tokens in zip(records, PROMPTS, expected):
    assert set(record) == {'prompt', 'prediction', 'score', 'prompt_tokens', 'prediction_tokens',
                           'checkpoint'}
    assert record['checkpoint'] == {'path': directory, 'format': 'hf', 'step': None}
    assert record['prompt_tokens'] == [tokenizer.bos_id, *tokenizer.encode(text)]
    assert record['prediction_tokens'] == tokens and tokens
    assert record['prediction'] == tokenizer.decode(tokens)
    assert record['score'] < 0
  assert len({tuple(r['prediction_tokens']) for r in records}) > 1
  # Another file of the same name, other prompts: another output, the first one kept.
  other = tmp_path / 'other' / 'prompts.jsonl'
  other.parent.mkdir()
  other.write_text(json.dumps({'prompt': PROMPTS[0][::-1]}) + '\n')
  other_path, other_records = infer(directory, f"--gin.PROMPTS_FILE='{other}'")
  assert other_path != path and sorted(os.listdir(os.path.dirname(path))) == sorted(
      map(os.path.basename, (path, other_path)))
  assert [r['prompt'] for r in other_records] == [PROMPTS[0][::-1]]


def test_a_task_splits_first_windows_are_sampled_as_our_decode_does(hf_llama_with_tokenizer,
                                                                    infer):
  """Without a prompts file: the first window of each validation document, one batch of 2;
  top-k and top-p sampling with the seed's first batch key."""
  import seqio  # pylint: disable=g-import-not-at-top
  directory = hf_llama_with_tokenizer
  path, records = infer(directory, '--gin.INFER_BATCHES=1',
                        "--gin.decoding.DecodeConfig.method='sample'",
                        '--gin.decoding.DecodeConfig.topk=20',
                        '--gin.decoding.DecodeConfig.topp=0.9')
  assert re.fullmatch(r'offline_stdlib_text-0-sample-t1-top20-topp0\.9-seed0-[0-9a-f]{8}\.jsonl',
                      os.path.basename(path))
  tokenizer = tokenizer_lib.load(directory)
  documents = seqio.get_mixture_or_task('offline_stdlib_text').source.get_dataset(
      split='validation', shuffle=False).take(2).as_numpy_iterator()
  windows = [[tokenizer.bos_id, *tokenizer.encode(d['text'].decode())][:LENGTH]
             for d in documents]
  assert [r['prompt_tokens'] for r in records] == windows
  assert [r['prompt'] for r in records] == [tokenizer.decode(w) for w in windows]
  config = DecodeConfig(method='sample', topk=20, topp=0.9, eos_id=tokenizer.eos_id)
  prompts = Prompts('offline_stdlib_text', 'validation', {'targets': LENGTH}, directory)
  expected = _ours(directory, prompts, config, 2, jax.random.fold_in(jax.random.PRNGKey(0), 0))
  assert [r['prediction_tokens'] for r in records] == expected
  assert [r['prediction'] for r in records] == [tokenizer.decode(t) for t in expected]


def test_a_prompt_too_long_no_prompts_file_or_t5x_rows_are_refused_in_one_line(
    hf_llama_with_tokenizer, infer, tmp_path):
  prompts_file = tmp_path / 'long.jsonl'
  prompts_file.write_text(json.dumps({'prompt': 'x = 1\n' * 40}) + '\n')
  with pytest.raises(SystemExit) as stopped:
    infer(hf_llama_with_tokenizer, f"--gin.PROMPTS_FILE='{prompts_file}'")
  message = str(stopped.value)
  assert message.startswith(f'error: {prompts_file}:1: the prompt is ') and '\n' not in message
  assert "Fix: --gin.TASK_FEATURE_LENGTHS=\"{'targets': " in message
  assert not (tmp_path / 'inference').exists()   # refused before the checkpoint is read
  with pytest.raises(SystemExit) as stopped:
    infer(hf_llama_with_tokenizer, f"--gin.PROMPTS_FILE='{tmp_path / 'missing.jsonl'}'")
  assert str(stopped.value) == (
      f"error: PROMPTS_FILE = '{tmp_path / 'missing.jsonl'}' (prompts.Prompts.prompts_file): no "
      'such file. Fix: give a JSONL file of {"prompt": "..."} lines.')
  with pytest.raises(SystemExit) as stopped:
    infer(hf_llama_with_tokenizer, "--gin.upcycle.infer.infer.t5x_mode='predict'")
  assert str(stopped.value) == (
      "error: T5X_MODE (infer_script.infer.t5x_mode) = 'predict': T5X's rows are of a task's "
      "examples; continued prompts (runs/llm_infer.gin) are written in this project's rows: "
      'bind T5X_MODE = None.')


def test_another_tokenizer_or_a_prompts_file_that_is_no_text_is_refused_in_one_line(
    hf_llama_with_tokenizer, infer, tmp_path, monkeypatch):
  """Each refused in one line before any parameter is read (a large checkpoint takes minutes)."""
  from tests import helpers  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pretrained, 'on_mesh', lambda *args, **kwargs: pytest.fail('parameters read'))
  swapped = helpers.save_swapped_tokenizer(tokenizer_lib.load(hf_llama_with_tokenizer),
                                           str(tmp_path / 'swapped'))
  digest = lambda spec: tokenizer_lib.load(spec).short_digest
  latin1, surrogate = tmp_path / 'latin1.jsonl', tmp_path / 'surrogate.jsonl'
  latin1.write_bytes(b'{"prompt": "caf\xe9"}\n')
  surrogate.write_text('{"prompt": "ab\\ud800"}\n')
  for flags, error in (
      ([f"--gin.TOKENIZER='{swapped}'"],
       f'TOKENIZER (prompts.Prompts.tokenizer) reads {swapped} (tokenizer digest '
       f'{digest(swapped)}), but the weights of {hf_llama_with_tokenizer} were trained with '
       f'tokenizer {digest(hf_llama_with_tokenizer)} (the tokenizer files in '
       f"{hf_llama_with_tokenizer}): they would read another tokenizer's ids. Fix: TOKENIZER = "
       "%CHECKPOINT_PATH (runs/llm_infer.gin's default: the checkpoint's own); a run whose "
       'tokenizer/ was replaced needs the one it was trained with put back.'),
      (['--gin.PROMPTS_FILE=3'],
       'PROMPTS_FILE (prompts.Prompts.prompts_file) = 3: expected the path of a JSONL file (a '
       "string), or None for the task's documents."),
      ([f"--gin.PROMPTS_FILE='{latin1}'"],
       f"{latin1}:1: not UTF-8 (invalid continuation byte at byte 16 of the line). Fix: write "
       'the file as UTF-8.'),
      ([f"--gin.PROMPTS_FILE='{surrogate}'"],
       f"{surrogate}:1: the prompt holds '\\ud800' at character 3, half of a UTF-16 surrogate "
       'pair, which is no text. Fix: escape whole characters (\\ud83d\\ude00), or write them '
       'as UTF-8.')):
    with pytest.raises(SystemExit) as stopped:
      infer(hf_llama_with_tokenizer, *flags)
    assert str(stopped.value) == f'error: {error}'
  # upcycle.eval of the same checkpoint on text tokenized by the swapped tokenizer
  # pylint: disable=g-import-not-at-top
  from upcycle import eval as eval_lib
  from upcycle.data.lm import LmPipeline
  from upcycle.train.objectives import CausalLm
  # pylint: enable=g-import-not-at-top
  _, config = pretrained.load_hf(hf_llama_with_tokenizer, lazy=True)
  with pytest.raises(tokenizer_lib.TokenizerError, match='^TOKENIZER \\(lm.LmPipeline.tokenizer\\) '
                     f'reads {swapped} .* were trained with tokenizer '
                     f'{digest(hf_llama_with_tokenizer)} '):
    eval_lib.evaluate(objective=CausalLm(Llama(config)), batch_size=2,
                      eval_data=LmPipeline('offline_stdlib_text', 'validation', {'targets': 16},
                                           tokenizer=swapped),
                      checkpoint_path=hf_llama_with_tokenizer)
