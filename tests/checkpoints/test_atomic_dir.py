"""`atomic_dir.create` beside other outputs' names (the writers' own behaviour is tested through
them: tests/test_convert.py, tests/test_export.py, tests/test_export_hf.py)."""

import os

from upcycle.checkpoints import atomic_dir


def test_only_a_killed_writers_own_work_directories_are_removed(tmp_path):
  """`out.tmp-1700000000-42` is a killed write of `out`'s; `out.tmp-x` is another output and
  `out.tmp-x.tmp-1-2` that output's work directory: both are left alone."""
  for name in ('out.tmp-1700000000-42/a', 'out.tmp-x/a', 'out.tmp-x.tmp-1-2/a'):
    os.makedirs(tmp_path / name)
  final = str(tmp_path / 'out')
  writer = atomic_dir.write_of(final, fix='write elsewhere', taken='taken')
  with atomic_dir.create(final, writer) as work:
    open(os.path.join(work, 'f'), 'w').close()
  assert sorted(os.listdir(tmp_path)) == ['out', 'out.tmp-x', 'out.tmp-x.tmp-1-2']
  assert os.listdir(tmp_path / 'out') == ['f']
