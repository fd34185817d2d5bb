"""Which data files of an OCDBT database hold an array, and whether they are whole.

Orbax stores every array of an item in one OCDBT database: a B-tree whose leaves map keys
(`<array name>/<chunk>`) to byte ranges of data files (`ocdbt.process_N/d/<hash>`). A read
error from tensorstore names the key but not the file; `damage` follows the B-tree to the
files and says which is missing or shorter than the ranges it must hold.
"""

import os
import re
from typing import Iterator, List, NamedTuple, Tuple

import tensorstore as ts

_LOCATION = re.compile(r'(?:value|btreenode):(.*):(.+):(\d+):(\d+)')


class ValueRef(NamedTuple):
  path: str     # absolute path of the data file
  offset: int
  length: int


def _parse(directory: str, location: str) -> ValueRef:
  base, relative, offset, length = _LOCATION.fullmatch(location).groups()
  return ValueRef(os.path.join(directory, base, relative), int(offset), int(length))


def value_refs(directory: str, array: str) -> List[ValueRef]:
  """Where the chunks of `array` (its '.'-joined name) lie in the database at `directory`."""
  store = ts.KvStore.open({'driver': 'file', 'path': directory.rstrip('/') + '/'}).result()
  prefix = array.encode() + b'/'
  return [_parse(directory, value) for key, value in _latest_values(store)
          if key.startswith(prefix)]


def _latest_values(store: ts.KvStore) -> Iterator[Tuple[bytes, str]]:
  """(key, indirect value location) of every key of the database's latest version."""
  for version in ts.ocdbt.dump(store).result().get('versions', [])[-1:]:
    yield from _walk_keys(store, version['root']['location'])


def _problems(refs: List[ValueRef]) -> List[str]:
  """What is wrong with the data files holding `refs`: missing, or shorter than a range."""
  problems = []
  for ref in sorted(set(refs)):
    if not os.path.exists(ref.path):
      problems.append(f'data file {ref.path} is missing')
    elif os.path.getsize(ref.path) < ref.offset + ref.length:
      problems.append(f'data file {ref.path} is truncated ({os.path.getsize(ref.path)} bytes; '
                      f'this parameter is at bytes {ref.offset}-{ref.offset + ref.length})')
  return list(dict.fromkeys(problems))


def incomplete_arrays(directory: str) -> List[str]:
  """Names of the arrays in the local database at `directory` whose data files are missing or
  truncated; reads the B-tree only (no array data), so it is cheap to run before a restore.

  Raises ValueError if the B-tree itself cannot be read.
  """
  store = ts.KvStore.open({'driver': 'file', 'path': directory.rstrip('/') + '/'}).result()
  return sorted({key.decode(errors='replace').rsplit('/', 1)[0]
                 for key, value in _latest_values(store)
                 if _problems([_parse(directory, value)])})


def _walk_keys(store: ts.KvStore, location: str) -> Iterator[Tuple[bytes, str]]:
  """(key, indirect value location) of every key under the node `location`."""
  for entry in ts.ocdbt.dump(store, location).result().get('entries', []):
    for value in entry.values():
      if isinstance(value, str) and value.startswith('btreenode:'):
        yield from _walk_keys(store, value)
      elif isinstance(value, str) and value.startswith('value:'):
        yield entry.get('key', b''), value


def damage(directory: str, array: str) -> str:
  """A sentence naming the data files of `array` and what is wrong with them, if it can tell."""
  try:
    refs = value_refs(directory, array)
  except (ValueError, AttributeError, KeyError) as e:  # The B-tree itself is unreadable.
    return f'the OCDBT index under {directory} is unreadable ({str(e).split(" [")[0]})'
  if not refs:
    return f'the OCDBT index under {directory} has no data for it'
  problems = _problems(refs)
  if problems:
    return '; '.join(problems)
  files = sorted({ref.path for ref in refs})
  return f'its data is in {", ".join(files)} (present, but the bytes do not decode)'
