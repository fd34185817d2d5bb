"""T5X-style command-line gin handling for the entry points (the only place gin lives besides
the gin files).

  --gin_file=A.gin --gin_file=B.gin     later files win; looked up in --gin_search_paths
  --gin.KEY=VALUE                       shorthand for --gin_bindings='KEY = VALUE'
  --gin_bindings='KEY = VALUE'          repeatable
  --gin_search_paths=a,b                where gin files and their includes are found
                                        (then CONFIGS_DIR, then the cwd)
  --tfds_data_dir=DIR                   as T5X's: where TFDS datasets are prepared
  --verbose                             errors show their traceback, not only one line

Two values for one binding on the command line are refused, naming both (`check_repeats`); a
macro left %gin.REQUIRED names the gin file that sets it and the later one that sets it back
(`unset_macro`). A macro bound on the command line that no binding uses is refused, naming
the closest macro the configuration has (`--gin.NUM_EXPERT=8` would otherwise define a new
macro and change nothing); so are T5X's macros and flags that mean nothing here, with what to
use instead.
"""

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
import tokenize
import traceback
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Type)

import gin
from gin import config_parser

from upcycle import arguments, console, distributed, reachability, startup

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# The gin files: inside the package in a wheel (setup.py ships configs/ as upcycle/configs/),
# at the repository's top level in a checkout or an editable install.
_PACKAGED_CONFIGS = os.path.join(_PACKAGE, 'configs')
CONFIGS_DIR = (_PACKAGED_CONFIGS if os.path.isdir(_PACKAGED_CONFIGS)
               else os.path.join(os.path.dirname(_PACKAGE), 'configs'))


# T5X's macros and flags that would do nothing here, and what to do instead.
T5X_MACROS = {
    'RANDOM_SEED': 'the seed here is the macro SEED: --gin.SEED=N',
    'Z_LOSS': 'set --gin.objectives.Seq2Seq.z_loss=X (default 1e-4)',
    'LOSS_NORMALIZING_FACTOR': ('the loss is always normalized by the number of real target '
                                "tokens (T5X's 'NUM_REAL_TARGET_TOKENS'); drop the binding"),
    'USE_CACHED_TASKS': ('tasks are always read uncached (no seqio cache): =False is '
                         'accepted, =True is not'),
    'INFER_OUTPUT_DIR': ('python -m upcycle.infer writes MODEL_DIR/inference/'
                         '<task>-<step>-<method>.jsonl: set --gin.MODEL_DIR instead'),
}
# T5X's habits that do here what they ask for already: accepted, with a note on stderr.
_TO_THE_TERMINAL = ('progress and warnings already go to the terminal (no absl log files are '
                    'kept)')
T5X_FLAGS = {'--alsologtostderr': _TO_THE_TERMINAL, '--logtostderr': _TO_THE_TERMINAL}
T5X_ACCEPTED_BINDINGS = {'USE_CACHED_TASKS = False': 'tasks are always read uncached here'}
# T5X's configurable parameters (full names; gin's partial names such as `train.eval_period`
# or `PjitPartitioner.model_parallel_submesh` match them too) and what to use here instead.
_CHECKPOINTS = ('trainer.TrainConfig.checkpoint_every / keep_checkpoints (saving) and '
                'INITIAL_CHECKPOINT_PATH (restoring)')
_MESH = ('trainer.TrainConfig.num_expert_partitions / num_model_partitions (the data axis takes '
         'the rest of the devices)')
_DATA = ('the data gin file (configs/data/) and the macros MIXTURE_OR_TASK_NAME, '
         'TASK_FEATURE_LENGTHS, BATCH_SIZE')
T5X_CONFIGURABLES = {
    'train_script.train.total_steps': 'TRAIN_STEPS',
    'train_script.train.eval_period': 'EVAL_PERIOD (trainer.TrainConfig.eval_every)',
    'train_script.train.eval_steps': 'EVAL_STEPS (trainer.TrainConfig.eval_batches)',
    'train_script.train.stats_period': 'trainer.TrainConfig.log_every',
    'train_script.train.random_seed': 'SEED',
    'train_script.train.run_eval_before_training': 'trainer.TrainConfig.eval_at_start',
    'train_script.train.checkpoint_cfg': _CHECKPOINTS,
    'train_script.train.partitioner': _MESH,
    'train_script.train.train_dataset_cfg': 'train.train_data (a text.TextPipeline)',
    'train_script.train.train_eval_dataset_cfg': 'train.eval_data (a text.TextPipeline)',
    'train_script.train.infer_eval_dataset_cfg': ('INFER_EVAL = True (trainer.TrainConfig.'
                                                  'infer_eval; it decodes train.decode_data)'),
    'utils.CheckpointConfig.save': _CHECKPOINTS,
    'utils.CheckpointConfig.restore': _CHECKPOINTS,
    'utils.SaveCheckpointConfig.period': 'trainer.TrainConfig.checkpoint_every',
    'utils.SaveCheckpointConfig.keep': ('trainer.TrainConfig.keep_checkpoints (None: every '
                                        'checkpoint)'),
    'utils.SaveCheckpointConfig.dtype': 'no binding: checkpoints keep the parameters\' dtype',
    'utils.SaveCheckpointConfig.save_dataset': ('no binding: every checkpoint holds the data '
                                                'position'),
    'utils.RestoreCheckpointConfig.path': 'INITIAL_CHECKPOINT_PATH',
    'partitioning.PjitPartitioner.num_partitions': 'trainer.TrainConfig.num_model_partitions',
    'partitioning.PjitPartitioner.model_parallel_submesh': _MESH,
    'partitioning.PjitPartitioner.logical_axis_rules': ('LOGICAL_AXIS_RULES '
                                                        '(trainer.TrainConfig.logical_axis_rules)'),
    'trainer.Trainer.num_microbatches': 'trainer.TrainConfig.num_microbatches',
    'utils.DatasetConfig.mixture_or_task_name': 'MIXTURE_OR_TASK_NAME',
    'utils.DatasetConfig.module': 'MIXTURE_OR_TASK_MODULE',
    'utils.DatasetConfig.task_feature_lengths': 'TASK_FEATURE_LENGTHS',
    'utils.DatasetConfig.batch_size': 'BATCH_SIZE',
    'utils.DatasetConfig.split': ('EVAL_SPLIT (python -m upcycle.eval; runs/vit_eval.gin: '
                                  'VALIDATION_SPLIT); in training, '
                                  'train/text.TextPipeline.split and '
                                  'validation/text.TextPipeline.split'),
    'utils.DatasetConfig.seed': 'SEED',
    'utils.DatasetConfig.shuffle': 'text.TextPipeline.shuffle',
    'utils.DatasetConfig.pack': 'text.TextPipeline.pack',
    'utils.DatasetConfig.use_cached': 'no binding: tasks are always read uncached',
}
# Any other parameter of these T5X classes.
T5X_CLASSES = {
    'utils.DatasetConfig': _DATA,
    'utils.SaveCheckpointConfig': _CHECKPOINTS,
    'utils.RestoreCheckpointConfig': _CHECKPOINTS,
    'partitioning.PjitPartitioner': _MESH,
}


def _note(message: str) -> None:
  print(f'note: {message}.', file=sys.stderr, flush=True)


def parse_flags(argv: Sequence[str], description: str) -> Tuple[argparse.Namespace, List[str]]:
  """Splits argv into known flags and gin bindings (from --gin.K=V and --gin_bindings)."""
  kept = []
  for arg in argv:
    flag = arg.split('=', 1)[0]
    if flag in T5X_FLAGS:
      _note(f'{flag} (T5X): accepted; {T5X_FLAGS[flag]}')
    else:
      kept.append(arg)
  argv = kept
  parser = arguments.ArgumentParser(description=description)
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file; repeatable, later files override earlier ones')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="a binding such as \"MODEL_DIR = '/tmp/run'\"; repeatable")
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories to look for gin files in')
  parser.add_argument('--multi_host', choices=('auto', 'yes', 'no'), default='auto',
                      help='call jax.distributed.initialize() (auto: on a multi-host TPU slice, '
                           "as JAX's cluster detection finds it, and under launch/local.py)")
  parser.add_argument('--tfds_data_dir', default=None,
                      help="as T5X's: the TFDS data directory of every task and image dataset")
  parser.add_argument('--verbose', action='store_true',
                      help='show the traceback of an error, not only its one-line message')
  rest = []
  for arg in argv:   # --gin.K=V is --gin_bindings: the bindings keep the command line's order
    if arg.startswith('--gin.'):
      key, sep, value = arg[len('--gin.'):].partition('=')
      if not sep:
        raise SystemExit(f'{arg}: expected --gin.KEY=VALUE.')
      rest.append(f'--gin_bindings={key} = {value}')
    else:
      rest.append(arg)
  args = parser.parse_args(rest)
  return args, _translated(args.gin_bindings)


def _translated(bindings: Sequence[str]) -> List[str]:
  """`bindings` less T5X's that ask for what happens here anyway (a note each); a binding of
  a T5X configurable stops with the binding to use instead."""
  kept = []
  for binding in bindings:
    normalized = ' = '.join(part.strip() for part in binding.split('=', 1))
    if normalized in T5X_ACCEPTED_BINDINGS:
      _note(f'{normalized} (T5X): accepted; {T5X_ACCEPTED_BINDINGS[normalized]}')
      continue
    key = binding.split('=', 1)[0].strip()
    t5x = t5x_name(key)
    if t5x:
      full, instead = t5x
      named = key if key == full else f'{key} ({full})'
      raise SystemExit(f'gin configuration error: {named} is T5X\'s; here use {instead} '
                       '(docs/training.md, "From T5X").')
    kept.append(binding)
  return kept


def _names(partial: str, full_names: Sequence[str]) -> Optional[str]:
  """The first of `full_names` that `partial` names as gin would: whole or a dotted tail."""
  return next((n for n in full_names if n == partial or n.endswith('.' + partial)), None)


def t5x_name(key: str) -> Optional[Tuple[str, str]]:
  """(T5X's full name, what to use here) for a binding's `key` (`[scope/]configurable.param`)
  that names a T5X configurable parameter; None for any other key."""
  name = key.rsplit('/', 1)[-1]
  if '.' not in name:   # a macro
    return None
  full = _names(name, list(T5X_CONFIGURABLES))
  if full:
    return full, T5X_CONFIGURABLES[full]
  selector, _, parameter = name.rpartition('.')
  cls = _names(selector, list(T5X_CLASSES)) if selector else None
  return (f'{cls}.{parameter}', T5X_CLASSES[cls]) if cls else None


def search_paths(extra: Sequence[str] = ()) -> List[str]:
  """Where gin files and their includes are looked up, in order: `extra` (--gin_search_paths),
  CONFIGS_DIR (the gin files that come with the package), then the working directory."""
  return [os.path.abspath(p) for p in extra if p] + [CONFIGS_DIR, os.getcwd()]


def resolve(name: str, paths: Sequence[str]) -> Optional[str]:
  """The file `name` names: itself if absolute, else the first `paths[i]/name` that exists."""
  if os.path.isabs(name):
    return name if os.path.isfile(name) else None
  return next((os.path.join(p, name) for p in paths if os.path.isfile(os.path.join(p, name))),
              None)


@contextlib.contextmanager
def _files_from(paths: Sequence[str]) -> Iterator[None]:
  """While parsing, gin opens every file and include through `resolve` alone.

  gin's own lookup tries the working directory first and then reads `include 'runs/x.gin'`
  as the Python package `runs`: a folder named like a config group in the working directory
  (`runs/`, `data/`, ...) makes it crash. gin 0.5 offers no public way to replace its readers,
  so they are swapped for the duration of the parse and restored after.
  """
  def exists(name: str) -> bool:
    if resolve(name, paths) is None:
      raise IOError(f'gin file {name!r} not found in the search paths {list(paths)}; '
                    'pass a path that exists or add its directory with --gin_search_paths')
    return True

  # pylint: disable=protected-access
  readers, prefixes = list(gin.config._FILE_READERS), list(gin.config._LOCATION_PREFIXES)
  gin.config._FILE_READERS[:] = [(lambda name: open(resolve(name, paths)), exists)]
  gin.config._LOCATION_PREFIXES[:] = ['']
  try:
    yield
  finally:
    gin.config._FILE_READERS[:] = readers
    gin.config._LOCATION_PREFIXES[:] = prefixes
  # pylint: enable=protected-access


def parse_files_and_bindings(files: Sequence[str], bindings: Sequence[str],
                             extra_search_paths: Sequence[str] = (),
                             finalize: bool = True) -> None:
  """Parses `files` in order (later ones win), then `bindings`; files and their includes are
  looked up in `search_paths(extra_search_paths)`, independent of what else the working
  directory holds."""
  with _files_from(search_paths(extra_search_paths)):
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=finalize)


def _macro_references(value: Any, found: set) -> None:
  """Adds the names of the macros `value` refers to (`%NAME`, also inside containers)."""
  if isinstance(value, gin.config.ConfigurableReference):
    if value.config_key[1] == 'gin.macro':
      found.add(value.config_key[0])
  elif isinstance(value, (list, tuple, set)):
    for item in value:
      _macro_references(item, found)
  elif isinstance(value, dict):
    for item in (*value.keys(), *value.values()):
      _macro_references(item, found)


class _Written:
  """A macro or reference inside a parsed value, as it is written (`%gin.REQUIRED`, `@f()`)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


class _AsWritten(config_parser.ParserDelegate):
  """gin's parser delegate that resolves nothing: values keep their macros and references."""

  def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> _Written:
    return _Written(f'@{scoped_configurable_name}{"()" if evaluate else ""}')

  def macro(self, macro_name: str) -> _Written:
    return _Written(f'%{macro_name}')


_REQUIRED = '%gin.REQUIRED'


def _statements(source: Any) -> List[Any]:
  """gin's statements (bindings, includes, imports) of a bindings string or an open gin file,
  nothing resolved: `repr` of a binding's value is its text (`10`, `'/tmp/x'`,
  `%gin.REQUIRED`)."""
  return list(config_parser.ConfigParser(source, _AsWritten()))


def _bindings(source: Any) -> List[config_parser.BindingStatement]:
  return [s for s in _statements(source) if isinstance(s, config_parser.BindingStatement)]


def _key(binding: config_parser.BindingStatement) -> str:
  """The binding's key as written: `[scope/]selector[.parameter]` (a macro: its name)."""
  scope = f'{binding.scope}/' if binding.scope else ''
  return scope + binding.selector + (f'.{binding.arg_name}' if binding.arg_name else '')


def check_repeats(bindings: Sequence[str]) -> None:
  """Refuses two values for one key among the command line's `bindings` (--gin.KEY=VALUE and
  --gin_bindings alike), whichever gin would keep (the last) unsaid; a value given twice is
  one value. A binding overriding a gin file's value is what bindings are for."""
  values: Dict[str, str] = {}
  for binding in (b for text in bindings for b in _bindings(text)):
    key, value = _key(binding), repr(binding.value)
    if values.setdefault(key, value) != value:
      raise ValueError(f'{key} is given two values on the command line, {values[key]} and '
                       f'{value}: give it one.')


def check_macros(bindings: Sequence[str], read: Sequence[str] = ()) -> None:
  """Refuses a macro set by `bindings` that no binding of the parsed configuration uses (nor
  the entry point, which reads the macros `read` itself), naming the closest macro it has."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  used = set(read)
  for parameters in config.values():
    for value in parameters.values():
      _macro_references(value, used)
  in_use = sorted(used & {scope for scope, selector in config if selector == 'gin.macro'})
  given = [b.selector for text in bindings for b in _bindings(text)
           if not b.scope and not b.arg_name]
  for name in given:
    if name in used:
      continue
    if name in T5X_MACROS:
      raise ValueError(f'--gin.{name}: a T5X macro without effect here: {T5X_MACROS[name]}.')
    close = difflib.get_close_matches(name, in_use, n=1)
    hint = (f'did you mean {close[0]}?' if close else
            f'the macros this configuration uses are {", ".join(in_use)}.')
    raise ValueError(f'--gin.{name}: no binding uses the macro {name}, so it would change '
                     f'nothing; {hint}')


def _import_task_module() -> None:
  """Imports the module MIXTURE_OR_TASK_MODULE names, if the configuration has one, while the
  config is still unlocked: a module of tasks may declare gin configurables
  (`t5.data.tasks` does)."""
  try:
    module = gin.query_parameter('%MIXTURE_OR_TASK_MODULE')
  except ValueError:
    return
  if module:
    from upcycle.data import tasks  # pylint: disable=g-import-not-at-top  (TF: only when asked)
    tasks.import_task_module(module, binding='MIXTURE_OR_TASK_MODULE')


def parse_gin(args: argparse.Namespace, bindings: Sequence[str], read: Sequence[str] = ()) -> None:
  """The entry points' flags take effect: --tfds_data_dir, then the gin files in order and the
  bindings last, whose macros must all be used (`check_macros`; `read`: the macros the entry
  point reads itself). Errors exit with the cause."""
  if args.tfds_data_dir:
    import seqio  # pylint: disable=g-import-not-at-top
    seqio.set_tfds_data_dir_override(args.tfds_data_dir)   # seqio tasks, as T5X does
    os.environ['TFDS_DATA_DIR'] = args.tfds_data_dir       # image datasets (data/images.py)
  if not args.gin_file:
    raise SystemExit('Give at least one --gin_file (see configs/ and docs/training.md).')
  paths = search_paths(args.gin_search_paths.split(','))   # as parse_files_and_bindings's
  try:
    parse_files_and_bindings(args.gin_file, bindings, args.gin_search_paths.split(','),
                             finalize=False)
    check_repeats(bindings)
    check_macros(bindings, read)
    _import_task_module()
    gin.finalize()
  except SyntaxError as e:
    raise SystemExit(f'gin configuration error: {syntax_error(e)}') from e
  except tokenize.TokenError as e:
    unclosed = [b for b in bindings if _unclosed(b)]
    where = f'the binding {unclosed[0]!r}' if unclosed else 'a gin file or binding'
    raise SystemExit(f'gin configuration error: {where} does not close its brackets or '
                     f'quotes ({e.args[0]}).') from e
  except (ValueError, IOError) as e:
    why = (_duplicate_task(e) or unset_macro(e, args.gin_file, paths)
           or located(_unresolved(str(e))))
    raise SystemExit(f'gin configuration error: {why}') from e
  except (AttributeError, ImportError) as e:   # a name gin cannot resolve
    raise SystemExit(f'gin configuration error: {located(_unresolved(str(e)))}') from e


# The restore hook's former gin names (in `upcycle.train.restore`, now `upcycle.restore`) and
# the file of configs/ that binds each now.
FORMER = {'UpcycleFromDense': ('upcycling/upcycle_from_dense.gin', 'modes.Upcycle'),
          'ContinueFromCheckpoint': ('upcycling/continue_from_checkpoint.gin', 'modes.Continue'),
          'GrowExperts': ('upcycling/grow_experts.gin', 'modes.GrowExperts'),
          'GrowDepth': ('upcycling/grow_depth.gin', 'modes.GrowDepth')}


def former(name: str) -> str:
  """What to write now instead of the former hook class `name` (one line)."""
  gin_file, mode = FORMER[name]
  return (f'{name} is no class any more: there is one hook, restore.Restore(source, mode). '
          f"Fix: include '{gin_file}' (or bind train_script.train.initializer = "
          f'@restore.Restore() and restore.Restore.mode = @{mode}()), then bind '
          f'restore.Restore.source (was .checkpoint), restore.Restore.reuse_optimizer_state, '
          f'.step, ... and the mode\'s own fields as {mode}.<field>.')


# MoeConfig's former load-balancing fields, one object now (`MoeConfig.balance`,
# `upcycle.moe.balance`), and where each one's value goes.
FORMER_FIELDS = {
    'load_balancing_loss_weight': 'bind its weight as balance.Switch.weight (or '
                                  'balance.PooledSwitch.weight)',
    'load_balancing_scope': "bind its scope ('group' or 'batch') as balance.Switch.scope (or "
                            'balance.PooledSwitch.scope)',
    'load_balancing_layers': "'separate' is @balance.Switch() and 'pooled' "
                             '@balance.PooledSwitch()'}
# gin's error for a parameter a configurable does not have.
_NO_PARAMETER = re.compile(r"Configurable '(?P<configurable>[\w.]*MoeConfig)' doesn't have a "
                           r"parameter named '(?P<field>\w+)'")


def former_field(configurable: str, field: str) -> str:
  """What to write now instead of `configurable` (gin's name of MoeConfig, e.g.
  'moe.MoeConfig').`field`, one of `FORMER_FIELDS` (one line)."""
  return (f'{configurable}.{field} is no field any more: the load-balancing loss is one object, '
          f'{configurable}.balance. Fix: bind {configurable}.balance = @balance.Switch() (each '
          f'MoE layer its own loss) or @balance.PooledSwitch() (f and p averaged over the '
          f'stack\'s layers, one loss), from upcycle.moe import balance; '
          f'{FORMER_FIELDS[field]}.')


# Modules gin files import that moved: former name -> the name to import now. A run's saved
# config.gin written before the move is read with the new name (`parse_saved_config`); a gin
# file the user writes is told what to import (`former_hint`).
MOVED_MODULES = {'upcycle.train.restore': 'upcycle.restore'}


def _from_import(module: str, alias: Optional[str] = None) -> str:
  """`from <package> import <name>` for `module` ('upcycle.restore'), `as <alias>` added
  where the alias is not the name."""
  package, _, name = module.rpartition('.')
  return f'from {package} import {name}' + (f' as {alias}' if alias not in (None, name) else '')


def _moved_imports(text: str) -> str:
  """`text` (a gin config) importing each moved module from where it is now, in any form gin
  reads: `from <package> import <module> [as <alias>]` keeps the name its bindings use;
  `import <module> [as <alias>]` and the bindings' dotted references take the new name."""
  for former_name, moved in MOVED_MODULES.items():
    package, _, name = former_name.rpartition('.')
    text = re.sub(rf'^from {re.escape(package)} import {name}(?: as (?P<alias>\w+))?$',
                  lambda found: _from_import(moved, alias=found.group('alias') or name),
                  text, flags=re.MULTILINE)
    text = re.sub(rf'(?<![\w.]){re.escape(former_name)}(?!\w)', moved, text)
  return text


def _moved_module(text: str) -> Optional[str]:
  """One line for gin's error `text` when it is about importing a moved module; None
  otherwise."""
  for former_name, moved in MOVED_MODULES.items():
    package, _, name = former_name.rpartition('.')
    if re.search(rf"cannot import name '{name}' from '{re.escape(package)}'", text) or (
        f"'{former_name}'" in text):
      return (f'{former_name} moved to {moved}. Fix: write `{_from_import(moved)}` '
              f'(the names bound on it are unchanged).')
  return None


def former_hint(text: str) -> Optional[str]:
  """`former`'s line when gin's error `text` is about a former hook class (or the module
  upcycle.train.grow, which held two of them), `former_field`'s when it is about a former
  field of MoeConfig, `_moved_module`'s when about a module that moved; None otherwise."""
  field = _NO_PARAMETER.search(text)
  if field and field.group('field') in FORMER_FIELDS:
    return former_field(field.group('configurable'), field.group('field'))
  moved = _moved_module(text)
  if moved:
    return moved
  if "'upcycle.train.grow'" in text:
    return ("upcycle.train.grow is gone: growing is a mode of the one hook, restore.Restore. "
            "Fix: include 'upcycling/grow_experts.gin' or 'upcycling/grow_depth.gin' (they bind "
            "restore.Restore.mode = @modes.GrowExperts() / @modes.GrowDepth()) instead of "
            "importing it; the modes' fields are modes.GrowExperts.sources, .usage and "
            "modes.GrowDepth.layer_map.")
  named = [name for name in FORMER if re.search(rf'\.{name}\b', text)]
  return former(named[0]) if named else None


def _unresolved(text: str) -> str:
  """gin's error for a name it cannot resolve, its message the fix where the name is one of
  the restore hook's former classes or MoeConfig's former fields (`former_hint`)."""
  found = _GIN_LOCATION.search(text)
  message, where = (text[:found.start()], text[found.start():]) if found else (text, '')
  return (former_hint(message) or message) + where


def _duplicate_task(error: Exception) -> Optional[str]:
  """One line for a gin file's `import` of a module that registers a seqio task this
  configuration already has (T5's `t5.data.tasks` after this project's files), with the fix;
  None for other errors."""
  lines = str(error).strip().splitlines()
  if not lines or not lines[0].startswith('Attempting to register duplicate provider'):
    return None
  where = lines[1].strip().replace('In file ', '') if len(lines) > 1 else 'a gin file'
  statement = lines[2].strip() if len(lines) > 2 else 'an import'
  module = statement.split()[-1] if statement.startswith('import ') else 'your_tasks'
  return (f'{where}: `{statement}` {lines[0][0].lower()}{lines[0][1:]}, which this '
          f'configuration registers already. Fix: name the module as '
          f'--gin.MIXTURE_OR_TASK_MODULE="\'{module}\'" instead of importing it in a gin '
          f'file; its tasks then replace this project\'s registrations of the same names.')


# gin's error for a macro left `%gin.REQUIRED` (others name a parameter, not `/macro.value`).
_UNSET_MACRO = re.compile(r'(?P<macro>[A-Za-z_]\w*)/macro\.value set to `%gin\.REQUIRED` but '
                          r'not subsequently overridden\.')


def _macro_values(name: str, macro: str, paths: Sequence[str]) -> List[Tuple[str, bool]]:
  """(the file, whether the value is %gin.REQUIRED) of each binding of `macro` in the gin file
  `name` and its includes (found in `paths`, as `resolve` finds them for gin), in the order
  gin reads them."""
  with open(resolve(name, paths)) as f:
    statements = _statements(f)
  found = []
  for statement in statements:
    if isinstance(statement, config_parser.IncludeStatement):
      found += _macro_values(statement.filename, macro, paths)
    elif (isinstance(statement, config_parser.BindingStatement)
          and _key(statement) == macro):
      found.append((name, repr(statement.value) == _REQUIRED))
  return found


def unset_macro(error: Exception, files: Sequence[str],
                paths: Sequence[str]) -> Optional[str]:
  """One line for gin's error that a macro is left %gin.REQUIRED: the gin file of `files` that
  sets it and the later one that sets it back (so the first must come after it: later files
  win), or, where none of them sets it, how to set it. None for other errors, and where the
  files do not explain it."""
  found = _UNSET_MACRO.fullmatch(str(error).strip())
  if not found:
    return None
  macro = found.group('macro')
  values = [(given, where, required) for given in files
            for where, required in _macro_values(given, macro, paths)]
  named = lambda value: value[0] + ('' if value[1] == value[0] else
                                    f' (in its include {value[1]})')
  sets = [i for i, value in enumerate(values) if not value[2]]
  if not sets:
    required = next((value for value in values if value[2]), None)
    return required and (f'{macro} is {_REQUIRED} in {named(required)} and no gin file given '
                         f'sets it: set it with --gin.{macro}=...')
  setter = values[sets[-1]]
  later = next((value for value in values[sets[-1] + 1:] if value[2]), None)
  if later is None:
    return None
  fix = (f'set it with --gin.{macro}=...' if later[0] == setter[0] else
         f'give {setter[0]} after {later[0]} (later gin files win)')
  return (f'{macro} is set by {named(setter)}, but {named(later)}, given after it, sets it '
          f'back to {_REQUIRED}: {fix}.')


def _unclosed(binding: str) -> bool:
  try:
    list(tokenize.generate_tokens(io.StringIO(binding).readline))
  except tokenize.TokenError:
    return True
  return False


# What gin appends to an error in a binding or a gin file: where, the line, a caret.
_GIN_LOCATION = re.compile(r'\n  In (?:file "(?P<file>[^"]*)",|bindings string) line '
                           r'(?P<line>\d+)\n    (?P<text>[^\n]*)(?:\n *\^)?$')


def located(text: str) -> str:
  """gin's error `text` in one line, naming the binding or the file line it is in: gin's
  `<message>\\n  In bindings string line 4\\n    train.eval_period = 100` is
  `the binding 'train.eval_period = 100': <message>`."""
  found = _GIN_LOCATION.search(text)
  if not found:
    return text
  message, where = text[:found.start()], found.group('text').strip()
  if found.group('file'):
    return f'{found.group("file")}, line {found.group("line")}: {message} ({where})'
  return f'the binding {where!r}: {message}'


def syntax_error(error: SyntaxError) -> str:
  """gin's parse error, naming the binding or the file line it is in; an unquoted string
  value gets the quoting it needs."""
  text = (error.text or '').strip()
  if error.filename:
    return f'{error.filename}, line {error.lineno}: {error.msg} ({text})'
  key, _, value = text.partition('=')
  key, value = key.strip(), value.strip()
  hint = ''
  if value and value[0] not in '\'"[{(@%' and not re.fullmatch(r'[-+.\w]+', value):
    hint = (f' A string value is quoted for gin inside the shell\'s quotes: '
            f'--gin.{key}="\'{value}\'".')
  return f'the binding {text!r}: {error.msg}{hint}'


def write_config(model_dir: str, operative: bool = False, header: str = '') -> None:
  """Writes MODEL_DIR/config.gin (everything parsed, at start) or operative_config.gin (what
  was actually used, at the end), as T5X does, after `header` (comment lines); MODEL_DIR may be
  gs://. Process 0 only."""
  import jax  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return
  directory = epath.Path(model_dir)
  directory.mkdir(parents=True, exist_ok=True)
  name, text = (('operative_config.gin', gin.operative_config_str()) if operative
                else ('config.gin', gin.config_str()))
  (directory / name).write_text(header + text)


RUN_CONFIGS = ('config.gin', 'operative_config.gin')   # `write_config`'s, in preference


def saved_config(directories: Sequence[str]) -> Optional[str]:
  """The first config.gin / operative_config.gin (`write_config`'s; `python -m upcycle.convert`
  writes config.gin too) in `directories`, in order; None if there is none."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  for directory in directories:
    for name in RUN_CONFIGS:
      if (epath.Path(directory) / name).exists():
        return os.path.join(directory, name)
  return None


def _entry_points(text: str) -> List[str]:
  """The configurables a saved config binds on `__main__` (`import __main__ as train_script`:
  'train_script.train'), the entry point that wrote it, which another one does not have."""
  aliases = re.findall(r'^import __main__ as (\w+)$', text, flags=re.MULTILINE)
  return sorted({name for alias in aliases
                 for name in re.findall(rf'^({alias}\.\w+)\.', text, flags=re.MULTILINE)})


def parse_saved_config(path: str) -> None:
  """Parses a run's saved config (`saved_config`) outside the trainer, as the run parsed its
  gin files and bindings, but for its entry point's own bindings (`_entry_points`, skipped)
  and with moved modules imported from where they are now (`MOVED_MODULES`): its macros
  (MODEL, ...) are then what the run had."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  text = _moved_imports(epath.Path(path).read_text())
  gin.parse_config(text, skip_unknown=_entry_points(text))
  gin.finalize()


_GIN_CALL_SUFFIX = '\n  In call to configurable '


def message(error: BaseException) -> str:
  """`error`'s message without the note gin appends to it ("\n  In call to configurable 'f'
  (...)")."""
  return str(error).split(_GIN_CALL_SUFFIX)[0]


def one_line(error: BaseException, argv: Sequence[str]) -> str:
  """`error: <message>` for an error the user can cause; with --verbose in `argv`, its
  traceback is printed first."""
  if '--verbose' in argv:
    traceback.print_exception(error, file=sys.stderr)
  return f'error: {message(error)}'


def no_verify(argv: Sequence[str]) -> Tuple[List[str], Optional[Dict[str, Any]]]:
  """(argv without `--no_verify`, the keyword arguments it gives: {'verify': False}, or None
  without it), for the readers run by `run` (eval, infer), whose `verify` compares the
  checkpoint with its digests (`checkpoints/verify.py`)."""
  from upcycle.checkpoints.verify import NO_VERIFY  # pylint: disable=g-import-not-at-top
  rest = [arg for arg in argv if arg != NO_VERIFY]
  return rest, ({'verify': False} if len(rest) < len(argv) else None)


def run(fn: Callable[..., Any], argv: Sequence[str], description: str,
        expected: Tuple[Type[BaseException], ...] = (), reach_gcs: bool = True,
        given: Optional[Mapping[str, Any]] = None) -> Any:
  """An entry point's main: flags, multi-host setup, gin files and bindings, then `fn()` with
  its arguments bound by gin (gin files refer to it as `__main__.<fn name>`, as in T5X) and
  the keyword arguments `given` (the entry point's own flags, not gin's to bind).

  With `reach_gcs`, every gs:// bucket the configuration names must answer first, in bounded
  time (`reachability.check`).

  Errors the user can cause end with one line and exit status 1, no traceback (--verbose
  shows it): bad flags, gin files and bindings (a SystemExit with the reason) and the
  `expected` exceptions (a bad config value, a checkpoint that does not fit, ...).
  """
  try:
    console.show_progress()
    args, bindings = parse_flags(argv, description)
    distributed.join(args.multi_host)
    configured = _configurable(fn)
    parse_gin(args, bindings)
    if reach_gcs:
      reachability.check(reachability.gin_paths())
    startup.ready()
    return configured(**(given or {}))
  except SystemExit as e:
    if isinstance(e.code, str) and '--verbose' in argv:
      traceback.print_exception(e.__cause__ or e, file=sys.stderr)
    raise
  except expected as e:
    message = one_line(e, argv)
  # Raised outside the handler: the error's traceback, and the run's objects its frames hold
  # (checkpoint managers with threads), are released before the interpreter shuts down.
  raise SystemExit(message)


def _configurable(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`gin.configurable(fn)`, named after its module as in a fresh process (`__main__.train`
  under `python -m upcycle.train`). A process that parsed a gin file binding `fn` before (a
  notebook, a test worker) holds it under that file's alias already (gin's dynamic
  registration of `import __main__ as train_script`: `train_script.train`); that name is
  dropped first, else every `train.<parameter>` binding would be ambiguous for the rest of the
  process. Gin files' aliases then resolve to this one configurable."""
  known = gin.config._INVERSE_REGISTRY.get(fn)  # pylint: disable=protected-access
  if known is not None and known.selector != f'{fn.__module__}.{fn.__name__}':
    gin.config._REGISTRY.pop(known.selector)  # pylint: disable=protected-access
  return gin.configurable(fn)


def bound_parameters(configurable: str) -> Tuple[str, ...]:
  """The parameters of `configurable` (named as gin files name it: 'models.LlamaConfig') that
  the parsed files and bindings bind, in any scope, whatever the value: what the run set, as
  against the class's defaults (`hf_model.model_config`'s `bound`, from `models/hf.gin`)."""
  match = gin.config._REGISTRY.get_match(configurable)  # pylint: disable=protected-access
  if match is None:
    raise ValueError(f'gin_utils.bound_parameters.configurable = {configurable!r}: no such '
                     'configurable is registered. Fix: name one the gin files bind.')
  config = gin.config._CONFIG  # pylint: disable=protected-access
  return tuple(sorted({parameter for (_, selector), parameters in config.items()
                       if selector == match.selector for parameter in parameters}))


def macro_value(name: str) -> Any:
  """The value of gin macro `name` (a configurable reference `@x()` called), None when the
  parsed files and bindings do not set it."""
  try:
    value = gin.query_parameter(f'{name}/gin.macro.value')
  except ValueError:
    return None
  if isinstance(value, gin.config.ConfigurableReference) and value.evaluate:
    value = value.scoped_configurable_fn()
  return value
