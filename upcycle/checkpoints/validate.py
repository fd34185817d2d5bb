"""Does a parameter tree fit a model? Names and shapes, checked before anything is used.

Dtypes are not compared: a bfloat16 checkpoint legitimately feeds a float32 model.
"""

from typing import Any, Dict, Optional

from upcycle import tree
from upcycle.checkpoints import describe
from upcycle.checkpoints.errors import checkpoint_error

_LISTED = 6


def _listed(paths) -> str:
  paths = sorted(paths)
  more = f' and {len(paths) - _LISTED} more' if len(paths) > _LISTED else ''
  return ', '.join(paths[:_LISTED]) + more


def check_params(params: Dict[str, Any], expected: Dict[str, Any], source: str,
                 names: Optional[Dict[str, str]] = None, fix: Optional[str] = None) -> None:
  """Raises CheckpointError unless `params` has exactly the paths and shapes of `expected`.

  Args:
    params: nested dict read from `source` (leaves with `.shape`).
    expected: nested dict of objects with `.shape` (e.g.
      `upcycle.models.abstract_params(config)`).
    source: the file or directory `params` came from, for the message.
    names: contract path -> the name in the source file, when they differ.
    fix: what to do, appended to the message.
  """
  found, want = tree.flatten(params), tree.flatten(expected)
  missing, unexpected = set(want) - set(found), set(found) - set(want)
  if missing or unexpected:
    kind_found, kind_want = describe.model_kind(found), describe.model_kind(want)
    what = 'the checkpoint does not fit the model'
    if kind_found and kind_want and kind_found != kind_want:
      what = f'the checkpoint holds a {kind_found.upper()}, the model is a {kind_want.upper()}'
    raise checkpoint_error(
        source, what, expected=f'{len(want)} parameters; missing: {_listed(missing) or "none"}',
        found=f'{len(found)} parameters; unexpected: {_listed(unexpected) or "none"}',
        fix=fix or 'Load it with the model config it was trained with')
  for path in sorted(want):
    got, need = tuple(found[path].shape), tuple(want[path].shape)
    if got != need:
      stored = (names or {}).get(path)
      raise checkpoint_error(
          source, 'shape does not match the model config' + (
              f' (stored as {stored!r})' if stored else ''), param=path,
          expected=need, found=got, fix=fix or 'Use the model config the checkpoint was '
          'trained with (upcycle.describe PATH shows the shapes it implies)')
