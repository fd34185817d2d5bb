"""Cloud TPU VM lifecycle for upcycle runs: create, set up, train on every worker, watch, delete.

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
  python launch/tpu_vm.py logs   $WHERE --worker=0 --follow
  python launch/tpu_vm.py delete $WHERE

Every subcommand takes --dry_run (print every command, run none). Each command is a plain
`gcloud compute tpus ...` call, printed before it runs, so what this script does can be done by
hand. `train` runs the same `python -m upcycle.train` command on every worker at once
(`--worker=all`), each worker appending to its own log file; with --retries it re-creates a
preempted VM, sets it up again and re-runs the same command: the trainer resumes from the last
checkpoint in MODEL_DIR, which must outlive the VM and be the same path on every worker (today a
bucket mounted with gcsfuse; see the README's "Running on a Cloud TPU pod").
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from typing import List, Optional, Sequence

JAX_TPU = 'jax[tpu]==0.10.2'
# The workers' virtualenv runs this CPython, the oldest that setup.py's pins accept; uv (from
# PyPI) downloads it when the image's python3 is older (tpu-ubuntu2204-base has 3.10).
PYTHON = '3.11'
UV = 'uv==0.13.8'
REMOTE_DIR = '~/upcycle'
LOG_FILE = '~/upcycle_logs/train.log'
DEFAULT_RUNTIME = {'v4': 'tpu-ubuntu2204-base', 'v5litepod': 'v2-alpha-tpuv5-lite',
                   'v5p': 'v2-alpha-tpuv5', 'v6e': 'v2-alpha-tpuv6e'}
CORES_PER_HOST = {'v4': 8, 'v5p': 8, 'v5litepod': 8, 'v6e': 8}


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

  def output(self, argv: Sequence[str]) -> str:
    print('+ ' + shlex.join(argv), flush=True)
    if self.dry_run:
      return ''
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    return done.stdout.strip()


def _where(args) -> List[str]:
  return [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])


def create_commands(args) -> List[List[str]]:
  generation, _ = parse_accelerator(args.accelerator_type)
  runtime = args.runtime_version or DEFAULT_RUNTIME[generation]
  capacity = ['--spot'] if args.spot else ['--preemptible'] if args.preemptible else []
  if args.queued:
    return [['gcloud', 'compute', 'tpus', 'queued-resources', 'create', args.name,
             f'--node-id={args.name}', *_where(args), f'--accelerator-type={args.accelerator_type}',
             f'--runtime-version={runtime}', *capacity]]
  return [['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', args.name, *_where(args),
           f'--accelerator-type={args.accelerator_type}', f'--version={runtime}', *capacity]]


def on_workers(args, command: str, worker: str = 'all') -> List[str]:
  """`command` (a shell string) on the slice's workers, all of them at once by default."""
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.name, *_where(args),
          f'--worker={worker}', f'--command={command}']


def install_command() -> str:
  """REMOTE_DIR/.venv with CPython PYTHON (what `train` runs), the package and jax[tpu]."""
  return (f'cd {REMOTE_DIR} && python3 -m pip install -q --user {UV} && '
          f'~/.local/bin/uv venv -q --seed --python={PYTHON} .venv && '
          f'.venv/bin/pip install -q -e . && .venv/bin/pip install -q {shlex.quote(JAX_TPU)}')


def setup_commands(args) -> List[List[str]]:
  """Puts the code on every worker (a git clone, or an archive of a local checkout's HEAD) and
  installs it with jax[tpu] in a Python PYTHON virtualenv there (`install_command`)."""
  if args.git_url:
    fetch = (f'rm -rf {REMOTE_DIR} && git clone --quiet {shlex.quote(args.git_url)} {REMOTE_DIR}'
             f' && git -C {REMOTE_DIR} checkout --quiet {shlex.quote(args.git_ref)}')
    return [on_workers(args, f'{fetch} && {install_command()}')]
  archive = '/tmp/upcycle-code.tar.gz'
  return [['git', '-C', args.source, 'archive', '--format=tar.gz', f'--output={archive}', 'HEAD'],
          ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', archive, f'{args.name}:~/', *_where(args),
           '--worker=all'],
          on_workers(args, f'rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && tar -xzf '
                           f'~/upcycle-code.tar.gz -C {REMOTE_DIR} && {install_command()}')]


def train_command(args, train_args: Sequence[str]) -> List[str]:
  """The same training command on every worker; each appends to its own log file."""
  if not train_args:
    raise SystemExit('train: give the training flags after `--`, e.g. '
                     "-- --gin_file=models/t5_1_1/base.gin --gin.MODEL_DIR=\"'gs://b/run'\"")
  python = shlex.join(['.venv/bin/python', '-m', 'upcycle.train', *train_args])
  command = (f'set -o pipefail; mkdir -p ~/upcycle_logs && cd {REMOTE_DIR} && '
             f'TF_CPP_MIN_LOG_LEVEL=3 {python} 2>&1 | tee -a {LOG_FILE}')
  return on_workers(args, command)


def delete_commands(args) -> List[List[str]]:
  if args.queued:
    return [['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', args.name, *_where(args),
             '--force', '--quiet']]
  return [['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', args.name, *_where(args), '--quiet']]


def state_command(args) -> List[str]:
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'describe', args.name, *_where(args),
          '--format=value(state)']


def create(args, shell: Shell, poll_seconds: float = 30.0, timeout: float = 6 * 3600) -> None:
  """Creates the VM and waits until it is READY (queued resources wait for capacity)."""
  for argv in create_commands(args):
    shell(argv)
  if shell.dry_run:
    print(f'# then poll `{shlex.join(state_command(args))}` until it prints READY')
    return
  deadline = time.time() + timeout
  while (state := shell.output(state_command(args))) != 'READY':
    if time.time() > deadline:
      raise SystemExit(f'{args.name} is still {state or "not created"} after {timeout:.0f} s.')
    time.sleep(poll_seconds)


def recovery_commands(args) -> List[List[str]]:
  """What replaces a preempted VM: delete what is left of it, create it again, set it up."""
  return delete_commands(args) + create_commands(args) + setup_commands(args)


def train(args, train_args: Sequence[str], shell: Shell) -> None:
  """Runs training on every worker; after a failure on a preempted or vanished VM, replaces the
  VM and runs the same command again (the trainer resumes from its last checkpoint), up to
  `retries` times. A failure on a healthy VM is not retried."""
  command = train_command(args, train_args)
  workers = num_workers(args.accelerator_type)
  print(f'{args.accelerator_type}: {workers} worker(s) run:', flush=True)
  if shell.dry_run:
    shell(command)
    if args.retries:
      print(f'# on failure, when `{shlex.join(state_command(args))}` is not READY, up to '
            f'{args.retries} times: the commands below, then the training command again')
      for argv in recovery_commands(args):
        shell(argv)
    return
  for attempt in range(1, args.retries + 2):
    if shell(command, check=False) == 0:
      return
    state = shell.output(state_command(args))
    if state == 'READY':
      raise SystemExit(f'training failed on a healthy VM (state READY): see {LOG_FILE} on the '
                       'workers (`logs --worker=N`). Not retried: this is not a preemption.')
    if attempt > args.retries:
      break
    print(f'VM {args.name} is {state or "gone"}: replacing it (retry {attempt} of '
          f'{args.retries}).', flush=True)
    time.sleep(args.retry_wait)
    for argv in delete_commands(args):
      shell(argv, check=False)   # what is left of the preempted VM, if anything
    create(args, shell)
    for argv in setup_commands(args):
      shell(argv)
  raise SystemExit(f'training did not finish after {args.retries} retries.')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument('--name', required=True, help='TPU VM (and queued resource) name')
  common.add_argument('--zone', required=True, help='e.g. us-central2-b (v4)')
  common.add_argument('--project', default=None, help='GCP project (default: gcloud config)')
  common.add_argument('--accelerator_type', default='v4-8', help='v4-8 ... v4-4096, v5p-N, ...')
  common.add_argument('--queued', action='store_true',
                      help='create/delete through queued resources (waits for capacity)')
  common.add_argument('--dry_run', action='store_true', help='print every command, run none')
  vm = argparse.ArgumentParser(add_help=False)
  vm.add_argument('--runtime_version', default=None, help='TPU VM image (default per generation)')
  capacity = vm.add_mutually_exclusive_group()
  capacity.add_argument('--spot', action='store_true', help='spot capacity')
  capacity.add_argument('--preemptible', action='store_true', help='preemptible capacity')
  code = argparse.ArgumentParser(add_help=False)
  code.add_argument('--source', default=os.getcwd(), help='local checkout whose HEAD is copied')
  code.add_argument('--git_url', default=None, help='clone this repository instead of copying')
  code.add_argument('--git_ref', default='main', help='branch, tag or commit of --git_url')
  sub = parser.add_subparsers(dest='verb', required=True)
  sub.add_parser('create', parents=[common, vm], help='create the TPU VM or pod slice')
  sub.add_parser('setup', parents=[common, code],
                 help='copy or clone the code, install it on all workers (Python '
                      f'{PYTHON} virtualenv)')
  run = sub.add_parser('train', parents=[common, vm, code],
                       help='python -m upcycle.train on every worker (flags after --)')
  run.add_argument('--retries', type=int, default=0, help='re-create and resume after preemption')
  run.add_argument('--retry_wait', type=float, default=60.0, help='seconds between retries')
  ssh = sub.add_parser('ssh', parents=[common], help='a shell on one worker')
  ssh.add_argument('--worker', default='0')
  logs = sub.add_parser('logs', parents=[common], help="tail the training log of worker(s)")
  logs.add_argument('--worker', default='0', help="a worker index, or 'all'")
  logs.add_argument('--follow', action='store_true', help='keep printing new lines')
  sub.add_parser('delete', parents=[common], help='delete the TPU VM (or queued resource)')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  own, train_args = (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (
      argv, [])
  args = build_parser().parse_args(own)
  parse_accelerator(args.accelerator_type)
  shell = Shell(args.dry_run)
  if args.verb == 'create':
    create(args, shell)
  elif args.verb == 'setup':
    for command in setup_commands(args):
      shell(command)
  elif args.verb == 'train':
    train(args, train_args, shell)
  elif args.verb == 'ssh':
    shell(['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.name, *_where(args),
           f'--worker={args.worker}'])
  elif args.verb == 'logs':
    shell(on_workers(args, f'tail -n 100 {"-F " if args.follow else ""}{LOG_FILE}', args.worker))
  elif args.verb == 'delete':
    for command in delete_commands(args):
      shell(command)
  return 0


if __name__ == '__main__':
  sys.exit(main())
