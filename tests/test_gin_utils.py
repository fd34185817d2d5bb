"""The entry points' command line (upcycle/gin_utils.py): a macro no binding uses is refused
with the closest one, T5X's macros and flags are honoured or refused with what to use instead,
and errors a user can cause end in one line, not a traceback."""

import sys

import gin
import pytest

from upcycle import fields, gin_utils
from upcycle.train import __main__ as train_main

T5 = ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=runs/pretrain.gin',
      "--gin.MODEL_DIR='/tmp/unused'", '--gin.TRAIN_STEPS=10']
MOE = ['--gin_file=models/t5_1_1/tiny.gin', '--gin_file=moe/paper_t5.gin']


@pytest.fixture(autouse=True)
def entry_point(monkeypatch):
  """runs/pretrain.gin binds `__main__.train`, as under `python -m upcycle.train`."""
  monkeypatch.setattr(sys.modules['__main__'], 'train', train_main.train, raising=False)
  yield
  gin.clear_config(clear_constants=True)


def parse(argv, read=()):
  gin.clear_config(clear_constants=True)
  gin_utils.parse_gin(*gin_utils.parse_flags(argv, 'test'), read=read)


def refusal(argv, read=()):
  with pytest.raises(SystemExit) as refused:
    parse(argv, read)
  return str(refused.value)


def test_a_misspelt_macro_is_refused_naming_the_macro_meant():
  message = refusal(MOE + ['--gin.NUM_EXPERT=8'])
  assert message == ('gin configuration error: --gin.NUM_EXPERT: no binding uses the macro '
                     'NUM_EXPERT, so it would change nothing; did you mean NUM_EXPERTS?')
  assert 'did you mean NUM_EXPERTS?' in refusal(MOE + ["--gin_bindings=NUM_EXPERT = 8"])
  parse(MOE + ['--gin.NUM_EXPERTS=8'])
  assert gin.query_parameter('NUM_EXPERTS/gin.macro.value') == 8


def test_a_macro_nothing_is_close_to_lists_the_macros_in_use():
  message = refusal(T5 + ['--gin.NUM_EXPERTS=8'])   # a dense model: no MoE file given
  assert message.endswith('the macros this configuration uses are ACTIVATION_DTYPE, '
                          'BATCH_SIZE, DROPOUT_RATE, EVAL_PERIOD, EVAL_STEPS, INFER_EVAL, '
                          'INFER_EVAL_BATCHES, LOGICAL_AXIS_RULES, MIXTURE_OR_TASK_MODULE, '
                          'MIXTURE_OR_TASK_NAME, '
                          'MODEL, MODEL_DIR, '
                          'OBJECTIVE, REMAT_POLICY, SCAN_LAYERS, SEED, TASK_FEATURE_LENGTHS, '
                          'TRAIN_STEPS, WARMUP_STEPS.')


def test_a_macro_the_entry_point_reads_itself_is_accepted(tmp_path):
  """python -m upcycle.convert reads MODEL with gin.query_parameter, not through a binding."""
  (tmp_path / 'bare.gin').write_text('from __gin__ import dynamic_registration\n'
                                     'from upcycle import models\n'
                                     'MODEL = @models.T5Config()\n')
  argv = [f'--gin_file={tmp_path}/bare.gin', '--gin.MODEL=@models.T5Config()']
  assert 'no binding uses the macro MODEL' in refusal(argv)
  parse(argv, read=('MODEL',))


@pytest.mark.parametrize('macro,instead', [
    ('RANDOM_SEED=1', 'the seed here is the macro SEED: --gin.SEED=N.'),
    ('Z_LOSS=0.001', 'set --gin.objectives.Seq2Seq.z_loss=X (default 1e-4).'),
    ("LOSS_NORMALIZING_FACTOR='NUM_REAL_TARGET_TOKENS'", "(T5X's 'NUM_REAL_TARGET_TOKENS')"),
    ('USE_CACHED_TASKS=True', 'tasks are always read uncached (no seqio cache): =False is '
                              'accepted, =True is not.'),
    ("INFER_OUTPUT_DIR='/tmp/x'", 'set --gin.MODEL_DIR instead.')])
def test_t5x_macros_are_refused_with_what_to_use_instead(macro, instead):
  name = macro.split('=')[0]
  message = refusal(T5 + [f'--gin.{macro}'])
  assert message.startswith(f'gin configuration error: --gin.{name}: a T5X macro without '
                            'effect here: ') and instead in message


def test_what_the_t5x_refusals_suggest_works():
  parse(T5 + ['--gin.SEED=7', '--gin.objectives.Seq2Seq.z_loss=0.001'])
  assert gin.query_parameter('SEED/gin.macro.value') == 7
  assert gin.query_parameter('upcycle.train.objectives.Seq2Seq.z_loss') == 0.001


def test_t5x_habits_that_ask_for_what_happens_anyway_are_accepted_with_a_note(capsys):
  parse(T5 + ['--alsologtostderr', '--logtostderr', '--gin.USE_CACHED_TASKS=False',
              '--gin.EVAL_PERIOD=500', '--gin.EVAL_STEPS=3'])
  notes = capsys.readouterr().err.splitlines()
  assert notes == [
      'note: --alsologtostderr (T5X): accepted; progress and warnings already go to the '
      'terminal (no absl log files are kept).',
      'note: --logtostderr (T5X): accepted; progress and warnings already go to the terminal '
      '(no absl log files are kept).',
      'note: USE_CACHED_TASKS = False (T5X): accepted; tasks are always read uncached here.']
  # T5X's EVAL_PERIOD / EVAL_STEPS macros are the trainer's evaluation period and batches.
  assert gin.query_parameter('upcycle.train.trainer.TrainConfig.eval_every').config_key == (
      'EVAL_PERIOD', 'gin.macro')
  assert gin.query_parameter('EVAL_PERIOD/gin.macro.value') == 500
  assert gin.query_parameter('EVAL_STEPS/gin.macro.value') == 3


@pytest.mark.parametrize('binding, full, instead', [
    ('utils.SaveCheckpointConfig.period=100', None, 'trainer.TrainConfig.checkpoint_every'),
    ('utils.SaveCheckpointConfig.keep=None', None,
     'trainer.TrainConfig.keep_checkpoints (None: every checkpoint)'),
    ('train_script.train.eval_steps=5', None, 'EVAL_STEPS (trainer.TrainConfig.eval_batches)'),
    # gin's partial names, as T5X's users type them
    ('train.eval_period=100', 'train_script.train.eval_period',
     'EVAL_PERIOD (trainer.TrainConfig.eval_every)'),
    ('train.total_steps=100', 'train_script.train.total_steps', 'TRAIN_STEPS'),
    ('train.stats_period=10', 'train_script.train.stats_period', 'trainer.TrainConfig.log_every'),
    ('partitioning.PjitPartitioner.num_partitions=2', None,
     'trainer.TrainConfig.num_model_partitions'),
    ('PjitPartitioner.model_parallel_submesh=(1,1,1,1)',
     'partitioning.PjitPartitioner.model_parallel_submesh',
     'trainer.TrainConfig.num_expert_partitions / num_model_partitions (the data axis takes the '
     'rest of the devices)'),
    ("utils.DatasetConfig.split='test'", None,
     'EVAL_SPLIT (python -m upcycle.eval; runs/vit_eval.gin: VALIDATION_SPLIT); in training, '
     'train/text.TextPipeline.split and '
     'validation/text.TextPipeline.split'),
    ('DatasetConfig.batch_size=8', 'utils.DatasetConfig.batch_size', 'BATCH_SIZE'),
    # a parameter of a T5X class the table does not list, under a gin scope
    ('train/utils.DatasetConfig.use_memory_cache=True',
     'utils.DatasetConfig.use_memory_cache',
     'the data gin file (configs/data/) and the macros MIXTURE_OR_TASK_NAME, '
     'TASK_FEATURE_LENGTHS, BATCH_SIZE'),
    ('utils.CheckpointConfig.save=None', None,
     'trainer.TrainConfig.checkpoint_every / keep_checkpoints (saving) and '
     'INITIAL_CHECKPOINT_PATH (restoring)'),
])
def test_t5x_configurables_are_refused_with_the_binding_to_use(binding, full, instead):
  key = binding.split('=')[0]
  named = f'{key} ({full})' if full else key
  assert refusal(T5 + [f'--gin.{binding}']) == (
      f"gin configuration error: {named} is T5X's; here use {instead} "
      f'(docs/training.md, "From T5X").')


def test_this_project_s_own_bindings_of_the_same_names_are_not_t5x_s():
  parse(T5 + ['--gin.train.eval_data=None', "--gin.validation/text.TextPipeline.split='train'",
              '--gin.SEED=3'])
  assert gin.get_bindings(train_main.train)['eval_data'] is None


@pytest.mark.parametrize('binding, error', [
    ('train.eval_perod=100', "the binding 'train.eval_perod = 100': Configurable 'train' "
                             "doesn't have a parameter named 'eval_perod'."),
    ('Partitioner.mesh=1', "the binding 'Partitioner.mesh = 1': No configurable matching "
                           "'Partitioner'."),
])
def test_a_binding_gin_does_not_know_is_one_line_naming_it(binding, error):
  assert refusal(T5 + [f'--gin.{binding}']) == f'gin configuration error: {error}'


def test_an_error_in_a_gin_file_names_the_file_and_line(tmp_path):
  (tmp_path / 'bad.gin').write_text('from __gin__ import dynamic_registration\n'
                                    'import __main__ as train_script\n\n'
                                    'train_script.train.eval_perod = 100\n')
  assert refusal(T5 + [f'--gin_file={tmp_path}/bad.gin']) == (
      f'gin configuration error: {tmp_path}/bad.gin, line 4: Configurable '
      "'train_script.train' doesn't have a parameter named 'eval_perod'. "
      '(train_script.train.eval_perod = 100)')


@pytest.mark.parametrize('bindings, error', [
    (['--gin.TRAIN_STEPS=10', '--gin.TRAIN_STEPS=3'], 'TRAIN_STEPS is given two values on the '
     'command line, 10 and 3: give it one.'),
    (['--gin.TRAIN_STEPS=3', '--gin_bindings=TRAIN_STEPS = 2'], 'TRAIN_STEPS is given two '
     'values on the command line, 3 and 2: give it one.'),   # in the command line's order
    (['--gin_bindings=trainer.TrainConfig.log_every = 5\nSEED = 1',
      '--gin.trainer.TrainConfig.log_every=7'], 'trainer.TrainConfig.log_every is given two '
     'values on the command line, 5 and 7: give it one.'),
    (["--gin.validation/text.TextPipeline.split='train'",
      "--gin_bindings=validation/text.TextPipeline.split = 'test'"],
     "validation/text.TextPipeline.split is given two values on the command line, 'train' and "
     "'test': give it one."),
])
def test_two_command_line_values_for_one_binding_are_refused_naming_both(bindings, error):
  assert refusal(T5[:2] + ["--gin.MODEL_DIR='/tmp/unused'", *bindings]) == (
      f'gin configuration error: {error}')


def test_a_command_line_binding_overrides_the_gin_files_and_may_repeat_its_value():
  parse(T5 + ['--gin.BATCH_SIZE=4', '--gin_bindings=BATCH_SIZE = 4'])   # runs/pretrain.gin: 512
  assert gin.query_parameter('%BATCH_SIZE') == 4 and gin.query_parameter('%TRAIN_STEPS') == 10


LLAMA = ['--gin_file=models/llama/tiny.gin', "--gin.MODEL_DIR='/tmp/unused'",
         '--gin.TRAIN_STEPS=3']


@pytest.mark.parametrize('files, error', [
    (['data/offline_stdlib_lm.gin', 'runs/llm_pretrain.gin'],
     'MIXTURE_OR_TASK_NAME is set by data/offline_stdlib_lm.gin, but runs/llm_pretrain.gin, '
     'given after it, sets it back to %gin.REQUIRED: give data/offline_stdlib_lm.gin after '
     'runs/llm_pretrain.gin (later gin files win).'),
    (['data/offline_stdlib_lm.gin', 'moe/mixtral.gin', 'runs/llm_upcycle.gin'],
     'MIXTURE_OR_TASK_NAME is set by data/offline_stdlib_lm.gin, but runs/llm_upcycle.gin (in '
     'its include runs/llm_pretrain.gin), given after it, sets it back to %gin.REQUIRED: give '
     'data/offline_stdlib_lm.gin after runs/llm_upcycle.gin (later gin files win).'),
    (['runs/llm_pretrain.gin'],
     'MIXTURE_OR_TASK_NAME is %gin.REQUIRED in runs/llm_pretrain.gin and no gin file given '
     'sets it: set it with --gin.MIXTURE_OR_TASK_NAME=...'),
])
def test_a_macro_left_required_names_the_gin_files_that_set_it(files, error):
  gin_files = [f'--gin_file={name}' for name in files]
  needs = ["--gin.INITIAL_CHECKPOINT_PATH='/x'"] if 'runs/llm_upcycle.gin' in files else []
  assert refusal(LLAMA + gin_files + needs) == f'gin configuration error: {error}'
  # What the message says to do: the data file after the runs file.
  parse(LLAMA + [f for f in gin_files if '=data/' not in f] +
        ['--gin_file=data/offline_stdlib_lm.gin'] + needs)
  assert gin.query_parameter('%MIXTURE_OR_TASK_NAME') == 'offline_stdlib_text'


def test_a_parameter_left_required_is_named_as_gin_names_it(tmp_path):
  (tmp_path / 'unset.gin').write_text('from __gin__ import dynamic_registration\n'
                                      'import __main__ as train_script\n'
                                      'train_script.train.eval_data = %gin.REQUIRED\n')
  assert refusal(T5 + [f'--gin_file={tmp_path}/unset.gin']) == (
      'gin configuration error: train.eval_data set to `%gin.REQUIRED` but not '
      'subsequently overridden.')


@pytest.mark.parametrize('flag, error', [
    ('--bogus', 'unrecognized arguments: --bogus'),
    ('--gin_fil=x.gin', 'unrecognized arguments: --gin_fil=x.gin'),   # no abbreviations
    ('--multi_host=maybe', "argument --multi_host: invalid choice: 'maybe' (choose from "
                           "'auto', 'yes', 'no')"),
])
def test_a_bad_flag_is_one_line_and_exit_1(flag, error):
  with pytest.raises(SystemExit) as refused:
    gin_utils.parse_flags(T5 + [flag], 'test')
  assert refused.value.code == f'error: {error} (--help lists the flags).'


def test_tfds_data_dir_is_where_tasks_and_image_datasets_are_read(monkeypatch, tmp_path):
  import seqio  # pylint: disable=g-import-not-at-top
  from upcycle.data import images  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(seqio.utils, '_TFDS_DATA_DIR_OVERRIDE', None)
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'before'))   # restored after the test
  parse(T5 + [f'--tfds_data_dir={tmp_path}'])
  assert seqio.TfdsDataSource('c4/en:3.1.0').tfds_dataset.data_dir == str(tmp_path)
  with pytest.raises(ValueError, match=f"not prepared in data_dir='{tmp_path}"):
    images.ImagePipeline(dataset='mnist', split='train').batches(
        seed=0, batch_size=8, shard_index=0, num_shards=1, drop_remainder=True, skip_batches=0)


def test_expected_errors_are_one_line_and_verbose_shows_the_traceback(capsys):
  def refuses():
    raise fields.ConfigError('trainer.TrainConfig.log_every = 0: expected an integer >= 1')

  argv = ['--gin_file=models/t5_1_1/tiny.gin']
  with pytest.raises(SystemExit, match='^error: trainer.TrainConfig.log_every = 0: expected'):
    gin_utils.run(refuses, argv, 'test', expected=(fields.ConfigError,))
  assert 'Traceback' not in capsys.readouterr().err
  gin.clear_config()
  with pytest.raises(SystemExit):
    gin_utils.run(refuses, argv + ['--verbose'], 'test', expected=(fields.ConfigError,))
  assert 'Traceback' in capsys.readouterr().err
  gin.clear_config()
  with pytest.raises(SystemExit, match='^gin configuration error: gin file .nope.gin. not found'):
    gin_utils.run(refuses, ['--gin_file=nope.gin', '--verbose'], 'test')
  assert 'OSError: gin file' in capsys.readouterr().err


def _train(argv, capsys):
  """`python -m upcycle.train argv` in this process: (its exit code, stdout, stderr); a string
  code is the one line Python prints on stderr as it exits with status 1."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as stopped:
    train_main.main(argv)
  return (stopped.value.code, *capsys.readouterr())


def test_train_help_exits_0_without_a_traceback(capsys):
  code, out, err = _train(['--help'], capsys)
  assert code == 0 and err == ''
  assert out.startswith('usage: ') and '--verbose' in out


def test_a_missing_gin_file_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert _train(['--gin_file=runs/pretrian.gin'], capsys) == (
      f"gin configuration error: gin file 'runs/pretrian.gin' not found in the search paths "
      f"['{gin_utils.CONFIGS_DIR}', '{tmp_path}']; pass a path that exists or add its "
      'directory with --gin_search_paths', '', '')


# A module of tasks as t5.data.tasks is (t5 0.9.4): it declares gin configurables and
# registers T5's own name, c4_v220_span_corruption, which this project registers too.
T5_LIKE_TASKS = '''
import gin, seqio

@gin.configurable
def span_length(mean=3.0):
  return mean

def dataset_fn(split, shuffle_files, seed=None):
  raise NotImplementedError

seqio.TaskRegistry.add(
    'c4_v220_span_corruption', source=seqio.FunctionDataSource(dataset_fn, splits=('train',)),
    output_features={})
'''


def test_a_task_module_with_gin_configurables_replaces_t5s_names(tmp_path, monkeypatch):
  import seqio  # pylint: disable=g-import-not-at-top
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top,unused-import
  (tmp_path / 't5_like_tasks.py').write_text(T5_LIKE_TASKS)
  monkeypatch.syspath_prepend(str(tmp_path))
  ours = seqio.TaskRegistry.get('c4_v220_span_corruption')
  parse(T5 + ["--gin.MIXTURE_OR_TASK_MODULE='t5_like_tasks'"])
  try:
    theirs = seqio.TaskRegistry.get('c4_v220_span_corruption')
    assert theirs is not ours and theirs.source.splits == ('train',)
    assert gin.query_parameter('%MIXTURE_OR_TASK_MODULE') == 't5_like_tasks'
  finally:
    seqio.TaskRegistry.remove('c4_v220_span_corruption')
    seqio.TaskRegistry.add_provider('c4_v220_span_corruption', ours)
    sys.modules.pop('t5_like_tasks')


def test_t5s_task_module_imported_by_a_gin_file_is_refused_with_the_binding(
    tmp_path, monkeypatch):
  from upcycle.data import tasks  # pylint: disable=g-import-not-at-top,unused-import
  (tmp_path / 't5_tasks_in_gin.py').write_text(T5_LIKE_TASKS)
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / 'mine.gin').write_text("include 'runs/pretrain.gin'\nimport t5_tasks_in_gin\n")
  message = refusal(['--gin_file=models/t5_1_1/tiny.gin', f'--gin_file={tmp_path}/mine.gin',
                     "--gin.MODEL_DIR='/tmp/unused'", '--gin.TRAIN_STEPS=10'])
  sys.modules.pop('t5_tasks_in_gin', None)
  assert message == (
      f'gin configuration error: "{tmp_path}/mine.gin", line 2: `import t5_tasks_in_gin` '
      f'attempting to register duplicate provider: c4_v220_span_corruption, which this '
      f'configuration registers already. Fix: name the module as '
      f'--gin.MIXTURE_OR_TASK_MODULE="\'t5_tasks_in_gin\'" instead of importing it in a gin '
      f'file; its tasks then replace this project\'s registrations of the same names.')


def test_an_entry_point_run_after_its_gin_files_were_parsed_keeps_their_short_names(
    tmp_path, monkeypatch):
  """A notebook (or a test worker) that parsed a gin file binding `__main__.<fn>` and then runs
  the entry point: one configurable, named after its module as in a fresh process, so
  `<fn>.<parameter>` and `<module>.<fn>.<parameter>` bindings both resolve."""
  def upcycle_test_entry(value=0):
    return value

  monkeypatch.setattr(sys.modules['__main__'], 'upcycle_test_entry', upcycle_test_entry,
                      raising=False)
  (tmp_path / 'entry.gin').write_text(
      'from __gin__ import dynamic_registration\nimport __main__ as script\n'
      'script.upcycle_test_entry.value = 1\n')
  argv = [f'--gin_file={tmp_path}/entry.gin']
  parse(argv)
  gin.clear_config()
  assert gin_utils.run(upcycle_test_entry, argv + ['--gin.upcycle_test_entry.value=2'],
                       'test', reach_gcs=False) == 2
  gin.clear_config()
  assert gin_utils.run(upcycle_test_entry,
                       argv + ['--gin.test_gin_utils.upcycle_test_entry.value=3'],
                       'test', reach_gcs=False) == 3
  gin.clear_config()
  parse(argv + ['--gin.upcycle_test_entry.value=4'])
  assert gin.query_parameter('upcycle_test_entry.value') == 4


@pytest.mark.parametrize('imported, named', [
    ('from upcycle.train import restore', 'restore'),
    ('from upcycle.train import restore as hook', 'hook'),
    ('import upcycle.train.restore', 'upcycle.train.restore'),
    ('import upcycle.train.restore as hook', 'hook')])
def test_a_saved_config_written_before_the_restore_hook_moved_is_read_as_it_was(
    tmp_path, imported, named):
  """A run's config.gin saved when the hook lived in `upcycle.train.restore`, imported in any
  form gin reads (the first is what this project's gin files wrote): `python -m upcycle.export`
  parses it with the hook's bindings as the run had them."""
  from upcycle import restore  # pylint: disable=g-import-not-at-top
  from upcycle.upcycling import modes  # pylint: disable=g-import-not-at-top
  saved = tmp_path / 'config.gin'
  saved.write_text(
      f'from __gin__ import dynamic_registration\nimport __main__ as train_script\n'
      f'{imported}\nfrom upcycle.upcycling import modes\n\n'
      f"{named}.Restore.source = '/runs/dense'\n{named}.Restore.reuse_optimizer_state = True\n"
      f'{named}.Restore.mode = @modes.Upcycle()\nmodes.Upcycle.experts = "copy"\n'
      f'train_script.train.initializer = @{named}.Restore()\n')
  gin.clear_config(clear_constants=True)
  gin_utils.parse_saved_config(str(saved))
  assert gin.get_bindings(restore.Restore) == {
      'source': '/runs/dense', 'reuse_optimizer_state': True,
      'mode': modes.Upcycle(experts='copy', router='normal', cast=False)}
