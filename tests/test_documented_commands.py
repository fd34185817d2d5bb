"""Every command the documentation shows parses: each `python -m upcycle.<cli>`,
`python launch/<script>.py` and `python benchmarks/<script>.py` line of README.md's and
docs/*.md's code blocks, docs/RESULTS.md's
inline commands and the examples in the CLIs' --help texts (their module docstrings; a
synopsis with `...` or `[optional]` parts is not a command). Training-style commands (train,
eval, infer, aot, and the training flags after `--` of the launchers) have their gin files
and bindings parsed and finalized as the entry points do, so a %gin.REQUIRED macro left
unset, a misspelt binding, an unused macro or an unknown gin file fails; the other CLIs'
flags go through the CLI's own parser (a script's `build_parser()`, the script imported: a
name it imports that the package no longer has fails)."""

import ast
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import gin
import pytest

from tests.helpers import REPO
from upcycle import aot, convert, export, gin_utils
from upcycle import describe as describe_main
from upcycle import lm_eval as lm_eval_main
from upcycle.study import __main__ as study_main

RESULTS = os.path.join('docs', 'RESULTS.md')   # written by python -m upcycle.study
DOCUMENTS = ['README.md'] + sorted(os.path.relpath(p, REPO)
                                   for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
CLIS = sorted(os.path.relpath(p, REPO)
              for p in glob.glob(os.path.join(REPO, 'upcycle', '**', '*.py'), recursive=True)
              + glob.glob(os.path.join(REPO, 'launch', '*.py'))
              if "if __name__ == '__main__':" in open(p).read())


def _script(path):
  """The module of script `path` (relative to the repository), imported; `sys.path` as it was
  (scripts put the repository on it)."""
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  before = list(sys.path)
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = before
  return module


def _code_lines(text, markdown, inline):
  """(line number, line) of the code lines, `\\`-continued lines joined: in `markdown` the
  lines of fenced code blocks (with `inline`, also whole inline code spans that start with
  `python`), in a help text the indented lines (its examples)."""
  in_block, pending, start = False, '', 0
  for number, line in enumerate(text.splitlines(), 1):
    if markdown and line.strip().startswith('```'):
      in_block = not in_block
    elif in_block if markdown else line[:1].isspace():
      start = start or number
      if line.rstrip().endswith('\\'):
        pending += line.rstrip()[:-1] + ' '
        continue
      yield start, pending + line
      pending, start = '', 0
    elif inline:
      for span in re.findall(r'`(python [^`]+)`', line):
        yield number, span


def _texts():
  """(name, text, markdown, inline) of the documents and the CLIs' help texts. The study's
  results page gives whole commands inline (how to regenerate them); elsewhere inline spans
  name commands in prose and code blocks hold the commands."""
  for document in DOCUMENTS:
    text = open(os.path.join(REPO, document)).read()
    yield document, text, True, document == RESULTS
  for cli in CLIS:
    text = ast.get_docstring(ast.parse(open(os.path.join(REPO, cli)).read())) or ''
    yield f'{cli} --help', text, False, False


def documented_commands():
  """pytest params of (argv after the interpreter) for every documented command; shell
  variables assigned before it in the same text (`WHERE='...'`) are expanded."""
  found = []
  for name, text, markdown, inline in _texts():
    variables = {}
    for number, line in _code_lines(text, markdown, inline):
      line = re.sub(r'\$(\w+)', lambda m: variables.get(m.group(1), m.group(0)), line)
      if re.fullmatch(r"\s*[A-Z_]+='[^']*'", line):
        name_, value = shlex.split(line)[0].split('=', 1)
        variables[name_] = value
      elif re.match(r'\s*(\S*/)?python3? (-m upcycle\.|launch/|benchmarks/)', line) and (
          not re.search(r'\.\.\.|\[', line)):   # a synopsis or an excerpt
        found.append(pytest.param(shlex.split(line, comments=True)[1:], id=f'{name}:{number}'))
  return found


COMMANDS = documented_commands()


# The user's task module the docs name (`--gin.MIXTURE_OR_TASK_MODULE="'my_tasks'"`), which
# the entry points import when they parse the gin files.
MY_TASKS = """
import seqio
if 'my_task' not in seqio.TaskRegistry.names():
  seqio.TaskRegistry.add('my_task', source=seqio.FunctionDataSource(
      lambda split, shuffle_files, seed=None: None, splits=('train', 'validation')),
      output_features={})
"""


@pytest.fixture(autouse=True)
def parsing(entry_points, tmp_path, monkeypatch):  # pylint: disable=unused-argument
  """The entry points on `__main__`, and the docs' task module on the path."""
  (tmp_path / 'my_tasks.py').write_text(MY_TASKS)
  monkeypatch.syspath_prepend(str(tmp_path))


def parse_training_flags(argv, read=()):
  """What gin_utils.run does before it calls the entry point."""
  gin.clear_config(clear_constants=True)
  gin_utils.parse_gin(*gin_utils.parse_flags(argv, 'documented command'), read=read)


def check(argv):
  """Parses `argv` (after `python`) as its CLI would; a refusal raises SystemExit."""
  if argv[0] == '-m':
    cli, flags = argv[1], argv[2:]
    if cli in ('upcycle.train', 'upcycle.eval', 'upcycle.infer'):
      parse_training_flags(flags)
    elif cli == 'upcycle.aot':
      parse_training_flags(aot._own_flags(flags)[1])   # pylint: disable=protected-access
    elif cli == 'upcycle.convert':
      _, rest = convert.build_parser().parse_known_args(flags)
      parse_training_flags(rest, read=(convert.MODEL_MACRO,))
    elif cli == 'upcycle.lm_eval':   # the model from gin files, if any
      _, rest = lm_eval_main.build_parser().parse_known_args(flags)
      if rest:
        parse_training_flags(rest, read=('MODEL',))
    elif cli == 'upcycle.export' and '--format=hf' in flags:   # the model from gin files
      _, rest = export.build_parser().parse_known_args(flags)
      if rest:
        parse_training_flags(rest, read=(export.MODEL_MACRO,))
    else:
      parsers = {'upcycle.export': export, 'upcycle.describe': describe_main,
                 'upcycle.study': study_main}
      parsers[cli].build_parser().parse_args(flags)
    return
  flags = argv[1:]
  own, train_flags = (flags[:flags.index('--')], flags[flags.index('--') + 1:]) if (
      '--' in flags) else (flags, [])
  _script(argv[0]).build_parser().parse_args(own)
  if train_flags:
    parse_training_flags(train_flags)


def test_the_documentation_shows_commands_of_every_kind():
  clis = {p.values[0][1] if p.values[0][0] == '-m' else p.values[0][0] for p in COMMANDS}
  assert {'upcycle.train', 'upcycle.eval', 'upcycle.infer', 'upcycle.aot', 'upcycle.convert',
          'upcycle.export', 'upcycle.describe', 'upcycle.study', 'upcycle.lm_eval',
          'launch/tpu_vm.py', 'launch/local.py'} <= clis
  assert {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, 'benchmarks', '*.py'))
          } <= clis   # every benchmark's use is shown


@pytest.mark.parametrize('argv', COMMANDS)
def test_documented_command_parses(argv):
  try:
    check(argv)
  except SystemExit as e:
    pytest.fail(f'python {shlex.join(argv)}\n  -> {e}')


def _shell_blocks():
  """pytest params of the ```bash / ```sh blocks of README.md and docs/*.md."""
  found = []
  for document in DOCUMENTS:
    text = open(os.path.join(REPO, document)).read()
    for match in re.finditer(r'^```(?:bash|sh)\n(.*?)^```', text, re.MULTILINE | re.DOTALL):
      line = text[:match.start()].count('\n') + 1
      found.append(pytest.param(match.group(1), id=f'{document}:{line}'))
  return found


@pytest.mark.parametrize('block', _shell_blocks())
def test_a_documented_block_is_whole_shell_commands(block):
  """`bash -n`: every quote and continuation closes, so the block pastes as it reads; and no
  backquote, which in these blocks is markdown that leaked in (prose spliced into a command),
  not a command substitution."""
  code = '\n'.join(re.sub(r'(^|\s)#.*', '', line) for line in block.splitlines())
  assert '`' not in code, block
  checked = subprocess.run(['bash', '-n'], input=block, text=True, capture_output=True)
  assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize('script', ['tpu_vm', 'local'])
def test_a_launcher_help_keeps_its_examples_line_continuations(script):
  """The examples in `--help` paste as shown: each `\\` still ends its line."""
  help_text = _script(f'launch/{script}.py').build_parser().format_help()
  continued = [line for line in help_text.splitlines() if line.rstrip().endswith('\\')]
  assert continued and all(line.rstrip().endswith(' \\') for line in continued)
  assert '--       --' not in help_text
