"""A training job on TPU VM workers that outlives the ssh session starting it.

Each function returns one shell command line for `gcloud compute tpus tpu-vm ssh
--command=...`, run the same on every worker. `start` runs the job under `setsid nohup`, its
output in ~/upcycle_logs/<run>.log, so a dropped connection or the launcher's exit leaves it
running; <run>.pid holds its process group, <run>.exit `exit=<status>` once it has ended
(`stopped` after `stop`). With a gs:// log directory the log is copied there as
<run>-<worker hostname>.log every COPY_SECONDS and when the job ends. `status` prints one line
per worker, `upcycle-job <run> <hostname> <state>` (state: running, exit=N, stopped, absent),
then the log's last lines; `worker_states` reads those lines back.
"""

import re
import shlex
from typing import Dict, Mapping, Optional, Sequence

LOG_DIR = '$HOME/upcycle_logs'   # expanded on the worker
COPY_SECONDS = 300
STOP_GRACE_SECONDS = 300   # the trainer saves the step SIGTERM finds it at (train/preemption.py)
_STATE = re.compile(r'^upcycle-job (\S+) (\S+) (\S+)$')


def log_path(run: str) -> str:
  return f'{LOG_DIR}/{run}.log'


def _files(run: str) -> tuple:
  return log_path(run), f'{LOG_DIR}/{run}.pid', f'{LOG_DIR}/{run}.exit'


def _alive(pid_file: str) -> str:
  """A shell test: the job whose process id `pid_file` holds is running (not a zombie)."""
  return _running(f'"$(cat {pid_file} 2>/dev/null)"')


def _running(pid: str) -> str:
  return f'ps -o stat= -p {pid} 2>/dev/null | grep -qv Z'


def _group_running(pgid: str) -> str:
  """A shell test: a process of group `pgid` other than a zombie still runs. The `bash -c`
  wrapper that leads the group dies at SIGTERM at once; the trainer under it saves first."""
  return (f"ps -eo pgid=,stat= | awk -v g={pgid} '$1 == g && $2 !~ /^Z/ {{f = 1}} "
          "END {exit !f}'")


def start(run: str, workdir: str, argv: Sequence[str], env: Mapping[str, str],
          gcs_log_dir: Optional[str] = None) -> str:
  """Starts `env argv` in `workdir`, detached; refuses (exit 3) while `run` still runs.

  The job is a bash function exported to the `setsid nohup bash` that runs it, so the training
  command is quoted once, as it would be typed.
  """
  log, pid, exit_file = _files(run)
  command = ' '.join([f'{k}={shlex.quote(v)}' for k, v in env.items()] + [shlex.join(argv)])
  job = f'{command} >> {log} 2>&1; code=$?'
  if gcs_log_dir:
    copy = f'gcloud storage cp {log} {shlex.quote(gcs_log_dir)}/{run}-$(hostname).log'
    job = (f'( while sleep {COPY_SECONDS}; do {copy} > /dev/null 2>&1; done ) & copier=$!; '
           f'{job}; pkill -P $copier; kill $copier 2> /dev/null; {copy} > /dev/null 2>&1')
  return '; '.join([
      f'mkdir -p {LOG_DIR} && cd {workdir} || exit 1',
      f'if {_alive(pid)}; then echo "{run} is already running on $(hostname)" >&2; exit 3; fi',
      f'rm -f {exit_file}',
      f'upcycle_job() {{ {job}; {_write(exit_file, "exit=$code")}; }}',
      'export -f upcycle_job',
      'setsid nohup bash -c upcycle_job > /dev/null 2>&1 < /dev/null & echo $! > ' + pid,
      f'echo "started {run} on $(hostname); log: {log}"'])


def _write(path: str, text: str) -> str:
  """Shell that writes `text` to `path` whole: to a temporary file, then renamed, so a reader
  (`status`, a test polling for the file) never sees it created but not yet written."""
  return f'echo {text} > {path}.tmp && mv -f {path}.tmp {path}'


def status(run: str, lines: int) -> str:
  """The job's state on this worker, then the last `lines` lines of its log."""
  log, pid, exit_file = _files(run)
  return (f'if {_alive(pid)}; then s=running; else s=$(cat {exit_file} 2>/dev/null || '
          f'echo absent); fi; echo "upcycle-job {run} $(hostname) $s"'
          + (f'; tail -n {lines} {log} 2>/dev/null; true' if lines else ''))


def stop(run: str) -> str:
  """SIGTERM to the job's process group; SIGKILL to what of it still runs STOP_GRACE_SECONDS
  later (the trainer saves the step SIGTERM finds it at before it exits)."""
  _, pid, exit_file = _files(run)
  return (f'if {_alive(pid)}; then p=$(cat {pid}); kill -TERM -- -$p; '
          f'for i in $(seq {STOP_GRACE_SECONDS}); do {_group_running("$p")} || break; sleep 1; '
          f'done; kill -KILL -- -$p 2>/dev/null; {_write(exit_file, "stopped")}; '
          f'echo "stopped {run} on $(hostname)"; else echo "{run} is not running on $(hostname)"; '
          'fi')


def logs(run: str, lines: int, follow: bool) -> str:
  return f'tail -n {lines} {"-F " if follow else ""}{log_path(run)}'


def worker_states(output: str, run: str) -> Dict[str, str]:
  """{hostname: state} from the `status` lines in `output` (ssh's, of every worker)."""
  found = (_STATE.match(line.strip()) for line in output.splitlines())
  return {m.group(2): m.group(3) for m in found if m and m.group(1) == run}
