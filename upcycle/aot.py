"""python -m upcycle.aot --topology=v4:4x4x4 --gin_file=... [--json=OUT.json] [--find_batch]: will
this run fit?

Takes exactly the training command's gin files and bindings, builds the same trainer, mesh and
shardings over the devices of a TPU topology (libtpu's description: no TPU needed) and compiles
the train step, the upcycling / restore hook's sharded jit (when the run has one) and the eval
step for it, allocating nothing. Prints per function the per-device bytes (parameters,
optimizer state, arguments, outputs, temporaries, total) against the HBM the TPU compiler can
use of the device's (30.75 of a v4 chip's 32 GiB), FLOPs and HBM bytes per device and call
(every layer and microbatch counted: a step with loops is counted from shallow copies),
the roofline bound on its time and the MFU at it, compile time (the function's, and apart its
counting copies'), the memory levers the run has set, and for what does not fit, what
dominates and the levers not set that would shrink it (`upcycle/fit/aot.py`). --find_batch
compiles the train and eval steps at up to two more batch sizes and names the largest
BATCH_SIZE at which both fit, or, when not even the smallest does, the larger slice it would
fit on.
The gs:// paths it reads (not MODEL_DIR) must answer first, in bounded time. Exit status: 0
every function fits, 2 one does not, 3 one could not be compiled (its reason printed and in
--json), 1 a bad flag, config or topology. Needs libtpu: pip install -e '.[tpu]'.
"""

import argparse
import json
import sys
from typing import Any, Optional, Sequence, Tuple

from upcycle import arguments, gin_utils, startup


def train(*, objective: Any, optimizer: Any, config: Any, train_data: Any,
          eval_data: Optional[Any] = None, initializer: Optional[Any] = None,
          decode_data: Optional[Any] = None, decoding: Optional[Any] = None,
          flags: argparse.Namespace) -> dict:
  """What `python -m upcycle.train` would run, compiled for `flags.topology` instead of run
  (the other arguments gin-bound as the training command's; `flags` from `_own_flags`).
  `decode_data` / `decoding`, the inference evaluation's (TrainConfig.infer_eval), are taken
  as the training command binds them; its decode is not compiled."""
  del decode_data, decoding
  from upcycle import reachability  # pylint: disable=g-import-not-at-top
  from upcycle.fit import aot  # pylint: disable=g-import-not-at-top
  # What is read must answer first, in bounded time; MODEL_DIR is never written here.
  reachability.check({binding: path for binding, path in reachability.gin_paths().items()
                      if not binding.lower().endswith('model_dir')})
  devices = aot.topology_devices(flags.topology, flags.megacore)
  run = aot.compile_run(objective=objective, optimizer=optimizer, config=config,
                        train_data=train_data, eval_data=eval_data, initializer=initializer,
                        devices=devices, megacore=flags.megacore, find_batch=flags.find_batch)
  print(aot.table(run), flush=True)
  document = run.describe(flags.topology)
  if flags.json:
    from etils import epath  # pylint: disable=g-import-not-at-top
    path = epath.Path(flags.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + '\n')
  return document


def _own_flags(argv: Sequence[str]) -> Tuple[argparse.Namespace, Sequence[str]]:
  """(--topology, --json, --no_megacore and --find_batch; the rest of argv, the train
  flags)."""
  parser = arguments.ArgumentParser(add_help=False)
  parser.add_argument('--topology', default='v4:2x2x1')
  parser.add_argument('--json', default=None)
  parser.add_argument('--no_megacore', action='store_false', dest='megacore')
  parser.add_argument('--find_batch', action='store_true')
  return parser.parse_known_args(argv)


def main(argv: Sequence[str]) -> int:
  from upcycle import fields  # pylint: disable=g-import-not-at-top
  from upcycle.checkpoints import CheckpointError  # pylint: disable=g-import-not-at-top
  from upcycle.fit.aot import TopologyError  # pylint: disable=g-import-not-at-top
  if any(a in ('-h', '--help') for a in argv):
    print(__doc__.strip() + '\n\nflags: --topology=v4:AxBxC (chips per axis), --json=PATH, '
          '--no_megacore (one device per TensorCore), --find_batch (the largest BATCH_SIZE that '
          'fits, from up to two more compiles of the train step), then the training flags '
          '(--gin_file, --gin.KEY=VALUE, --gin_bindings, --gin_search_paths).')
    return 0
  flags, rest = _own_flags(argv)
  try:
    # Nothing is written: MODEL_DIR may name a bucket this machine cannot reach.
    document = gin_utils.run(train, [*rest, '--multi_host=no'], __doc__, reach_gcs=False,
                             given={'flags': flags})
  except (fields.ConfigError, CheckpointError, TopologyError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 1
  return exit_status(document)


# Exit statuses: every function compiled and fits; a bad flag or config; one does not fit;
# one could not be compiled (its reason is in the table and in --json's not_compiled).
FITS, ERROR, DOES_NOT_FIT, NOT_COMPILED = 0, 1, 2, 3


def exit_status(document: dict) -> int:
  """The status for `describe`'s document: DOES_NOT_FIT before NOT_COMPILED before FITS."""
  reasons = document['not_compiled'].values()
  if (any(not f['fits'] for f in document['functions'].values())
      or any('does NOT fit' in reason for reason in reasons)):
    return DOES_NOT_FIT
  return NOT_COMPILED if reasons else FITS


if __name__ == '__main__':
  startup.begin()
  sys.exit(main(sys.argv[1:]))
