"""The command-line parser of every entry point (`python -m upcycle.*`, launch/*.py): argparse's,
with two differences that make a mistyped flag an error the user sees at once.

- No abbreviations: `--gin_fil=x.gin` is an unknown flag, never taken as `--gin_file`.
- A bad flag (unknown, a missing or invalid value) ends in one line and exit status 1, as every
  other error a user can cause, not argparse's usage block and status 2; `--help` prints the
  flags and exits 0.

Standard library only: launch/*.py import it on a machine without the project's dependencies.
"""

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
  """`argparse.ArgumentParser` without abbreviations, whose errors are one line and status 1
  (module doc). Sub-command parsers (`add_subparsers`) are of this class too."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('allow_abbrev', False)
    super().__init__(*args, **kwargs)

  def error(self, message: str) -> NoReturn:
    raise SystemExit(f'error: {message} (--help lists the flags).')
