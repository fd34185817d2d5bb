"""T5X-style command-line gin handling for the entry points (the only place gin lives besides
configs/).

  --gin_file=A.gin --gin_file=B.gin     later files win; looked up in --gin_search_paths
  --gin.KEY=VALUE                       shorthand for --gin_bindings='KEY = VALUE'
  --gin_bindings='KEY = VALUE'          repeatable
  --gin_search_paths=a,b                where gin files and their includes are found
                                        (default: the repository's configs/ and the cwd)
"""

import argparse
import logging
import os
from typing import Any, Callable, List, Sequence, Tuple

import gin

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def parse_flags(argv: Sequence[str], description: str) -> Tuple[argparse.Namespace, List[str]]:
  """Splits argv into known flags and gin bindings (from --gin.K=V and --gin_bindings)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file; repeatable, later files override earlier ones')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="a binding such as \"MODEL_DIR = '/tmp/run'\"; repeatable")
  parser.add_argument('--gin_search_paths', default='',
                      help='comma-separated directories to look for gin files in')
  parser.add_argument('--multi_host', choices=('auto', 'yes', 'no'), default='auto',
                      help='call jax.distributed.initialize() (auto: on multi-host TPU VMs)')
  bindings, rest = [], []
  for arg in argv:
    if arg.startswith('--gin.'):
      key, sep, value = arg[len('--gin.'):].partition('=')
      if not sep:
        raise SystemExit(f'{arg}: expected --gin.KEY=VALUE.')
      bindings.append(f'{key} = {value}')
    else:
      rest.append(arg)
  args = parser.parse_args(rest)
  return args, list(args.gin_bindings) + bindings


class _QuietSearch(logging.Filter):
  """gin logs 'Path not found' for every search path it tries before the one that has the file."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Path not found')


def parse_gin(args: argparse.Namespace, bindings: Sequence[str]) -> None:
  """Registers search paths, then parses files in order and the bindings last."""
  paths = [p for p in args.gin_search_paths.split(',') if p] + [CONFIGS_DIR, os.getcwd()]
  for path in paths:
    gin.add_config_file_search_path(path)
  if not args.gin_file:
    raise SystemExit('Give at least one --gin_file (see configs/ and the README).')
  quiet = _QuietSearch()
  logging.getLogger().addFilter(quiet)
  try:
    gin.parse_config_files_and_bindings(args.gin_file, bindings, finalize_config=True)
  except (ValueError, IOError, SyntaxError) as e:
    raise SystemExit(f'gin configuration error: {e}') from e
  finally:
    logging.getLogger().removeFilter(quiet)


def maybe_initialize_distributed(mode: str) -> None:
  """Joins the hosts of a TPU pod slice before JAX is used (every host runs the same command)."""
  import jax  # pylint: disable=g-import-not-at-top
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '')
  if mode == 'yes' or (mode == 'auto' and ',' in hosts):
    jax.distributed.initialize()


def write_config(model_dir: str, operative: bool = False) -> None:
  """Writes MODEL_DIR/config.gin (everything parsed, at start) or operative_config.gin (what
  was actually used, at the end), as T5X does. Process 0 only."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return
  os.makedirs(model_dir, exist_ok=True)
  name, text = (('operative_config.gin', gin.operative_config_str()) if operative
                else ('config.gin', gin.config_str()))
  with open(os.path.join(model_dir, name), 'w') as f:
    f.write(text)


def run(fn: Callable[..., Any], argv: Sequence[str], description: str) -> Any:
  """An entry point's main: flags, multi-host setup, gin files and bindings, then `fn()` with
  its arguments bound by gin (gin files refer to it as `__main__.<fn name>`, as in T5X)."""
  args, bindings = parse_flags(argv, description)
  maybe_initialize_distributed(args.multi_host)
  configured = gin.configurable(fn)
  parse_gin(args, bindings)
  return configured()
