"""Runs the study's training runs, `jobs` at a time, in dependency order, resumably.

Each run's output goes to its directory's `study.log` (a run with a final evaluation,
`Run.final_eval_batches`, runs it after training, in the same slot and log); a run that
finished (its `study.done` marker exists) is not run again, so an interrupted study continues
where it stopped. Every run's CPU code is generated for SSE4.2 on x86-64
(`platforms.portable_cpu_codegen`), so a run computes the same bits on every image of a
machine; its `study.json` and the first line of its log give the command with that XLA_FLAGS. A
failed run is reported (its `study.failed` holds the end of its log), the runs that start from it
are skipped, and the others go on.
"""

import json
import os
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Sequence

from upcycle import platforms
from upcycle.study.runs import Run
from upcycle.study.scale import Scale

DONE = 'study.done'
FAILED = 'study.failed'
LOG = 'study.log'


def finished(run: Run, runs_dir: str) -> bool:
  return os.path.exists(os.path.join(run.directory(runs_dir), DONE))


def _failure(run: Run, runs_dir: str, code: int) -> RuntimeError:
  with open(os.path.join(run.directory(runs_dir), LOG)) as f:
    tail = ''.join(f.readlines()[-30:])
  return RuntimeError(f'{run.name} failed (exit status {code}); the end of '
                      f'{os.path.join(run.directory(runs_dir), LOG)}:\n{tail}')


def _start(command: List[str], log, repository: str, env: Dict[str, str]) -> subprocess.Popen:
  """`command` started in `repository`, its output appended to `log` after the command line
  (with the XLA_FLAGS it runs under)."""
  log.write(f"XLA_FLAGS={shlex.quote(env.get('XLA_FLAGS', ''))} {shlex.join(command)}\n")
  log.flush()
  return subprocess.Popen(command, cwd=repository, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_all(runs: Sequence[Run], runs_dir: str, scale: Scale, *, jobs: int = 2,
            repository: str = '.', python: str = sys.executable) -> List[str]:
  """Runs every run not yet finished, printing one line per finished run with an ETA; returns
  the runs that failed (their `study.failed` holds the end of the log) or could not start
  because a run they start from failed. A failed run is tried again by the next invocation."""
  todo: List[Run] = [r for r in runs if not finished(r, runs_dir)]
  names = {r.name for r in runs}
  for r in runs:
    missing = [d for d in r.dependencies() if d not in names]
    if missing:
      raise ValueError(f'{r.name} starts from {missing}, which the study does not run.')
  running: Dict[str, tuple] = {}
  # Runs of one arm differ only in their seed: they compile the same programs, once.
  env = platforms.portable_cpu_codegen(
      {**os.environ, 'JAX_COMPILATION_CACHE_DIR': os.path.join(runs_dir, '.jax_cache')})
  total, done, start = len(todo), 0, time.time()
  failed: List[str] = []
  print(f'study: {len(runs)} runs, {len(runs) - total} already finished, {total} to run, '
        f'{jobs} at a time; logs in <run>/{LOG}', flush=True)
  while todo or running:
    ready = [r for r in todo if all(d not in running and d not in {t.name for t in todo}
                                    for d in r.dependencies())]
    while ready and len(running) < jobs:
      run = ready.pop(0)
      todo.remove(run)
      os.makedirs(run.directory(runs_dir), exist_ok=True)
      log = open(os.path.join(run.directory(runs_dir), LOG), 'w')
      commands = [run.command(runs_dir, scale, python)]
      if run.final_eval_batches is not None:
        commands.append(run.final_eval_command(runs_dir, python))
      with open(os.path.join(run.directory(runs_dir), 'study.json'), 'w') as f:
        json.dump({'command': commands[0], 'xla_flags': env.get('XLA_FLAGS', ''),
                   'source': run.source}, f)
      running[run.name] = (run, _start(commands[0], log, repository, env), log, time.time(),
                           commands[1:])
    time.sleep(0.5)
    for name, (run, proc, log, began, after) in list(running.items()):
      code = proc.poll()
      if code is None:
        continue
      if code == 0 and after:   # the run's next command (its final evaluation) in its slot
        running[name] = (run, _start(after[0], log, repository, env), log, began, after[1:])
        continue
      log.close()
      del running[name]
      if code != 0:
        error = _failure(run, runs_dir, code)
        with open(os.path.join(run.directory(runs_dir), FAILED), 'w') as f:
          f.write(str(error))
        failed.append(run.name)
        print(f'study: {error}', flush=True)
        blocked = [r for r in todo if run.name in r.dependencies()]
        for r in blocked:      # they would start from a run that does not exist
          todo.remove(r)
          failed.append(r.name)
        continue
      if os.path.exists(os.path.join(run.directory(runs_dir), FAILED)):
        os.remove(os.path.join(run.directory(runs_dir), FAILED))   # an earlier try's
      with open(os.path.join(run.directory(runs_dir), DONE), 'w') as f:
        f.write(f'{time.time() - began:.1f}\n')   # seconds the run took
      done += 1
      elapsed = time.time() - start
      eta = elapsed / done * (total - done)
      print(f'study: [{done}/{total}] {name} in {time.time() - began:.0f} s; '
            f'elapsed {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min', flush=True)
  return failed
