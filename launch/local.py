r"""Run one training command as N JAX processes on this machine: the multi-host path, locally.

  python launch/local.py --num_processes=2 --devices_per_process=4 -- \
      --gin_file=models/t5_1_1/tiny.gin --gin_file=runs/pretrain.gin \
      --gin_file=data/offline_span_corruption.gin \
      --gin.MODEL_DIR="'/tmp/dense'" --gin.TRAIN_STEPS=100 \
      --gin.trainer.TrainConfig.num_expert_partitions=2 \
      --gin.trainer.TrainConfig.num_model_partitions=2

Every process runs `python -m upcycle.train <the flags after -->`, exactly what each worker of
a TPU VM slice runs (`launch/tpu_vm.py train`), with its own simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`), joined by `jax.distributed` through a
coordinator on 127.0.0.1 (UPCYCLE_COORDINATOR_ADDRESS, UPCYCLE_NUM_PROCESSES,
UPCYCLE_PROCESS_ID; see `upcycle.distributed.join`). Each process's
output goes to the console prefixed with `[process i]` (but gloo's connection reports,
`gloo_report`) and, with --log_dir, all of it to `<log_dir>/process_<i>.log`.

A process that exits with an error takes the others down: the launcher says which process
failed first and how (its exit status or the signal that killed it; the peers that fail because
it is gone are not blamed), stops the rest (SIGTERM, then SIGKILL after --grace_seconds) with
their console output silenced (it stays in --log_dir) and exits with the failed process's
status, so a crash never leaves its peers waiting in a collective. Ctrl-C or SIGTERM to the
launcher stops every process the same way but for their output, which stays on the console:
each training process stops as on a preemption, saving the step it is at, and says so
(train/preemption.py). So does SIGTERM to one process: JAX's preemption service stops every
process at one step, and the first to exit with status 143 (`STOPPED`) is no failure.
"""

import argparse
import os
import queue
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)   # upcycle/arguments.py (standard library only)
from upcycle import arguments  # pylint: disable=g-import-not-at-top,wrong-import-position


# gloo's (JAX's CPU collectives) connection reports, 4 lines per process and run, e.g.
#   [Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3
# Threads write them at once, word by word, so that their words come mixed over two lines.
_GLOO_WORDS = re.compile(r'\[Gloo\] Rank | is connected to | peer ranks\. |'
                         r'Expected number of connected peer ranks is : |\d+|\s+')


def gloo_report(line: str, continued: bool) -> bool:
  """Whether `line` is (part of) gloo's connection reports: their words only, naming gloo or
  peer ranks, or ending (`continued`) the report the line before began."""
  if _GLOO_WORDS.sub('', line):
    return False
  return continued or '[Gloo]' in line or 'peer ranks' in line


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_env(index: int, num_processes: int, devices: int, port: int,
                base: Optional[dict] = None) -> dict:
  """The environment of process `index`: its CPU devices and the coordinator's address."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  env.update({
      'XLA_FLAGS': ' '.join(flags + [f'--xla_force_host_platform_device_count={devices}']),
      'JAX_PLATFORMS': 'cpu',
      'UPCYCLE_COORDINATOR_ADDRESS': f'127.0.0.1:{port}',
      'UPCYCLE_NUM_PROCESSES': str(num_processes),
      'UPCYCLE_PROCESS_ID': str(index),
      'PYTHONUNBUFFERED': '1',
  })
  env['PYTHONPATH'] = os.pathsep.join([REPO] + [p for p in [env.get('PYTHONPATH')] if p])
  return env


def _say(message: str) -> None:
  """To stderr; a closed stderr (the caller died) must not keep the launcher from stopping."""
  try:
    print(message, file=sys.stderr, flush=True)
  except OSError:
    pass


# The exit status of `python -m upcycle.train` stopped on SIGTERM with its step saved.
STOPPED = 128 + signal.SIGTERM


def _describe(returncode: int) -> str:
  if returncode < 0:
    return f'was killed by {signal.Signals(-returncode).name}'
  return f'exited with status {returncode}'


class Job:
  """N processes of one command; `wait()` returns the job's exit status."""

  def __init__(self, command: Sequence[str], num_processes: int, devices: int,
               log_dir: Optional[str] = None, grace_seconds: float = 10.0, quiet: bool = False,
               interrupted: Optional[threading.Event] = None):
    """`interrupted`: once set (by `interrupt_on_signals`' handlers), `wait` stops every
    process."""
    self.grace_seconds, self.quiet = grace_seconds, quiet
    self.interrupted = interrupted or threading.Event()
    port = free_port()
    self.logs = []
    if log_dir:
      os.makedirs(log_dir, exist_ok=True)
    self.procs: List[subprocess.Popen] = []
    self._pumps: List[threading.Thread] = []
    self._waiters: List[threading.Thread] = []
    self._ended: 'queue.Queue[Tuple[int, int]]' = queue.Queue()   # in the order they end
    self._silenced: Set[int] = set()   # processes whose output no longer goes to the console
    for i in range(num_processes):
      log = open(os.path.join(log_dir, f'process_{i}.log'), 'w') if log_dir else None
      self.logs.append(log)
      proc = subprocess.Popen(list(command), env=process_env(i, num_processes, devices, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
      self.procs.append(proc)
      _say(f'launch/local.py: process {i} is pid {proc.pid}')
      self._pumps.append(_start(self._pump, i, proc, log))
      self._waiters.append(_start(lambda i, proc: self._ended.put((i, proc.wait())), i, proc))

  def _pump(self, index: int, proc: subprocess.Popen, log) -> None:
    gloo = False
    for line in proc.stdout:
      if log:
        log.write(line)
        log.flush()
      gloo = gloo_report(line, gloo)   # to the log only
      if not self.quiet and index not in self._silenced and not gloo:
        try:
          sys.stdout.write(f'[process {index}] {line}')
          sys.stdout.flush()
        except OSError:   # Nobody reads the console any more; keep draining the pipe.
          self.quiet = True

  def _silence_all_but(self, index: int) -> None:
    self._silenced.update(i for i in range(len(self.procs)) if i != index)

  def stop(self) -> None:
    """SIGTERM to every live process (and its children), SIGKILL after the grace period."""
    live = [i for i, p in enumerate(self.procs) if p.returncode is None]
    for i in live:   # jax.distributed traps SIGTERM (preemption notice): SIGKILL follows.
      _signal_group(self.procs[i], signal.SIGTERM)
    deadline = time.time() + self.grace_seconds
    for i in live:
      self._waiters[i].join(timeout=max(deadline - time.time(), 0.01))
      if self._waiters[i].is_alive():
        _signal_group(self.procs[i], signal.SIGKILL)
        self._waiters[i].join()

  def _failed(self, index: int, code: int, running: int) -> int:
    """Says which process failed first and how, after its last output, then stops the rest.
    A process stopped on SIGTERM (a training process saved its step) is no failure: the rest
    stop the same way, with their output on the console."""
    if code == STOPPED:
      self.stop()
      self._drain()
      _say(f'launch/local.py: process {index} stopped on SIGTERM (exit status {code}); stopped '
           f'the other {running} process(es) too.')
      return code
    self._settle(index)   # what the peers said before the failure still reaches the console
    self._silence_all_but(index)   # the peers' reactions (JAX fatal-error stacks) are noise
    self._pumps[index].join(timeout=5)
    _say(f'launch/local.py: process {index} {_describe(code)}; stopping the other {running} '
         f'process(es) so that none waits for it forever.')
    self.stop()
    return code if code > 0 else 128 - code

  def _settle(self, index: int, timeout: float = 1.0) -> None:
    """Waits (`timeout` at most) until the pipes of every process but `index` hold nothing
    unread, then a moment for their pumps to write what they read: on a loaded machine a pump
    lags behind its process, and a peer's output from before the failure is no reaction."""
    pipes = [proc.stdout for i, proc in enumerate(self.procs) if i != index]
    deadline = time.time() + timeout
    while pipes and time.time() < deadline and select.select(pipes, [], [], 0)[0]:
      time.sleep(0.02)
    time.sleep(0.05)

  def wait(self, poll_seconds: float = 0.2) -> int:
    """0 when every process exits 0; else the status of the first process to fail (in the
    order they end: a peer that dies because of it is not blamed)."""
    try:
      running = len(self.procs)
      while running:
        if self.interrupted.is_set():   # every process stops as on a preemption, saying so
          self.stop()
          self._drain()
          _say('launch/local.py: interrupted; stopped every process.')
          return 130
        try:
          index, code = self._ended.get(timeout=poll_seconds)
        except queue.Empty:
          continue
        running -= 1
        if code:
          return self._failed(index, code, running)
      return 0
    finally:
      self._drain()
      for log in self.logs:
        if log:
          log.close()

  def _drain(self) -> None:
    """Waits (5 s at most each) for the processes' last output to be written."""
    for thread in self._pumps:
      thread.join(timeout=5)


def _start(target, *args) -> threading.Thread:
  thread = threading.Thread(target=target, args=args, daemon=True)
  thread.start()
  return thread


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(proc.pid, signum)
  except ProcessLookupError:   # it ended meanwhile
    pass


def interrupt_on_signals() -> threading.Event:
  """An event that Ctrl-C and SIGTERM set, for `Job.wait` to see between two polls.

  Not KeyboardInterrupt: raised at any point of the main thread, it can leave the lock of the
  queue the processes' exits arrive on held, and the launcher waiting on it forever.
  """
  event = threading.Event()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: event.set())
  return event


def build_parser() -> argparse.ArgumentParser:
  parser = arguments.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
      usage='python launch/local.py [options] -- <python -m upcycle.train flags>')
  parser.add_argument('--num_processes', type=int, default=2, help='JAX processes (hosts)')
  parser.add_argument('--devices_per_process', type=int, default=4,
                      help='simulated CPU devices of each process')
  parser.add_argument('--module', default='upcycle.train',
                      help='the entry point every process runs (python -m MODULE)')
  parser.add_argument('--log_dir', default=None, help='also write process_<i>.log here')
  parser.add_argument('--grace_seconds', type=float, default=10.0,
                      help='after SIGTERM, how long the others get before SIGKILL')
  parser.add_argument('--dry_run', action='store_true',
                      help='print each process\'s command and environment, run none')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  split = argv.index('--') if '--' in argv else len(argv)
  args = build_parser().parse_args(argv[:split])
  if args.num_processes < 1 or args.devices_per_process < 1:
    raise SystemExit('--num_processes and --devices_per_process must be >= 1.')
  command = [sys.executable, '-m', args.module] + argv[split + 1:]
  if args.dry_run:
    port = free_port()
    for i in range(args.num_processes):
      env = process_env(i, args.num_processes, args.devices_per_process, port, base={})
      print('+ ' + ' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(env.items()))
            + ' ' + shlex.join(command))
    return 0
  interrupted = interrupt_on_signals()
  return Job(command, args.num_processes, args.devices_per_process, args.log_dir,
             args.grace_seconds, interrupted=interrupted).wait()


if __name__ == '__main__':
  sys.exit(main())
