"""upcycle.checkpoints.gcs against the GCS emulator, in this process (tensorstore only, which
TENSORSTORE_GCS_HTTP_URL redirects): completion markers are copied last and deleted first."""

import pytest

from upcycle.checkpoints import gcs

SRC, DST = 'gs://bucket/objects/src', 'gs://bucket/objects/dst'
NAMES = ('3/_CHECKPOINT_METADATA', '3/commit_success.txt', '3/params/commit_success.txt',
         '3/params/d/a', 'checkpoint_3/checkpoint', 'checkpoint_3/x/0', 'zz')
MARKERS_IN_ORDER = ['3/params/commit_success.txt', '3/commit_success.txt',
                    'checkpoint_3/checkpoint']


class _Recording:
  """A kvstore that records the keys written (True) and deleted (False) through it."""

  def __init__(self, store, log):
    self._store, self._log = store, log

  def write(self, key, value):
    self._log.append((key, value is not None))
    return self._store.write(key, value)

  def __getattr__(self, name):
    return getattr(self._store, name)


@pytest.fixture
def log(gcs_emulator, monkeypatch):
  for k, v in gcs_emulator.items():
    monkeypatch.setenv(k, v)
  for name in NAMES:
    gcs.write_bytes(f'{SRC}/{name}', name.encode())
  gcs.write_bytes('gs://bucket/objects/srcx', b'a sibling, not inside')
  calls = []
  bucket = gcs._bucket  # pylint: disable=protected-access

  def recording(url):
    store, key = bucket(url)
    return _Recording(store, calls), key

  monkeypatch.setattr(gcs, '_bucket', recording)
  return calls


def test_copy_writes_the_markers_last_and_delete_removes_them_first(log):
  assert gcs.names(SRC) == sorted(NAMES)
  assert gcs.copy_tree(SRC, DST) == len(NAMES)
  written = [key[len('objects/dst/'):] for key, write in log if write]
  assert sorted(written) == sorted(NAMES) and written[-3:] == MARKERS_IN_ORDER
  assert all(gcs.read_bytes(f'{DST}/{name}') == name.encode() for name in NAMES)
  log.clear()
  gcs.delete_tree(DST)
  deleted = [key[len('objects/dst/'):] for key, write in log if not write]
  assert deleted[:3] == MARKERS_IN_ORDER and not gcs.has_content(DST)
  assert gcs.names(SRC) == sorted(NAMES)
  assert gcs.is_object('gs://bucket/objects/srcx')


def test_listing_stays_inside_the_directory(log):
  del log
  assert gcs.names('gs://bucket/objects/none') == []
  assert not gcs.has_content('gs://bucket/objects/none')
  assert gcs.has_content(SRC) and gcs.has_content('gs://bucket/objects/srcx')
  assert gcs.names_starting_with('gs://bucket/objects/src') == (
      [f'{SRC}/{n}' for n in sorted(NAMES)] + ['gs://bucket/objects/srcx'])
