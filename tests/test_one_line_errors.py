"""Errors a user can cause in `train`, `eval` and `infer` end in one line that names the gin
binding and the fix, and no traceback (--verbose shows it): a source checkpoint that is an
MoE, of another family or another size; feature lengths that are no mapping, or with which
span corruption corrupts nothing or cuts the targets; a binding gin cannot parse (an unquoted
string, an unclosed bracket); experts the expert axis does not divide; a batch the devices do
not divide; a MODEL_DIR that is a file, a dangling link, too long a name, under a file or
inside the source checkpoint; a batch size of 0; a decoder-only run's tokenizer that is no
path, missing from the checkpoint it defaults to, or not shared by merged checkpoints, and a
learning rate that is a string; SFT samples with no template to render them or that are no
JSON. The entry points' mains
run in this process (8 CPU devices), two of them as real processes to show the whole
output."""

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from tests.checkpoints import helpers
from tests.helpers import REPO, refusal, with_flags
from upcycle import eval as eval_main
from upcycle import infer as infer_main
from upcycle.checkpoints import t5x_writer
from upcycle.moe import MoeConfig
from upcycle.train import __main__ as train_main

LENGTHS = "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}"
DATA = '--gin_file=data/offline_span_corruption.gin'
PRETRAIN = ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/pretrain.gin', DATA,
            '--gin.TRAIN_STEPS=2', '--gin.BATCH_SIZE=8', LENGTHS]
UPCYCLE = ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=moe/paper_t5.gin',
           '--gin_file=runs/upcycle.gin', DATA, '--gin.TRAIN_STEPS=2', '--gin.BATCH_SIZE=8',
           LENGTHS, '--gin.NUM_EXPERTS=2']
SOURCE = 'restore.Restore.source (INITIAL_CHECKPOINT_PATH)'


def _fill(text, **paths):
  """`text` with each {name} replaced by paths[name] (str.format would read the lengths)."""
  for name, path in paths.items():
    text = text.replace(f'{{{name}}}', str(path))
  return text


@pytest.fixture(scope='module')
def moe_checkpoint(tmp_path_factory):
  config = dataclasses.replace(helpers.CHECKPOINT_T5, encoder_moe=MoeConfig(num_experts=2))
  return t5x_writer.write(str(tmp_path_factory.mktemp('moe')), 6, helpers.random_params(config))


@pytest.mark.parametrize('source, error', [
    ('moe_checkpoint', 'already an MoE: upcycling starts from a dense checkpoint. Fix: point '
                       f'{SOURCE} at the dense checkpoint, or continue this MoE with '),
    ('hf_vit', f'another model family. Fix: point {SOURCE} at a checkpoint of the model the gin '
               'files build'),
    ('hf_t5', 'Target leaf decoder/decoder_norm/scale has shape (64,) but dense leaf '
              'decoder/decoder_norm/scale has shape (8,). Fix: the MoE model config must match '
              f'the dense one in everything but its MoE blocks (d_model, heads, vocab, classes, '
              f'...). (The checkpoint, {SOURCE}, holds a T5 model, '),
])
def test_a_source_that_cannot_be_upcycled(source, error, request, entry_points, tmp_path,
                                          capsys):
  checkpoint = request.getfixturevalue(source)
  checkpoint = checkpoint if isinstance(checkpoint, str) else checkpoint[0]
  message = refusal(train_main.main, UPCYCLE + [
      f"--gin.INITIAL_CHECKPOINT_PATH='{checkpoint}'", f"--gin.MODEL_DIR='{tmp_path}/run'"],
                     capsys)
  assert message.startswith('error: Restore(') and error in message, message
  assert os.listdir(tmp_path) == []


@pytest.fixture
def paths(tmp_path):
  """A regular file, a dangling symbolic link, and a name too long, in `tmp_path`."""
  (tmp_path / 'notes').write_text('notes\n')
  os.symlink(tmp_path / 'nowhere', tmp_path / 'link')
  return {'file': tmp_path / 'notes', 'link': tmp_path / 'link', 'long': tmp_path / ('q' * 300)}


@pytest.mark.parametrize('flags, error', [
    (['--gin.TASK_FEATURE_LENGTHS=128'],
     "text.TextPipeline.feature_lengths = 128: expected a mapping of 'inputs' and 'targets' to "
     "integers >= 1, such as TASK_FEATURE_LENGTHS = {'inputs': 512, 'targets': 114}."),
    (['--gin.BATCH_SIZE=6'],
     'trainer.TrainConfig.batch_size = 6: expected a multiple of 8, the data x expert mesh axes '
     '(8 x 1) the batch is split over. Fix: --gin.BATCH_SIZE=8 (or another multiple of 8).'),
    (['--gin.trainer.TrainConfig.eval_microbatches=3'],
     'trainer.TrainConfig.eval_microbatches = 3 does not divide BATCH_SIZE (8). Fix: a divisor '
     'of 8.'),
    (['--gin_file=moe/paper_t5.gin', '--gin.NUM_EXPERTS=6',
      '--gin.trainer.TrainConfig.num_expert_partitions=4'],
     "decoder/layers_1/mlp/expert/wi_0/kernel has 6 along 'expert', split over "
     'trainer.TrainConfig.num_expert_partitions = 4, which does not divide it. Fix: make '
     'NUM_EXPERTS a multiple of 4, or trainer.TrainConfig.num_expert_partitions a divisor of 6.'),
    (['--gin_file=moe/paper_t5.gin', "--gin.moe.MoeConfig.router_init='wide'"],
     "moe.MoeConfig.router_init = 'wide': expected one of ('constant', 'width_scaled') or a "
     'router kernel std > 0.'),
    (['--gin_file=moe/paper_t5.gin', '--gin.moe.MoeConfig.router_init=-0.02'],
     'moe.MoeConfig.router_init = -0.02: expected a number > 0.0.'),
    (["--gin.TASK_FEATURE_LENGTHS={'inputs': 4, 'targets': 2}"],
     "text.TextPipeline.feature_lengths = {'inputs': 4, 'targets': 2} (TASK_FEATURE_LENGTHS): "
     'Span corruption with inputs length 4 (noise density 0.15, mean span 3.0) leaves no room '
     'for a corrupted span: the examples would be their text copied, with no sentinel in the '
     "inputs. Set the task feature lengths to at least {'inputs': 10, 'targets': 4}."),
    (["--gin.TASK_FEATURE_LENGTHS={'inputs': 128, 'targets': 4}"],
     "text.TextPipeline.feature_lengths = {'inputs': 128, 'targets': 4} (TASK_FEATURE_LENGTHS): "
     'Span corruption with inputs length 128 (noise density 0.15, mean span 3.0) makes targets '
     'of up to 29 tokens, but the targets feature length is 4. Set the task feature lengths to '
     "{'inputs': 128, 'targets': 29}."),
])
def test_a_config_the_mesh_or_the_data_cannot_take(flags, error, entry_points, tmp_path,
                                                   capsys):
  message = refusal(
      train_main.main, with_flags(PRETRAIN, f"--gin.MODEL_DIR='{tmp_path}/run'", *flags), capsys)
  assert message == f'error: {error}'
  assert os.listdir(tmp_path) == []


def test_a_model_dir_inside_the_source_is_refused_before_anything_is_written(
    entry_points, tmp_path, capsys):
  source = t5x_writer.write(str(tmp_path / 'dense'), 6,
                            helpers.random_params(helpers.CHECKPOINT_T5))
  before = helpers.snapshot(source)
  message = refusal(train_main.main, UPCYCLE + [f"--gin.INITIAL_CHECKPOINT_PATH='{source}'",
                                                 f"--gin.MODEL_DIR='{source}/moe'"], capsys)
  assert message == (
      f"error: trainer.TrainConfig.model_dir = '{source}/moe' lies inside the source checkpoint "
      f'{source}, which a run only reads (restore.Restore.source, INITIAL_CHECKPOINT_PATH). '
      f'Fix: give the run a directory of its own, outside it.')
  assert helpers.snapshot(source) == before


@pytest.mark.parametrize('binding, error', [
    ("--gin.MODEL_DIR=/tmp/run", "gin configuration error: the binding 'MODEL_DIR = /tmp/run': "
     "Unable to parse value. A string value is quoted for gin inside the shell's quotes: "
     "--gin.MODEL_DIR=\"'/tmp/run'\"."),
    ("--gin.TASK_FEATURE_LENGTHS={'inputs': 4", 'gin configuration error: the binding '
     "\"TASK_FEATURE_LENGTHS = {'inputs': 4\" does not close its brackets or quotes (EOF in "
     'multi-line statement).'),
])
def test_a_binding_gin_cannot_parse_is_named(binding, error, entry_points, capsys):
  assert refusal(train_main.main, PRETRAIN + [binding], capsys) == error


FORMER_UPCYCLE = (
    "UpcycleFromDense is no class any more: there is one hook, restore.Restore(source, mode). "
    "Fix: include 'upcycling/upcycle_from_dense.gin' (or bind train_script.train.initializer = "
    '@restore.Restore() and restore.Restore.mode = @modes.Upcycle()), then bind '
    'restore.Restore.source (was .checkpoint), restore.Restore.reuse_optimizer_state, .step, '
    "... and the mode's own fields as modes.Upcycle.<field>.")

FORMER_BALANCE = (
    '{name} is no field any more: the load-balancing loss is one object, moe.MoeConfig.balance. '
    'Fix: bind moe.MoeConfig.balance = @balance.Switch() (each MoE layer its own loss) or '
    "@balance.PooledSwitch() (f and p averaged over the stack's layers, one loss), from "
    'upcycle.moe import balance; ')


@pytest.mark.parametrize('lines, binding, error', [
    (['from upcycle import restore', "restore.UpcycleFromDense.experts = 'copy'"], None,
     f"{{gin}}, line 3: {FORMER_UPCYCLE} (restore.UpcycleFromDense.experts = 'copy')"),
    (['from upcycle.train import restore', 'restore.Restore.reuse_optimizer_state = True'], None,
     '{gin}, line 2: upcycle.train.restore moved to upcycle.restore. Fix: write `from upcycle '
     'import restore` (the names bound on it are unchanged). (from upcycle.train import '
     'restore)'),
    (['from upcycle.train import grow', "grow.GrowExperts.sources = 'tile'"], None,
     "{gin}, line 2: upcycle.train.grow is gone: growing is a mode of the one hook, "
     "restore.Restore. Fix: include 'upcycling/grow_experts.gin' or 'upcycling/grow_depth.gin' "
     '(they bind restore.Restore.mode = @modes.GrowExperts() / @modes.GrowDepth()) instead of '
     "importing it; the modes' fields are modes.GrowExperts.sources, .usage and "
     'modes.GrowDepth.layer_map. (from upcycle.train import grow)'),
    ([], '--gin.restore.UpcycleFromDense.reuse_optimizer_state=True',
     "the binding 'restore.UpcycleFromDense.reuse_optimizer_state = True': " + FORMER_UPCYCLE),
    (['from upcycle.moe import config as moe',
      "encoder/moe.MoeConfig.load_balancing_scope = 'batch'"], None,
     '{gin}, line 3: ' + FORMER_BALANCE.format(name='moe.MoeConfig.load_balancing_scope') +
     "bind its scope ('group' or 'batch') as balance.Switch.scope (or "
     "balance.PooledSwitch.scope). (encoder/moe.MoeConfig.load_balancing_scope = 'batch')"),
    ([], '--gin.decoder/moe.MoeConfig.load_balancing_loss_weight=0.1',
     "the binding 'decoder/moe.MoeConfig.load_balancing_loss_weight = 0.1': " +
     FORMER_BALANCE.format(name='moe.MoeConfig.load_balancing_loss_weight') +
     'bind its weight as balance.Switch.weight (or balance.PooledSwitch.weight).'),
    ([], "--gin.moe.MoeConfig.load_balancing_layers='pooled'",
     "the binding \"moe.MoeConfig.load_balancing_layers = 'pooled'\": " +
     FORMER_BALANCE.format(name='moe.MoeConfig.load_balancing_layers') +
     "'separate' is @balance.Switch() and 'pooled' @balance.PooledSwitch()."),
])
def test_a_former_gin_name_says_what_to_write_now(lines, binding, error, entry_points,
                                                  tmp_path, capsys):
  """A user's gin file or binding naming one of the four hook classes the one
  `restore.Restore` replaced, the restore hook's former module, or one of MoeConfig's three
  load-balancing fields the one `MoeConfig.balance` object replaced: one line with the file
  or bindings to write now."""
  gin_file = tmp_path / 'mine.gin'
  gin_file.write_text('\n'.join(['from __gin__ import dynamic_registration', *lines]) + '\n')
  flags = UPCYCLE + [f'--gin_file={gin_file}', f"--gin.MODEL_DIR='{tmp_path}/run'",
                     "--gin.INITIAL_CHECKPOINT_PATH='/nowhere'"] + ([binding] if binding else [])
  message = refusal(train_main.main, flags, capsys)
  assert message == 'gin configuration error: ' + _fill(error, gin=gin_file)
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('kind, error', [
    ('file', "trainer.TrainConfig.model_dir = '{path}' is a file, not a directory. Fix: give a "
             'directory (one that does not exist yet is created).'),
    ('link', "trainer.TrainConfig.model_dir = '{path}' is a symbolic link to {tmp}/nowhere, "
             'which does not exist. Fix: give a directory (one that does not exist yet is '
             'created).'),
    ('long', 'trainer.TrainConfig.model_dir: the name qqqqqqqqqqqqqqqq... in {tmp} is 300 '
             'characters long; the filesystem allows 255. Fix: give a shorter name.'),
])
def test_a_model_dir_that_cannot_be_a_directory(kind, error, paths, entry_points, tmp_path,
                                                capsys):
  path = paths[kind]
  message = refusal(train_main.main, PRETRAIN + [f"--gin.MODEL_DIR='{path}'"], capsys)
  assert message == 'error: ' + _fill(error, path=path, tmp=tmp_path)
  assert sorted(os.listdir(tmp_path)) == ['link', 'notes']
  assert (tmp_path / 'notes').read_text() == 'notes\n'


LLM = ['--gin_file=models/llama/tiny.gin', '--gin_file=runs/llm_pretrain.gin',
       '--gin_file=data/offline_stdlib_lm.gin', '--gin.TRAIN_STEPS=2', '--gin.BATCH_SIZE=8',
       "--gin.TASK_FEATURE_LENGTHS={'targets': 16}"]
LLM_UPCYCLE = ['--gin_file=models/llama/tiny.gin', '--gin_file=moe/mixtral.gin',
               '--gin_file=runs/llm_upcycle.gin', '--gin_file=data/offline_stdlib_lm.gin',
               '--gin.TRAIN_STEPS=2', '--gin.BATCH_SIZE=8',
               "--gin.TASK_FEATURE_LENGTHS={'targets': 16}"]


@pytest.mark.parametrize('flags, error', [
    (LLM + ['--gin.TOKENIZER=5'],
     "TOKENIZER (lm.LmPipeline.tokenizer) = 5: expected a tokenizer: an offline BPE "
     "('offline_stdlib_bpe' or 'offline_packages_bpe'), an HF checkpoint directory or a run "
     'directory (a string), or a list of checkpoints that share one.'),
    (LLM + ["--gin.LEARNING_RATE='1e-3'"],
     "optimizers.warmup_decay_schedule.peak_learning_rate (LEARNING_RATE) = '1e-3': expected a "
     'number >= 0.0.'),
    # The default TOKENIZER of runs/llm_upcycle.gin is the checkpoint's own.
    (LLM_UPCYCLE + ["--gin.INITIAL_CHECKPOINT_PATH='{tmp}/bare'"],
     "TOKENIZER='{tmp}/bare': no tokenizer.json or tokenizer.model there, nor in a run's "
     'tokenizer/ above it. Give the HF checkpoint directory or run its weights were trained '
     "with, or an offline BPE ('offline_stdlib_bpe' or 'offline_packages_bpe')."),
    (LLM_UPCYCLE + ['--gin_file=upcycling/btx.gin', '--gin.NUM_EXPERTS=2',
                    "--gin.INITIAL_CHECKPOINT_PATH=['{tmp}/a', '{tmp}/b']"],
     "TOKENIZER=['{tmp}/a', '{tmp}/b']: {tmp}/b carries another tokenizer ({tmp}/b, digest "
     '{b}) than {tmp}/a ({tmp}/a, digest {a}): their embeddings index different pieces and '
     'cannot be merged. Fix: give checkpoints trained with one tokenizer.'),
])
def test_a_decoder_only_run_refuses_a_tokenizer_or_learning_rate_that_cannot_be(
    flags, error, entry_points, tmp_path, capsys):
  from tests.helpers import save_swapped_tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer  # pylint: disable=g-import-not-at-top
  offline = tokenizer.load(tokenizer.OFFLINE_BPE)
  offline.save(str(tmp_path / 'a'))
  save_swapped_tokenizer(offline, str(tmp_path / 'b'))
  (tmp_path / 'bare').mkdir()
  names = {'tmp': tmp_path, 'a': offline.short_digest,
           'b': tokenizer.load(str(tmp_path / 'b')).short_digest}
  message = refusal(train_main.main, [_fill(flag, **names) for flag in flags] + [
      f"--gin.MODEL_DIR='{tmp_path}/run'"], capsys)
  assert message == 'error: ' + _fill(error, **names)
  assert not os.path.exists(tmp_path / 'run')


def test_an_upcycling_start_whose_source_holds_an_inf_leaves_no_model_dir(
    entry_points, tmp_path, capsys):
  """An Inf written (by the safetensors library) into an HF Llama's embedding: the restore hook
  stops on it in one line, and the MODEL_DIR this start created is removed again (no
  upcycling_report.txt of a run that never began)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer  # pylint: disable=g-import-not-at-top
  source = str(tmp_path / 'llama')
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
      tie_word_embeddings=False)).save_pretrained(source)   # models/llama/tiny.gin's
  tokenizer.load(tokenizer.OFFLINE_BPE).save(source)
  weights = os.path.join(source, 'model.safetensors')
  tensors = load_file(weights)
  tensors['model.embed_tokens.weight'][5, 3] = np.inf
  save_file(tensors, weights, metadata={'format': 'pt'})
  message = refusal(train_main.main, LLM_UPCYCLE + [
      '--gin.models.LlamaConfig.num_layers=2', f"--gin.INITIAL_CHECKPOINT_PATH='{source}'",
      f"--gin.MODEL_DIR='{tmp_path}/run'"], capsys)
  assert message == (
      f"error: {weights}: parameter 'model.embed_tokens.weight': the tensor holds values that "
      'are not finite. Expected finite values, found 0 NaN and 1 Inf among those read. The '
      'file is damaged: re-download or re-export it.')
  assert not os.path.exists(tmp_path / 'run')


def _eval_argv(checkpoint, *flags):
  return ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/eval.gin', DATA, LENGTHS,
          f"--gin.CHECKPOINT_PATH='{checkpoint}'", *flags]


def _infer_argv(checkpoint, *flags):
  return ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/infer.gin', DATA, LENGTHS,
          f"--gin.CHECKPOINT_PATH='{checkpoint}'", *flags]


@pytest.mark.parametrize('main, argv, error', [
    (eval_main.main, _eval_argv('/nonexistent', '--gin.BATCH_SIZE=0'),
     'BATCH_SIZE (eval_script.evaluate.batch_size) = 0: expected an integer >= 1.'),
    (eval_main.main, _eval_argv('/nonexistent', '--gin.BATCH_SIZE=8',
                                '--gin.EVAL_MICROBATCHES=3'),
     'EVAL_MICROBATCHES (eval_script.evaluate.num_microbatches) = 3 does not divide BATCH_SIZE '
     '(8). Fix: a divisor of 8.'),
    (eval_main.main, _eval_argv('/nonexistent', "--gin.EVAL_OUTPUT_DIR='{file}/eval'"),
     "EVAL_OUTPUT_DIR (eval_script.evaluate.output_dir) = '{file}/eval': {file} is a file, not "
     'a directory, so no directory can be made under it. Fix: give a directory (one that does '
     'not exist yet is created).'),
    (infer_main.main, _infer_argv('/nonexistent', "--gin.MODEL_DIR='{tmp}/out'",
                                  '--gin.BATCH_SIZE=0'),
     'BATCH_SIZE (infer_script.infer.batch_size) = 0: expected an integer >= 1.'),
    (infer_main.main, _infer_argv('/nonexistent', "--gin.MODEL_DIR='{file}/out'"),
     "MODEL_DIR (infer_script.infer.output_dir) = '{file}/out': {file} is a file, not a "
     'directory, so no directory can be made under it. Fix: give a directory (one that does '
     'not exist yet is created).'),
    (infer_main.main, _infer_argv('/nonexistent', "--gin.MODEL_DIR='{tmp}/out'",
                                  "--gin.T5X_MODE='scores'"),
     "T5X_MODE (infer_script.infer.t5x_mode) = 'scores': infer writes T5X's rows of its infer "
     "modes 'predict', 'predict_with_aux', 'score', or None for this project's rows."),
    (eval_main.main, _eval_argv('/nonexistent', "--gin.LOGICAL_AXIS_RULES='zero3'"),
     "LOGICAL_AXIS_RULES (eval_script.evaluate.logical_axis_rules) = 'zero3': expected one of "
     "['default', 'fsdp'] or a list of (logical axis, mesh axes) pairs, e.g. [('batch', "
     "'data'), ('embed', None)]."),
    (infer_main.main, _infer_argv('/nonexistent', "--gin.MODEL_DIR='{tmp}/out'",
                                  "--gin.LOGICAL_AXIS_RULES=[('embed', 'pod')]"),
     "LOGICAL_AXIS_RULES (infer_script.infer.logical_axis_rules): ('embed', 'pod') is not a "
     "(logical axis, mesh axes) pair; mesh axes are None, one of ('data', 'expert', 'model') or "
     'a tuple of them.'),
])
def test_eval_and_infer_refuse_a_batch_of_0_an_output_under_a_file_a_t5x_mode_and_rules(
    main, argv, error, paths, entry_points, tmp_path, capsys):
  names = {'file': paths['file'], 'tmp': tmp_path}
  message = refusal(main, [_fill(arg, **names) for arg in argv], capsys)
  assert message == 'error: ' + _fill(error, **names)


def _launch_main(name):
  """launch/<name>.py's main (a script, not a module of the package)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'launch', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


@pytest.mark.parametrize('entry_point, argv, error', [
    ('upcycle.train.__main__', ['--gin_fil=x.gin'], 'unrecognized arguments: --gin_fil=x.gin'),
    ('upcycle.eval', ['--bogus'], 'unrecognized arguments: --bogus'),
    ('upcycle.convert', ['--sourc=x', '--output_dir=y'], 'the following arguments are required: '
                                                         '--source'),
    ('upcycle.describe', ['x', '--jso'], 'unrecognized arguments: --jso'),
    ('upcycle.study.__main__', ['--suite=nope'], "argument --suite: invalid choice: 'nope' "),
    ('local', ['--num_process=2'], 'unrecognized arguments: --num_process=2'),
    ('tpu_vm', ['create', '--nam=x', '--zone=z'], 'the following arguments are required: --name'),
])
def test_a_bad_flag_of_any_entry_point_is_one_line_and_status_1(entry_point, argv, error):
  """Not argparse's usage block and status 2; an abbreviation is no flag."""
  main = (_launch_main(entry_point) if '.' not in entry_point
          else importlib.import_module(entry_point).main)
  with pytest.raises(SystemExit) as refused:
    main(argv)
  message = refused.value.code   # a string: printed on stderr, exit status 1
  assert isinstance(message, str) and '\n' not in message
  assert message.startswith(f'error: {error}') and message.endswith(' (--help lists the flags).')


def _stderr(done):
  """stderr without the native libraries' start-up lines."""
  return [line for line in done.stderr.splitlines()
          if line.strip() and not line.startswith(('WARNING', 'I0000', 'W0000', 'E0000'))]


@pytest.mark.slow
@pytest.mark.parametrize('module, argv, error', [
    ('upcycle.train', PRETRAIN + ["--gin.MODEL_DIR='{file}'"],
     "trainer.TrainConfig.model_dir = '{file}' is a file, not a directory. Fix: give a "
     'directory (one that does not exist yet is created).'),
    ('upcycle.infer', _infer_argv('/nonexistent', "--gin.MODEL_DIR='{tmp}/out'",
                                  '--gin.BATCH_SIZE=0'),
     'BATCH_SIZE (infer_script.infer.batch_size) = 0: expected an integer >= 1.'),
])
def test_the_whole_output_is_one_line(module, argv, error, paths, tmp_path):
  names = {'file': paths['file'], 'tmp': tmp_path}
  done = subprocess.run([sys.executable, '-m', module, *[_fill(arg, **names) for arg in argv]],
                        capture_output=True, text=True, timeout=300, check=False)
  assert (done.returncode, done.stdout) == (1, '')
  assert _stderr(done) == ['error: ' + _fill(error, **names)], done.stderr


@pytest.mark.parametrize('flags, error', [
    ([], "TOKENIZER offline_stdlib_bpe has no chat template (no chat_template.jinja, no "
         "chat_template in tokenizer_config.json), so its samples cannot be rendered. Fix: "
         "--gin.SFT_TEMPLATE=\"'plain'\""),
    (["--gin.SFT_TEMPLATE='plain'"], '{data}/train.jsonl:2: not a line of JSON'),
])
def test_sft_data_that_cannot_be_read(flags, error, entry_points, tmp_path, capsys):
  data = tmp_path / 'data'
  data.mkdir()
  (data / 'train.jsonl').write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a",\n')
  message = refusal(train_main.main, [
      '--gin_file=models/llama/tiny.gin', '--gin_file=runs/llm_pretrain.gin',
      '--gin_file=data/sft_files.gin', '--gin.TRAIN_STEPS=1', '--gin.BATCH_SIZE=8',
      f"--gin.MODEL_DIR='{tmp_path}/run'", f"--gin.SFT_TRAIN_FILES='{data}/train.jsonl'",
      f"--gin.SFT_VALIDATION_FILES='{data}/train.jsonl'"] + flags, capsys)
  assert _fill(error, data=data) in message, message
