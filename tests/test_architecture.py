"""Dependencies point one way (README.md, "Architecture"): every import of every module, checked.

  tree  <-  layers  <-  moe  <-  models  <-  decoding
  tree  <-  leaf_ops  <-  optimizer_state  <-  checkpoints  <-  upcycling
  train, restore, pretrained and the entry points wire everything; pretrained  <-  train  <-
  fit; train_state (the TrainState) lies below train and restore.

Function-local imports count: hiding an import in a function does not change what a module
depends on. No part imports a part that imports it back, directly or through others. The dependency
table here and README.md's "Architecture" table name exactly the parts (top-level modules and
subpackages) that upcycle/ has.
"""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'upcycle'

# Top-level part of upcycle -> the parts it may import (besides itself and third parties).
ALLOWED = {
    'tree': set(),
    'train_state': set(),
    'fields': set(),
    'locks': set(),
    'console': {'platforms', 'tensorflow_banner'},
    'platforms': set(),
    'startup': set(),
    'tensorflow_banner': set(),
    'task_metrics': set(),
    'grouped_kernels': set(),
    'leaf_ops': set(),
    'optimizer_state': {'tree', 'leaf_ops'},
    'layers': {'tree', 'grouped_kernels'},
    'fused_attention': {'layers'},
    'router_scale': {'fields'},
    'moe': {'tree', 'layers', 'grouped_kernels', 'fields', 'router_scale'},
    'models': {'tree', 'layers', 'grouped_kernels', 'fused_attention', 'moe', 'fields'},
    'decoding': {'tree', 'layers', 'moe', 'models', 'fields'},
    'checkpoints': {'tree', 'locks', 'progress', 'optimizer_state'},
    'upcycling': {'tree', 'leaf_ops', 'checkpoints', 'optimizer_state', 'progress', 'fields',
                  'router_scale'},
    'data': {'fields', 'platforms'},
    'gin_utils': {'arguments', 'checkpoints', 'console', 'data', 'distributed', 'reachability',
                  'startup'},
    'arguments': set(),
    'distributed': {'tpu_slice'},
    'progress': set(),
    'reachability': set(),
    'tpu_slice': set(),
    'partitioning': {'fields'},
    # The fit analysis compiles the trainer's run; the trainer never imports it.
    'fit': {'models', 'moe', 'partitioning', 'platforms', 'train', 'upcycling'},
}
# Wiring: may import any part but those above it (a part whose allowed imports name it).
WIRING = {'train', 'restore', 'pretrained', 'hf_model', 'predictions', 'harness', 'aot', 'convert', 'export',
          'hf_export', 'hf_card', 'eval', 'infer', 'lm_eval', 'describe', 'quickstart',
          'study', '__init__'}
# The command-line modules (`python -m ...`): flags and one call; no module imports them.
COMMANDS = {'upcycle.aot', 'upcycle.convert', 'upcycle.eval', 'upcycle.export', 'upcycle.infer',
            'upcycle.lm_eval', 'upcycle.describe', 'upcycle.quickstart', 'upcycle.study.__main__',
            'upcycle.train.__main__'}


def _part(module: str) -> str:
  """'upcycle.checkpoints.hf' -> 'checkpoints'; 'upcycle' -> '__init__'."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else '__init__'


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  rel = path.relative_to(root.parent).with_suffix('')
  parts = list(rel.parts)
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def imports(path: pathlib.Path, root: pathlib.Path = PACKAGE):
  """(line, imported module) for every import in the file, nested ones included."""
  module = _module_name(path, root)
  package = module if path.name == '__init__.py' else module.rpartition('.')[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      if base == 'upcycle':  # `from upcycle import checkpoints`: each name is a part.
        for alias in node.names:
          yield node.lineno, f'upcycle.{alias.name}'
      else:
        yield node.lineno, base


def violations(paths, root: pathlib.Path = PACKAGE):
  out = []
  for path in paths:
    where = path.relative_to(root.parent)
    source = _part(_module_name(path, root))
    if source in WIRING:
      out += _imports_from_above(path, root, source)
      continue
    if source not in ALLOWED:
      out.append(f'{where}: part {source!r} has no place in the '
                 f'dependency table of tests/test_architecture.py; add it there and to the '
                 f'README.md "Architecture" section')
      continue
    for line, name in imports(path, root):
      if name != 'upcycle' and not name.startswith('upcycle.'):
        continue
      target = _part(name)
      if target != source and target not in ALLOWED[source]:
        out.append(f'{where}:{line}: upcycle.{source} imports '
                   f'{name}, against the direction (upcycle.{source} may import '
                   f'{sorted(ALLOWED[source]) or "nothing from upcycle"})')
  return out


def _imports_from_above(path: pathlib.Path, root: pathlib.Path, source: str) -> list:
  """'<file>:<line>: ...' for each import by the wiring part `source` of a part that imports
  it (`fit` of `train`)."""
  where = path.relative_to(root.parent)
  return [f'{where}:{line}: upcycle.{source} imports {name}, which imports upcycle.{source}; '
          f'move what both need into upcycle.{source}'
          for line, name in imports(path, root)
          if name.startswith('upcycle.') and source in ALLOWED.get(_part(name), ())]


def part_imports(paths, root: pathlib.Path = PACKAGE) -> dict:
  """part -> {part it imports: '<file>:<line>' of the first such import}, function-local
  imports included."""
  out = {}
  for path in paths:
    source = _part(_module_name(path, root))
    where = path.relative_to(root.parent)
    for line, name in imports(path, root):
      if name.startswith('upcycle.') and _part(name) != source:
        out.setdefault(source, {}).setdefault(_part(name), f'{where}:{line}')
  return out


def _path_between(graph: dict, start: str, goal: str):
  """[start, ..., goal] along the imports of `graph`, or None."""
  paths, seen = [[start]], {start}
  while paths:
    path = paths.pop(0)
    if path[-1] == goal:
      return path
    for target in sorted(graph.get(path[-1], ())):
      if target not in seen:
        seen.add(target)
        paths.append(path + [target])
  return None


def back_arrows(paths, root: pathlib.Path = PACKAGE):
  """'<file>:<line>: ...' for each import of a part that imports, directly or through others,
  the importing part: an arrow of the drawing that runs back up."""
  graph = part_imports(paths, root)
  out = []
  for source, targets in sorted(graph.items()):
    for target, where in sorted(targets.items()):
      back = _path_between(graph, target, source)
      if back:
        out.append(f'{where}: upcycle.{source} imports upcycle.{target}, which imports it back '
                   f'({" -> ".join(back)}); move what both need below both')
  return out


def test_no_arrow_runs_back_up():
  found = back_arrows(sorted(PACKAGE.rglob('*.py')))
  assert not found, 'Parts that import each other:\n  ' + '\n  '.join(found)


def test_a_back_arrow_hidden_in_a_function_is_named(tmp_path):
  """The check itself: the trainer imports `pretrained`, which imports the trainer's objectives
  through the registry, the last import hidden in a function."""
  package = tmp_path / 'upcycle'
  (package / 'train').mkdir(parents=True)
  (package / 'train' / 'trainer.py').write_text('from upcycle import pretrained\n')
  (package / 'pretrained.py').write_text('import os\nfrom upcycle import families\n')
  (package / 'families.py').write_text('def objective():\n  from upcycle.train import objectives\n')
  (package / 'hf_export.py').write_text('from upcycle import families, pretrained\n')
  files = sorted(package.rglob('*.py'))
  assert back_arrows(files, package) == [
      'upcycle/families.py:2: upcycle.families imports upcycle.train, which imports it back '
      '(train -> pretrained -> families); move what both need below both',
      'upcycle/pretrained.py:2: upcycle.pretrained imports upcycle.families, which imports it '
      'back (families -> train -> pretrained); move what both need below both',
      'upcycle/train/trainer.py:1: upcycle.train imports upcycle.pretrained, which imports it '
      'back (pretrained -> families -> train); move what both need below both']


def command_imports(paths, root: pathlib.Path = PACKAGE):
  """'<file>:<line>: ...' for each import of a command-line module by another module."""
  out = []
  for path in paths:
    module = _module_name(path, root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
      else:
        continue
      for name in sorted(set(names) & COMMANDS - {module}):
        out.append(f'{path.relative_to(root.parent)}:{node.lineno}: imports the command-line '
                   f'module {name}; move what it uses into the library')
  return out


def test_no_module_imports_a_command_line_module():
  found = command_imports(sorted(PACKAGE.rglob('*.py')))
  assert not found, '\n  '.join(['Command-line modules imported:'] + found)


def test_an_import_of_a_command_line_module_is_named(tmp_path):
  fake = tmp_path / 'upcycle' / 'train' / 'trainer.py'
  fake.parent.mkdir(parents=True)
  fake.write_text('import os\n\ndef end():\n  from upcycle import export\n'
                  '  from upcycle.train import __main__\n')
  assert command_imports([fake], tmp_path / 'upcycle') == [
      'upcycle/train/trainer.py:4: imports the command-line module upcycle.export; move what '
      'it uses into the library',
      'upcycle/train/trainer.py:5: imports the command-line module upcycle.train.__main__; '
      'move what it uses into the library']


def test_the_command_line_modules_are_those_with_a_main():
  found = {_module_name(path, PACKAGE) for path in PACKAGE.rglob('*.py')
           if path.name == '__main__.py' or "if __name__ == '__main__':" in path.read_text()}
  assert found == COMMANDS


def test_every_import_points_the_one_way():
  found = violations(sorted(PACKAGE.rglob('*.py')))
  assert not found, 'Imports against the dependency direction:\n  ' + '\n  '.join(found)


def test_a_hidden_import_against_the_direction_is_named(tmp_path):
  """The check itself: a function-local import of the models from checkpoints fails, and one
  of the fit analysis from the trainer, which it imports."""
  fake = tmp_path / 'upcycle' / 'checkpoints' / 'sneaky.py'
  fake.parent.mkdir(parents=True)
  fake.write_text('def shapes(config):\n  from upcycle.models import t5\n  return t5\n')
  relative = tmp_path / 'upcycle' / 'upcycling' / 'relative.py'
  relative.parent.mkdir(parents=True)
  relative.write_text('from ..train import state\n')
  trainer = tmp_path / 'upcycle' / 'train' / 'trainer.py'
  trainer.parent.mkdir(parents=True)
  trainer.write_text('from upcycle import moe\n\ndef mfu():\n  from upcycle.fit import roofline\n')
  assert violations([fake, relative, trainer], tmp_path / 'upcycle') == [
      'upcycle/checkpoints/sneaky.py:2: upcycle.checkpoints imports upcycle.models, against '
      "the direction (upcycle.checkpoints may import ['locks', 'optimizer_state', 'progress', "
      "'tree'])",
      'upcycle/upcycling/relative.py:1: upcycle.upcycling imports upcycle.train, against the '
      "direction (upcycle.upcycling may import ['checkpoints', 'fields', 'leaf_ops', "
      "'optimizer_state', 'progress', 'router_scale', 'tree'])",
      'upcycle/train/trainer.py:4: upcycle.train imports upcycle.fit, which imports '
      'upcycle.train; move what both need into upcycle.train']


def parts(package: pathlib.Path = PACKAGE) -> set:
  """The top-level parts of `package`: its modules (`__init__` too) and subpackages."""
  return ({path.stem for path in package.glob('*.py')} |
          {path.name for path in package.iterdir() if (path / '__init__.py').is_file()})


def readme_parts(readme: str) -> set:
  """The parts the first column of README.md's "Architecture" table names."""
  section = readme.split('\n## Architecture\n', 1)[1].split('\n## ', 1)[0]
  rows = [line.split('|')[1] for line in section.splitlines() if line.startswith('| `')]
  return {name.removeprefix('upcycle/').removesuffix('/').removesuffix('.py')
          for row in rows for name in re.findall(r'`([^`]+)`', row)}


def unnamed(found: set, named: set, where: str) -> list:
  """What `found` (the parts of upcycle/) and `named` (a table's) do not share, in words."""
  return ([f'upcycle/ has {sorted(found - named)}, not in {where}'] if found - named else []) + (
      [f'{where} names {sorted(named - found)}, not in upcycle/'] if named - found else [])


def test_the_tables_name_every_part_and_no_other():
  """The dependency table above and README.md's "Architecture" table: a new part is placed in
  both, a removed one leaves both."""
  found = parts()
  readme = (PACKAGE.parent / 'README.md').read_text()
  wrong = (unnamed(found, set(ALLOWED) | WIRING, 'the dependency table of this file') +
           unnamed(found - {'__init__'}, readme_parts(readme), 'README.md\'s "Architecture"'))
  assert not wrong, '\n  '.join(['Parts of upcycle/ and the tables disagree:'] + wrong)


def test_a_part_missing_from_a_table_is_named(tmp_path):
  (tmp_path / 'moe').mkdir()
  (tmp_path / 'moe' / '__init__.py').write_text('')
  (tmp_path / 'tree.py').write_text('')
  (tmp_path / 'notes').mkdir()   # no package
  readme = ('# x\n\n## Architecture\n\n| package | owns |\n|---|---|\n'
            '| `upcycle/tree.py`, `models/` | trees; models (`models/t5.py`) |\n\n## Tests\n'
            '| `moe/` | not this section\'s |\n')
  assert parts(tmp_path) == {'moe', 'tree'}
  assert readme_parts(readme) == {'tree', 'models'}
  assert unnamed(parts(tmp_path), readme_parts(readme), 'the README') == [
      "upcycle/ has ['moe'], not in the README", "the README names ['models'], not in upcycle/"]


# The model configs and modules of upcycle.models.families; dispatching on them is its job.
FAMILY_TYPES = {'T5Config', 'ViTConfig', 'LlamaConfig', 'T5', 'ViT', 'Llama'}
REGISTRY = PACKAGE / 'models' / 'families.py'


def _type_names(node: ast.AST):
  for sub in ast.walk(node):
    if isinstance(sub, ast.Name):
      yield sub.id
    elif isinstance(sub, ast.Attribute):
      yield sub.attr


def family_dispatch(paths, root: pathlib.Path = PACKAGE):
  """'<file>:<line>: ...' for each `isinstance` / `issubclass` / `type(x) is|==` on a model
  config or module outside the registry."""
  out = []
  for path in paths:
    if path == REGISTRY:
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ('isinstance', 'issubclass') and len(node.args) == 2):
        found = set(_type_names(node.args[1])) & FAMILY_TYPES
      elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
            and isinstance(node.left.func, ast.Name) and node.left.func.id == 'type'):
        found = set().union(*(_type_names(c) for c in node.comparators)) & FAMILY_TYPES
      else:
        continue
      for name in sorted(found):
        out.append(f'{path.relative_to(root.parent)}:{node.lineno}: dispatches on {name}; ask '
                   f'upcycle.models.families.of(config) instead')
  return out


def test_model_families_are_dispatched_on_only_by_the_registry():
  from upcycle.models import families  # pylint: disable=g-import-not-at-top
  registered = {t.__name__ for f in families.FAMILIES for t in (f.config, f.module)}
  assert registered == FAMILY_TYPES   # a new family is added to the check too
  found = family_dispatch(sorted(PACKAGE.rglob('*.py')))
  assert not found, ('Dispatch on a model family outside upcycle/models/families.py:\n  ' +
                     '\n  '.join(found))


def test_a_dispatch_on_a_model_config_is_named(tmp_path):
  fake = tmp_path / 'upcycle' / 'infer.py'
  fake.parent.mkdir(parents=True)
  fake.write_text('from upcycle import models\n\ndef f(model, config):\n'
                  '  if isinstance(model, (models.Llama, int)):\n    return 1\n'
                  '  return type(config) is models.T5Config or isinstance(config, dict)\n')
  assert family_dispatch([fake], tmp_path / 'upcycle') == [
      'upcycle/infer.py:4: dispatches on Llama; ask upcycle.models.families.of(config) '
      'instead',
      'upcycle/infer.py:6: dispatches on T5Config; ask upcycle.models.families.of(config) '
      'instead']
