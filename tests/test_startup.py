"""The garbage collector around a command's imports and exit (`upcycle.startup`): a command's
imports are frozen and what its run makes after is collected; imported as a library, the
package leaves the collector as it was."""

import ast
import gc
import pathlib
import subprocess
import sys

from tests.helpers import REPO

# A command's process: begin(), imports, ready(), then a run that makes reference cycles.
_COMMAND = '''
import gc, weakref
from upcycle import startup
startup.begin()
off = not gc.isenabled()
import numpy, json   # the command's imports

class Node:
  pass

before = Node(); before.self = before; kept = weakref.ref(before); del before
startup.ready()
after = Node(); after.self = after; made = weakref.ref(after); del after
gc.collect()
print(off, gc.isenabled(), gc.get_freeze_count() > 1000, kept() is not None, made() is None)
'''


def test_a_command_freezes_what_it_imported_and_collects_what_its_run_makes():
  done = subprocess.run([sys.executable, '-c', _COMMAND], cwd=REPO, capture_output=True,
                        text=True, check=True)
  # Off until ready; then on, the imports frozen (a cycle made before ready() is kept with
  # them), and a cycle the run makes is collected.
  assert done.stdout.split() == ['True', 'True', 'True', 'True', 'True']


def test_imported_as_a_library_the_collector_is_left_alone():
  from upcycle import startup  # pylint: disable=g-import-not-at-top
  frozen = gc.get_freeze_count()
  startup.ready()   # as gin_utils.run calls it when a test runs an entry point's main
  assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_every_command_begins_with_the_collector_off():
  """Each `python -m` module's `if __name__ == '__main__':` block calls startup.begin() first,
  before main() imports the stack."""
  missing = []
  for path in sorted(pathlib.Path(REPO, 'upcycle').rglob('*.py')):
    for node in ast.parse(path.read_text()).body:
      if (isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'" and
          ast.unparse(node.body[0]) != 'startup.begin()'):
        missing.append(str(path.relative_to(REPO)))
  assert not missing, f'commands that do not call startup.begin() first: {missing}'
