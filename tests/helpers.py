"""Shared by tests in any folder: the repository root, and the command line of the infer /
eval tests on the `byte_vocab_t5` fixture (tests/conftest.py).

Where shared things live: constants and functions in a `helpers.py` (this one, or the one of
the tests' folder: tests/checkpoints, tests/models, tests/moe, tests/train), fixtures in a
`conftest.py`. A test module imports from those, never from another test module.
"""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The offline task's feature lengths in the infer / eval tests, as a gin value.
BYTE_T5_LENGTHS = "{'inputs': 32, 'targets': 8}"
# byte_vocab_t5's architecture, as gin bindings on models/t5_1_1/tiny.gin.
BYTE_T5_FLAGS = ['--gin.models.T5Config.d_model=8', '--gin.models.T5Config.d_ff=12',
                 '--gin.models.T5Config.num_heads=2', '--gin.models.T5Config.d_kv=4',
                 '--gin.models.T5Config.num_encoder_layers=1',
                 '--gin.models.T5Config.num_decoder_layers=1']


class CountingPipeline:
  """A pipeline (`DataIterator`'s protocol) that counts how often its batches are built: each
  build of a seqio pipeline traces it, seconds."""

  def __init__(self, pipeline):
    self.pipeline, self.reads = pipeline, 0

  def describe(self):
    return self.pipeline.describe()

  def batches(self, **kwargs):
    self.reads += 1
    return self.pipeline.batches(**kwargs)


def refusal(main, argv, capsys):
  """The one line the entry point `main(argv)` exits with (it prints no traceback); gin's
  configuration, which the refused run parsed, is cleared for the next entry point."""
  import gin  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  capsys.readouterr()   # what the fixtures printed
  with pytest.raises(SystemExit) as stopped:
    try:
      main(argv)
    finally:
      gin.clear_config(clear_constants=True)
  assert 'Traceback' not in capsys.readouterr().err
  message = str(stopped.value)
  assert '\n' not in message
  return message


def with_flags(base, *flags):
  """The command-line flags `base` then `flags`, a `--gin.KEY=VALUE` of `flags` replacing
  `base`'s of the same KEY (the command line refuses two values for one binding)."""
  keys = {flag.split('=', 1)[0] for flag in flags if flag.startswith('--gin.')}
  return [flag for flag in base if flag.split('=', 1)[0] not in keys] + list(flags)


def byte_t5_argv(run, checkpoint, *flags):
  """runs/<run>.gin on the offline task with byte_vocab_t5's architecture, and `flags`."""
  return with_flags([
      '--gin_file=models/t5_1_1/tiny.gin', f'--gin_file=runs/{run}.gin',
      '--gin_file=data/offline_span_corruption.gin', f"--gin.CHECKPOINT_PATH='{checkpoint}'",
      f'--gin.TASK_FEATURE_LENGTHS={BYTE_T5_LENGTHS}', *BYTE_T5_FLAGS], *flags)


def save_swapped_tokenizer(tokenizer, directory: str, ids=(2000, 2001)) -> str:
  """Another tokenizer of the same size: `tokenizer`'s files (`upcycle.data.tokenizer`'s, with a
  tokenizer.json) with the pieces of two `ids` swapped in its vocabulary, written to
  `directory`; returns it."""
  data = json.loads(tokenizer.files['tokenizer.json'])
  vocab = data['model']['vocab']
  first, second = (next(piece for piece, i in vocab.items() if i == want) for want in ids)
  vocab[first], vocab[second] = ids[1], ids[0]
  os.makedirs(directory, exist_ok=True)
  for name, content in tokenizer.files.items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(json.dumps(data).encode() if name == 'tokenizer.json' else content)
  return directory
