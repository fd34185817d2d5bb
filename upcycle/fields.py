"""Checks for config dataclass fields (and entry points' arguments), run at construction so a
bad value fails before any work.

Each check names the field as a gin binding would (`trainer.TrainConfig.checkpoint_every`:
module, class, field), since that is where wrong values usually come from. Booleans are not
accepted as numbers; ints are accepted as floats.
"""

import collections.abc
import numbers
import os
import sys
from typing import Any, Optional, Sequence


class ConfigError(ValueError):
  """A config field has a value of the wrong type or out of range."""


def binding(obj: Any, field: str) -> str:
  """'trainer.TrainConfig.checkpoint_every' for TrainConfig (upcycle/train/trainer.py),
  'moe.MoeConfig.dispatch' for MoeConfig (defined in upcycle/moe/config.py, exported by
  upcycle.moe):
  the last name of the outermost module that exports the class."""
  cls = type(obj)
  module = cls.__module__
  while '.' in module:
    parent = module.rsplit('.', 1)[0]
    if getattr(sys.modules.get(parent), cls.__name__, None) is not cls:
      break
    module = parent
  return f'{module.rsplit(".", 1)[-1]}.{cls.__name__}.{field}'


def _fail(obj: Any, field: str, expected: str) -> ConfigError:
  return ConfigError(f'{binding(obj, field)} = {getattr(obj, field)!r}: expected {expected}.')


def integer(obj: Any, field: str, minimum: Optional[int] = None) -> None:
  integer_value(binding(obj, field), getattr(obj, field), minimum)


def integer_value(name: str, value: Any, minimum: Optional[int] = None) -> None:
  """`integer` for a value that is no dataclass field (an entry point's argument), named
  `name` (its binding)."""
  ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  if not ok or (minimum is not None and value < minimum):
    expected = 'an integer' + (f' >= {minimum}' if minimum is not None else '')
    raise ConfigError(f'{name} = {value!r}: expected {expected}.')


def divisor_value(name: str, value: int, total: int, of: str) -> None:
  """`value` (an integer >= 1, named `name`: its binding) divides `total`, named `of` (a batch
  split in microbatches, a sequence in loss chunks)."""
  if total % value:
    raise ConfigError(f'{name} = {value} does not divide {of} ({total}). Fix: a divisor of '
                      f'{total}.')


def optional_integer(obj: Any, field: str, minimum: int, none: str = '') -> None:
  """None or an integer >= minimum; `none`, what None means, is said in the error."""
  value = getattr(obj, field)
  if value is None:
    return
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
    raise _fail(obj, field, f'an integer >= {minimum}' + (f', or None ({none})' if none else ''))


def number(obj: Any, field: str, minimum: float = 0.0, strictly: bool = False) -> None:
  """A real number >= minimum (> minimum when `strictly`)."""
  number_value(binding(obj, field), getattr(obj, field), minimum, strictly)


def number_value(name: str, value: Any, minimum: float = 0.0, strictly: bool = False) -> None:
  """`number` for a value that is no dataclass field (a function's argument bound in gin),
  named `name` (its binding)."""
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if not ok or value < minimum or (strictly and value == minimum):
    raise ConfigError(f"{name} = {value!r}: expected a number {'>' if strictly else '>='} "
                      f'{minimum}.')


def fraction(obj: Any, field: str) -> None:
  """A real number in [0, 1) (a dropout rate)."""
  value = getattr(obj, field)
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if not ok or not 0 <= value < 1:
    raise _fail(obj, field, 'a number in [0, 1)')


def integers(obj: Any, field: str, length: int, minimum: int) -> None:
  """A sequence of `length` integers >= minimum (an image size in pixels, ...)."""
  value = getattr(obj, field)
  ok = (isinstance(value, collections.abc.Sequence) and not isinstance(value, str)
        and len(value) == length
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= minimum
                for v in value))
  if not ok:
    raise _fail(obj, field, f'{length} integers >= {minimum}')


def instance(obj: Any, field: str, cls: type, how: str) -> None:
  """An instance of `cls` (a small config bound in gin as `@...()`); `how` says how to make one."""
  if not isinstance(getattr(obj, field), cls):
    raise _fail(obj, field, f'a {cls.__module__.rsplit(".", 1)[-1]}.{cls.__name__} object, {how}')


def optional_instance(obj: Any, field: str, cls: type, example: str) -> None:
  """None or an instance of `cls`; `example` shows how to make one (a gin reference)."""
  value = getattr(obj, field)
  if value is not None and not isinstance(value, cls):
    raise _fail(obj, field, f'None or a {cls.__name__} such as {example}')


def boolean(obj: Any, field: str) -> None:
  if not isinstance(getattr(obj, field), bool):
    raise _fail(obj, field, 'True or False')


def choice(obj: Any, field: str, choices: Sequence[Any]) -> None:
  if getattr(obj, field) not in choices:
    raise _fail(obj, field, f'one of {tuple(choices)}')


def string(obj: Any, field: str) -> None:
  if not isinstance(getattr(obj, field), str) or not getattr(obj, field):
    raise _fail(obj, field, 'a non-empty string')


def lengths(obj: Any, field: str, keys: Sequence[str], example: str,
            only: bool = False) -> None:
  """A mapping of at least `keys` (with `only`, of `keys` alone) to integers >= 1 (feature
  lengths); `example` shows one."""
  value = getattr(obj, field)
  ok = (isinstance(value, collections.abc.Mapping)
        and (set(keys) == set(value) if only else set(keys) <= set(value))
        and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                for v in value.values()))
  if not ok:
    raise _fail(obj, field, f'a mapping of {"only " if only else ""}'
                            f'{" and ".join(map(repr, keys))} to integers >= 1, such as '
                            f'{example}')


def directory(name: str, path: str) -> None:
  """A local directory that exists or can be made, `name` its binding: checked before a run
  writes there, as the OS errors a path that cannot be made gives later (File exists, Not a
  directory, File name too long) name no binding. gs:// paths pass."""
  if '://' in path:
    return
  path = os.path.abspath(path)
  existing = path
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    what = (f'a symbolic link to {os.readlink(existing)}, which does not exist'
            if not os.path.exists(existing) else 'a file, not a directory')
    where = (f'{name} = {path!r} is {what}' if existing == path else
             f'{name} = {path!r}: {existing} is {what}, so no directory can be made under it')
    raise ConfigError(f'{where}. Fix: give a directory (one that does not exist yet is '
                      f'created).')
  limit = os.pathconf(existing, 'PC_NAME_MAX')
  for part in os.path.relpath(path, existing).split(os.sep):
    if len(part) > limit:
      raise ConfigError(f'{name}: the name {part[:16]}... in {existing} is {len(part)} '
                        f'characters long; the filesystem allows {limit}. Fix: give a shorter '
                        f'name.')
