r"""Cloud TPU VM lifecycle for upcycle runs: create, set up, train on every worker, watch, delete.

  WHERE='--name=moe --zone=us-central2-b --project=P --accelerator_type=v4-64'
  python launch/tpu_vm.py create $WHERE --spot
  python launch/tpu_vm.py setup  $WHERE                 # this checkout's HEAD on every worker,
                                                        # installed in a Python 3.11 virtualenv
  python launch/tpu_vm.py train  $WHERE --spot --retries=5 -- \
      --gin_file=models/t5_1_1/base.gin --gin_file=moe/paper_t5.gin --gin_file=runs/upcycle.gin \
      --gin.SCAN_LAYERS=True --gin.BATCH_SIZE=256 --gin.TRAIN_STEPS=1100000 \
      --gin.MODEL_DIR="'gs://bucket/moe'" \
      --gin.INITIAL_CHECKPOINT_PATH="'gs://bucket/t5_1_1_base/checkpoint_1000000'" \
      --gin.trainer.TrainConfig.num_expert_partitions=32
  python launch/tpu_vm.py status $WHERE                 # running / exit status on each worker
  python launch/tpu_vm.py logs   $WHERE --worker=0      # reattach: follow worker 0's log
  python launch/tpu_vm.py stop   $WHERE
  python launch/tpu_vm.py eval   $WHERE --run=ev -- --gin_file=... --gin.CHECKPOINT_PATH=...
  python launch/tpu_vm.py infer  $WHERE --run=dec -- --gin_file=... --gin.CHECKPOINT_PATH=...
  python launch/tpu_vm.py delete $WHERE

Every subcommand takes --dry_run (print every command, run none). Each command is a plain
`gcloud compute tpus ...` (or git / tar) call, printed before it runs, so what this script does
can be done by hand. `train` starts the same `python -m upcycle.train` command on every worker
at once (`--worker=all`, with --multi_host=yes on a slice of several workers), detached
(launch/tpu_job.py): it keeps running when ssh drops or this script exits, each worker logging
to ~/upcycle_logs/<run>.log (and, when MODEL_DIR is gs://, to MODEL_DIR/logs/). Without
--retries `train` returns once the job has started; with --retries it stays and watches the
slice's state and the job: when the slice is preempted or gone it re-creates it, sets it up
again and starts the same command, which resumes from the last checkpoint in MODEL_DIR (a path
every worker shares that outlives the VM: a gs:// bucket). `eval` and `infer` start
`python -m upcycle.eval` / `upcycle.infer` the same way (no retries), one job over all workers.
"""

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
import time
from typing import List, Optional, Sequence

_LAUNCH = os.path.dirname(os.path.abspath(__file__))
# launch/tpu_job.py, and upcycle/arguments.py (standard library only, as this script).
sys.path[:0] = [_LAUNCH, os.path.dirname(_LAUNCH)]
import tpu_job  # pylint: disable=g-import-not-at-top,wrong-import-position
from upcycle import arguments  # pylint: disable=g-import-not-at-top,wrong-import-position

JAX_TPU = 'jax[tpu]==0.10.2'
# The workers' virtualenv runs this CPython, the oldest that setup.py's pins accept; uv (from
# PyPI) downloads it when the image's python3 is older (tpu-ubuntu2204-base has 3.10).
PYTHON = '3.11'
UV = 'uv==0.13.8'
REMOTE_DIR = '~/upcycle'
ARCHIVE = '/tmp/upcycle-code.tar.gz'
DEFAULT_RUNTIME = {'v4': 'tpu-ubuntu2204-base', 'v5litepod': 'v2-alpha-tpuv5-lite',
                   'v5p': 'v2-alpha-tpuv5', 'v6e': 'v2-alpha-tpuv6e'}
CORES_PER_HOST = {'v4': 8, 'v5p': 8, 'v5litepod': 8, 'v6e': 8}
# gcloud's words for a zone out of TPU capacity (not a quota: that does not come back by waiting)
CAPACITY_ERROR = re.compile(r'no more capacity|insufficient capacity|RESOURCE_EXHAUSTED|'
                            r'ZONE_RESOURCE_POOL_EXHAUSTED|stockout', re.IGNORECASE)
CAPACITY_BACKOFF = (30.0, 1800.0)   # first wait, longest wait (seconds), doubling in between
HEALTHY, GONE = 'READY', ('PREEMPTED', 'TERMINATED', '')   # tpu-vm describe's state
QUEUED_DONE, QUEUED_STOPPED = 'ACTIVE', ('FAILED', 'SUSPENDED')


def parse_accelerator(accelerator_type: str) -> tuple:
  """'v4-64' -> ('v4', 64); refuses sizes that are not TPU slice shapes."""
  match = re.fullmatch(r'(v4|v5p|v5litepod|v6e)-(\d+)', accelerator_type)
  if not match:
    raise SystemExit(f'--accelerator_type={accelerator_type!r}: expected a TPU VM slice such as '
                     f"v4-8, v4-64, v4-512 (generations: {', '.join(DEFAULT_RUNTIME)}).")
  generation, size = match.group(1), int(match.group(2))
  if generation == 'v4' and (size < 8 or size > 4096 or size & (size - 1)):
    raise SystemExit(f'--accelerator_type={accelerator_type!r}: v4 slices have a power-of-two '
                     'number of TensorCores from 8 to 4096 (v4-8, v4-16, ..., v4-4096).')
  return generation, size


def num_workers(accelerator_type: str) -> int:
  """Hosts in the slice (a v4 host has 4 chips = 8 TensorCores): v4-8 -> 1, v4-64 -> 8."""
  generation, size = parse_accelerator(accelerator_type)
  return max(1, size // CORES_PER_HOST[generation])


class Shell:
  """Prints each command; runs it unless this is a dry run."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def __call__(self, argv: Sequence[str], check: bool = True) -> int:
    print('+ ' + shlex.join(argv), flush=True)
    if self.dry_run:
      return 0
    code = subprocess.run(list(argv), check=False).returncode
    if check and code:
      raise SystemExit(f'command failed with exit code {code}: {shlex.join(argv)}')
    return code

  def capture(self, argv: Sequence[str]) -> subprocess.CompletedProcess:
    """Runs `argv` with its output captured (a dry run: empty output, status 0)."""
    print('+ ' + shlex.join(argv), flush=True)
    if self.dry_run:
      return subprocess.CompletedProcess(list(argv), 0, '', '')
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def _where(args) -> List[str]:
  return [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])


def _vm_flags(args) -> List[str]:
  """Capacity, identity and network flags, the same for tpu-vm and queued-resources create."""
  flags = ['--spot'] if args.spot else ['--preemptible'] if args.preemptible else []
  for flag in ('service_account', 'scopes', 'network', 'subnetwork'):
    if getattr(args, flag):
      flags.append(f'--{flag.replace("_", "-")}={getattr(args, flag)}')
  return flags


def create_command(args) -> List[str]:
  generation, _ = parse_accelerator(args.accelerator_type)
  runtime = args.runtime_version or DEFAULT_RUNTIME[generation]
  if args.valid_until and not args.queued:
    raise SystemExit('--valid_until: a queued request expires, a VM does not; add --queued or '
                     'drop --valid_until.')
  if args.queued:
    if args.preemptible:
      raise SystemExit('--preemptible: queued resources take --spot instead (gcloud compute tpus '
                       'queued-resources create has no --preemptible).')
    until = [f'--valid-until-duration={args.valid_until}'] if args.valid_until else []
    return ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', args.name,
            f'--node-id={args.name}', *_where(args), f'--accelerator-type={args.accelerator_type}',
            f'--runtime-version={runtime}', *_vm_flags(args), *until]
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', args.name, *_where(args),
          f'--accelerator-type={args.accelerator_type}', f'--version={runtime}', *_vm_flags(args)]


def on_workers(args, command: str, worker: str = 'all') -> List[str]:
  """`command` (a shell string) on the slice's workers, all of them at once by default."""
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.name, *_where(args),
          f'--worker={worker}', f'--command={command}']


def install_command() -> str:
  """REMOTE_DIR/.venv with CPython PYTHON (what `train` runs), the package and jax[tpu]."""
  return (f'cd {REMOTE_DIR} && python3 -m pip install -q --user {UV} && '
          f'~/.local/bin/uv venv -q --seed --python={PYTHON} .venv && '
          f'.venv/bin/pip install -q -e . && .venv/bin/pip install -q {shlex.quote(JAX_TPU)}')


def _git(args, *argv) -> str:
  """A read-only question to the local checkout (asked in a dry run too)."""
  done = subprocess.run(['git', '-C', args.source, *argv], capture_output=True, text=True,
                        check=False)
  if done.returncode:
    raise SystemExit(f'--source={args.source}: not a git checkout ({done.stderr.strip()}); '
                     'pass --source=<checkout> or --git_url=<repository>.')
  return done.stdout


def archive_command(args) -> List[str]:
  """The archive of what ships: HEAD (committed files), or with --ship_worktree the files of the
  working tree as they are (tracked and untracked, less what .gitignore ignores). Says which,
  and names the uncommitted changes that HEAD leaves behind."""
  changes = [line[3:] for line in _git(args, 'status', '--porcelain').splitlines()]
  if args.ship_worktree:
    files = [f for f in _git(args, 'ls-files', '-z', '--cached', '--others',
                             '--exclude-standard').split('\0')
             if f and os.path.lexists(os.path.join(args.source, f))]
    listing = ARCHIVE + '.files'
    if not args.dry_run:
      with open(listing, 'w') as f:
        f.write('\0'.join(files))
    print(f'# ships the working tree of {args.source} as it is: {len(files)} files, '
          f'{len(changes)} of them with uncommitted changes', flush=True)
    return ['tar', '-czf', ARCHIVE, '-C', args.source, '--null', f'--files-from={listing}']
  head = _git(args, 'log', '-1', '--format=%h %s').strip()
  print(f'# ships HEAD of {args.source} ({head}): committed files only', flush=True)
  if changes:
    named = ', '.join(changes[:10]) + (f' and {len(changes) - 10} more' if len(changes) > 10
                                       else '')
    print(f'# warning: {len(changes)} uncommitted change(s) do not ship: {named}; commit them '
          'or pass --ship_worktree', file=sys.stderr, flush=True)
  return ['git', '-C', args.source, 'archive', '--format=tar.gz', f'--output={ARCHIVE}', 'HEAD']


def setup_commands(args) -> List[List[str]]:
  """Puts the code on every worker (a git clone, or an archive of the local checkout) and
  installs it with jax[tpu] in a Python PYTHON virtualenv there (`install_command`)."""
  if args.git_url:
    fetch = (f'rm -rf {REMOTE_DIR} && git clone --quiet {shlex.quote(args.git_url)} {REMOTE_DIR}'
             f' && git -C {REMOTE_DIR} checkout --quiet {shlex.quote(args.git_ref)}')
    return [on_workers(args, f'{fetch} && {install_command()}')]
  name = os.path.basename(ARCHIVE)
  return [archive_command(args),
          ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', ARCHIVE, f'{args.name}:~/', *_where(args),
           '--worker=all'],
          on_workers(args, f'rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && tar -xzf '
                           f'~/{name} -C {REMOTE_DIR} && {install_command()}')]


def model_dir(train_args: Sequence[str]) -> Optional[str]:
  """MODEL_DIR as the training flags bind it (--gin.MODEL_DIR=... or --gin_bindings=...)."""
  for arg in train_args:
    match = (re.fullmatch(r'--gin\.MODEL_DIR=(.*)', arg, re.DOTALL) or
             re.fullmatch(r'--gin_bindings=\s*MODEL_DIR\s*=(.*)', arg, re.DOTALL))
    if match:
      try:
        return str(ast.literal_eval(match.group(1).strip()))
      except (ValueError, SyntaxError):
        return None
  return None


# The verbs that run an entry point on every worker: verb -> python -m module.
MODULES = {'train': 'upcycle.train', 'eval': 'upcycle.eval', 'infer': 'upcycle.infer'}


def start_command(args, train_args: Sequence[str]) -> List[str]:
  """Starts the verb's entry point (`MODULES`), detached, on every worker
  (launch/tpu_job.py)."""
  if not train_args:
    raise SystemExit(f'{args.verb}: give the flags of python -m {MODULES[args.verb]} after '
                     "`--`, e.g. -- --gin_file=models/t5_1_1/base.gin "
                     "--gin.CHECKPOINT_PATH=\"'gs://b/run/checkpoints/1000'\"")
  flags = list(train_args)
  if num_workers(args.accelerator_type) > 1 and not any(
      f.startswith('--multi_host') for f in flags):
    flags.append('--multi_host=yes')   # every worker joins jax.distributed
  env = {'TF_CPP_MIN_LOG_LEVEL': '3'}
  if args.tfds_data_dir:
    env['TFDS_DATA_DIR'] = args.tfds_data_dir
  directory = model_dir(train_args) or ''
  return on_workers(args, tpu_job.start(
      args.run, REMOTE_DIR, ['.venv/bin/python', '-m', MODULES[args.verb], *flags], env,
      gcs_log_dir=directory.rstrip('/') + '/logs' if directory.startswith('gs://') else None))


def delete_command(args) -> List[str]:
  if args.queued:
    return ['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', args.name, *_where(args),
            '--force', '--quiet']
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', args.name, *_where(args), '--quiet']


def state_command(args) -> List[str]:
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'describe', args.name, *_where(args),
          '--format=value(state)']


def queued_state_command(args, fields: str = 'state.state') -> List[str]:
  return ['gcloud', 'compute', 'tpus', 'queued-resources', 'describe', args.name, *_where(args),
          f'--format=value({fields})']


def slice_state(args, shell: Shell) -> Optional[str]:
  """The TPU VM's state; '' when it does not exist, None when gcloud could not tell."""
  done = shell.capture(state_command(args))
  if done.returncode == 0:
    return done.stdout.strip()
  return '' if re.search(r'NOT_FOUND|not found', done.stderr) else None


def _request(args, shell: Shell) -> None:
  """Runs the create command, waiting out capacity errors with a doubling, capped back-off."""
  wait, longest = CAPACITY_BACKOFF
  while True:
    done = shell.capture(create_command(args))
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
      return
    error = (done.stderr.strip().splitlines() or [f'exit code {done.returncode}'])[-1]
    if not CAPACITY_ERROR.search(done.stderr) or 'quota' in done.stderr.lower():
      raise SystemExit(f'create {args.name} failed: {error}')
    print(f'no {args.accelerator_type} capacity in {args.zone} now; trying again in '
          f'{wait:.0f} s', flush=True)
    time.sleep(wait)
    wait = min(2 * wait, longest)


def create(args, shell: Shell) -> None:
  """Creates the slice and waits until it can run (a queued request: until it is ACTIVE; it
  stops at FAILED or SUSPENDED with the reason)."""
  if shell.dry_run:
    shell(create_command(args))
    wait = queued_state_command(args) if args.queued else state_command(args)
    print(f'# then poll `{shlex.join(wait)}` until it prints '
          f'{QUEUED_DONE if args.queued else HEALTHY}')
    return
  _request(args, shell)
  deadline = time.time() + args.timeout
  while True:
    if args.queued:
      state = shell.capture(queued_state_command(args)).stdout.strip()
      if state in QUEUED_STOPPED:
        reason = ' '.join(shell.capture(queued_state_command(
            args, 'state.stateInitiator,state.failedData.error.message')).stdout.split())
        raise SystemExit(f'queued resource {args.name} is {state} ({reason or "no reason given"}'
                         '): delete it (delete --queued) and create it again, in another zone '
                         'or with a longer --valid_until.')
      if state == QUEUED_DONE:
        return
    elif (state := slice_state(args, shell)) == HEALTHY:
      return
    if time.time() > deadline:
      raise SystemExit(f'{args.name} is still {state or "not created"} after {args.timeout:.0f} '
                       's (--timeout).')
    time.sleep(args.poll_seconds)


def replace_slice(args, shell: Shell) -> None:
  """What replaces a preempted slice: delete what is left of it, create it, set it up."""
  shell(delete_command(args), check=False)   # what is left of it, if anything
  create(args, shell)
  for argv in setup_commands(args):
    shell(argv)


def job_state(args, shell: Shell) -> str:
  """'done', 'failed: <worker states>', or 'running' (also when ssh could not tell)."""
  done = shell.capture(on_workers(args, tpu_job.status(args.run, 0)))
  states = tpu_job.worker_states(done.stdout, args.run)
  if done.returncode or not states:
    return 'running'
  if any(s != 'running' and s != 'exit=0' for s in states.values()):
    return 'failed: ' + ', '.join(f'{host} {s}' for host, s in sorted(states.items()))
  if len(states) == num_workers(args.accelerator_type) and set(states.values()) == {'exit=0'}:
    return 'done'
  return 'running'


def train(args, train_args: Sequence[str], shell: Shell) -> None:
  """Starts training on every worker, detached. With `retries`, watches it: a slice that is
  preempted or gone is replaced and the job started again (it resumes from its last
  checkpoint), up to `retries` times; a job that fails on a healthy slice is stopped on every
  worker and not retried."""
  start = start_command(args, train_args)
  print(f'{args.accelerator_type}: {num_workers(args.accelerator_type)} worker(s) start run '
        f'{args.run}:', flush=True)
  shell(start)
  if shell.dry_run:
    if args.retries:
      print(f'# then every {args.poll_seconds:.0f} s `{shlex.join(state_command(args))}`; while '
            f'{HEALTHY}, the job\'s state on every worker (`status`); when the slice is '
            f'{"/".join(s for s in GONE if s)} or gone, up to {args.retries} times: the '
            'commands below, then the start command again')
      replace_slice(args, shell)
    return
  if not args.retries:
    print('started; `status`, `logs` and `stop` (with the same --name, --zone and --run) follow '
          'it.', flush=True)
    return
  replaced = 0
  while True:
    time.sleep(args.poll_seconds)
    state = slice_state(args, shell)
    if state == HEALTHY:
      job = job_state(args, shell)
      if job == 'done':
        print(f'{args.run} finished on every worker.', flush=True)
        return
      if job.startswith('failed'):
        shell(on_workers(args, tpu_job.stop(args.run)), check=False)
        raise SystemExit(f'{args.run} {job} on a healthy slice ({HEALTHY}): see '
                         f'{tpu_job.log_path(args.run)} (`logs --worker=N`). Not retried: this '
                         'is not a preemption.')
    elif state in GONE:
      if replaced == args.retries:
        raise SystemExit(f'{args.name} is {state or "gone"} after {args.retries} retries; '
                         'giving up.')
      replaced += 1
      print(f'{args.name} is {state or "gone"}: replacing it (retry {replaced} of '
            f'{args.retries}).', flush=True)
      time.sleep(args.retry_wait)
      replace_slice(args, shell)
      shell(start)


def build_parser() -> argparse.ArgumentParser:
  parser = arguments.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  common = arguments.ArgumentParser(add_help=False)
  common.add_argument('--name', required=True, help='TPU VM (and queued resource) name')
  common.add_argument('--zone', required=True, help='e.g. us-central2-b (v4)')
  common.add_argument('--project', default=None, help='GCP project (default: gcloud config)')
  common.add_argument('--accelerator_type', default='v4-8', help='v4-8 ... v4-4096, v5p-N, ...')
  common.add_argument('--queued', action='store_true',
                      help='create/delete through queued resources (waits for capacity)')
  common.add_argument('--dry_run', action='store_true', help='print every command, run none')
  job = arguments.ArgumentParser(add_help=False)
  job.add_argument('--run', default=None,
                   help='the job\'s name: its log is ~/upcycle_logs/<run>.log (default: --name)')
  vm = arguments.ArgumentParser(add_help=False)
  vm.add_argument('--runtime_version', default=None, help='TPU VM image (default per generation)')
  capacity = vm.add_mutually_exclusive_group()
  capacity.add_argument('--spot', action='store_true', help='spot capacity')
  capacity.add_argument('--preemptible', action='store_true',
                        help='preemptible capacity (not with --queued: use --spot)')
  vm.add_argument('--valid_until', default=None,
                  help='--queued: the request expires after this long unfilled, e.g. 6h')
  vm.add_argument('--service_account', default=None, help="the VMs' service account (email)")
  vm.add_argument('--scopes', default=None, help='its access scopes, e.g. cloud-platform')
  vm.add_argument('--network', default=None, help='VPC network (default: default)')
  vm.add_argument('--subnetwork', default=None, help='VPC subnetwork')
  vm.add_argument('--timeout', type=float, default=6 * 3600,
                  help='seconds to wait for the slice to be READY (a queued one: ACTIVE)')
  vm.add_argument('--poll_seconds', type=float, default=60.0,
                  help='seconds between state checks of the slice and the job')
  code = arguments.ArgumentParser(add_help=False)
  code.add_argument('--source', default=os.getcwd(), help='local checkout whose HEAD is copied')
  code.add_argument('--ship_worktree', action='store_true',
                    help='copy the working tree as it is (uncommitted and untracked files too, '
                         'not what .gitignore ignores) instead of HEAD')
  code.add_argument('--git_url', default=None, help='clone this repository instead of copying')
  code.add_argument('--git_ref', default='main', help='branch, tag or commit of --git_url')
  sub = parser.add_subparsers(dest='verb', required=True)
  sub.add_parser('create', parents=[common, vm], help='create the TPU VM or pod slice')
  sub.add_parser('setup', parents=[common, code],
                 help='copy or clone the code, install it on all workers (Python '
                      f'{PYTHON} virtualenv)')
  run = sub.add_parser('train', parents=[common, job, vm, code],
                       help='python -m upcycle.train on every worker, detached (flags after --)')
  run.add_argument('--tfds_data_dir', default=None,
                   help="TFDS_DATA_DIR of the job on every worker (e.g. gs://bucket/tfds, where "
                        'C4 is prepared)')
  run.add_argument('--retries', type=int, default=0,
                   help='stay, watch the job, and re-create the slice and resume after '
                        'preemption, up to this many times')
  run.add_argument('--retry_wait', type=float, default=60.0,
                   help='seconds to wait before replacing a preempted slice')
  for verb, what in (('eval', 'evaluate a checkpoint'), ('infer', 'decode a split')):
    one = sub.add_parser(verb, parents=[common, job],
                         help=f'{what} with every worker (python -m {MODULES[verb]}, flags '
                              'after --), detached; `status` / `logs` follow it')
    one.add_argument('--tfds_data_dir', default=None,
                     help='TFDS_DATA_DIR of the job on every worker')
  status = sub.add_parser('status', parents=[common, job],
                          help="the job's state on every worker and its last log lines")
  status.add_argument('--lines', type=int, default=5, help='log lines per worker')
  sub.add_parser('stop', parents=[common, job],
                 help='stop the job on every worker (SIGTERM, then SIGKILL after '
                      f'{tpu_job.STOP_GRACE_SECONDS} s); it resumes from its last checkpoint')
  logs = sub.add_parser('logs', parents=[common, job], help="the job's log on a worker")
  logs.add_argument('--worker', default='0', help="a worker index, or 'all'")
  logs.add_argument('--lines', type=int, default=100, help='last lines to show first')
  logs.add_argument('--follow', action=argparse.BooleanOptionalAction, default=True,
                    help='keep printing new lines (reattach); --no-follow prints and returns')
  ssh = sub.add_parser('ssh', parents=[common], help='a shell on one worker')
  ssh.add_argument('--worker', default='0')
  sub.add_parser('delete', parents=[common], help='delete the TPU VM (or queued resource)')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  own, train_args = (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (
      argv, [])
  args = build_parser().parse_args(own)
  parse_accelerator(args.accelerator_type)
  if getattr(args, 'run', None) is None:
    args.run = args.name
  shell = Shell(args.dry_run)
  if args.verb == 'create':
    create(args, shell)
  elif args.verb == 'setup':
    for command in setup_commands(args):
      shell(command)
  elif args.verb == 'train':
    train(args, train_args, shell)
  elif args.verb in ('eval', 'infer'):
    print(f'{args.accelerator_type}: {num_workers(args.accelerator_type)} worker(s) start '
          f'{args.verb} job {args.run}:', flush=True)
    shell(start_command(args, train_args))
  elif args.verb == 'status':
    shell(on_workers(args, tpu_job.status(args.run, args.lines)))
  elif args.verb == 'stop':
    shell(on_workers(args, tpu_job.stop(args.run)))
  elif args.verb == 'logs':
    shell(on_workers(args, tpu_job.logs(args.run, args.lines, args.follow), args.worker),
          check=False)
  elif args.verb == 'ssh':
    shell(['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.name, *_where(args),
           f'--worker={args.worker}'])
  elif args.verb == 'delete':
    shell(delete_command(args))
  return 0


if __name__ == '__main__':
  sys.exit(main())
