"""Ahead-of-time compilation of a run for a TPU topology: will it fit, and what dominates.

The run (mesh, shardings, steps: `train.built_run.build_run`, exactly what the trainer of
`python -m upcycle.train` builds) is built over the devices of a TPU topology description, and
its compiled functions are lowered on abstract inputs (`jax.ShapeDtypeStruct`s with the run's
shardings) and compiled by the TPU compiler (libtpu), on any host: nothing is allocated or
executed. The compiler's memory analysis gives the bytes per device, held against the HBM the
compiler can use (`hbm.py`); the parameters', optimizer state's and batch's shares are counted
from their shardings. What does not fit is told what dominates and which of the levers the run
has not set would shrink it (`levers.py`); `find_batch` compiles the train and eval steps at
up to two more batch sizes for the largest batch at which both fit (`batch_fit.py`).

  train_step    the jitted training step (state donated, as the trainer runs it)
  restore_hook  the upcycling / restore initializer's one sharded jit (when the run has one)
  eval_step     the jitted evaluation step

Each also gets its FLOPs and bytes accessed per device and call, and the roofline bound on
its time they imply (`roofline.py`), with the model FLOPs utilization at that bound for the
train step. The compiler counts a loop's body once, so for a step with loops (scanned layers,
microbatches) those counts are extrapolated from shallow copies of the run, compiled with their
loops unrolled (`step_count.py`), whose memory is not used; their compile time is reported
apart from the function's own.
"""

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from upcycle.fit import batch_fit, levers, step_count
from upcycle.fit import roofline as rooflines
from upcycle.fit import hbm as hbm_sizes
from upcycle import partitioning, platforms
from upcycle.train.built_run import build_run, step_flops
from upcycle.upcycling import report_file

# Compiling needs libtpu's compiler only: no TPU, no metadata server (libtpu otherwise asks
# GCE's), and a training process holding libtpu's lock file on a TPU VM is no obstacle.
LIBTPU_ENV = {'TPU_SKIP_MDS_QUERY': '1', 'TPU_ACCELERATOR_TYPE': 'v4-8',
              'TPU_WORKER_HOSTNAMES': 'localhost', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}

GIB = 2 ** 30
# The functions that run at BATCH_SIZE: the largest batch that fits is the one at which both do.
BATCH_STEPS = ('train_step', 'eval_step')

# The counting copies' compiler options: the TPU compiler turns a matmul whose operand is
# all-gathered or whose result is reduce-scattered (fully sharded parameters) into a loop
# over the shards (a windowed einsum), which its cost analysis counts once; compiled as an
# all-gather (reduce-scatter) and one matmul instead, the same products are counted whole.
COUNTING_OPTIONS = {'xla_tpu_enable_windowed_einsum_for_all_gather': False,
                    'xla_tpu_enable_windowed_einsum_for_reduce_scatter': False}


class TopologyError(ValueError):
  pass


def topology_devices(name: str, megacore: bool = True) -> List[jax.Device]:
  """The devices of a TPU topology such as 'v4:4x4x4' (64 chips), without a TPU.

  With `megacore` a v4 slice has one device per chip, as a Cloud TPU VM shows them; else one
  per TensorCore (two per chip), each with half the chip's HBM. Other generations have one
  device per chip either way.
  """
  for key, value in LIBTPU_ENV.items():
    os.environ.setdefault(key, value)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  options = {}
  if name.partition(':')[0] == 'v4':
    options = {'chip_config_name': 'megacore' if megacore else 'default',
               'chips_per_host_bounds': (2, 2, 1), 'num_slices': 1}
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform='tpu',
                                             **options).devices)
  except ImportError as e:
    raise TopologyError(f'--topology={name}: compiling for TPU needs libtpu. Fix: pip install '
                        f"-e '.[tpu]' (libtpu, the version jax[tpu] pins).") from e
  except Exception as e:  # pylint: disable=broad-except  (libtpu's errors are plain)
    raise TopologyError(f'--topology={name}: libtpu could not describe it ({e}). Give a '
                        f"topology such as 'v4:2x2x1' or 'v4:4x4x4' (chips per axis).") from e


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
  shard of each leaf, summed)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass(frozen=True)
class FunctionReport:
  """One compiled function's per-device memory and compute.

  `arguments` / `outputs` / `temp` are the TPU compiler's (`memory_analysis()`); `total` is
  what the device holds at once: arguments + outputs not aliased to donated arguments +
  temporaries + code, held against the HBM the compiler can use (`hbm.py`). `parts` splits
  the arguments into parameters, optimizer state and batch, counted from their shardings.
  `flops_per_device` and `bytes_per_device` (HBM bytes accessed) are the compiler's
  (`cost_analysis()`) per call, extrapolated from shallow copies where the function has
  loops (`extrapolated`, `step_count.py`; the compiler counts a loop body once);
  `compile_seconds` the function's own compile, `count_seconds` the shallow copies';
  `kernel_flops_per_device`: the FLOPs of the model's kernels that the compiler counts as
  nothing (a Pallas call: the splash attention kernel; `uncounted_flops`), in closed form,
  added to the compiler's for the roofline;
  `model_flops_per_step` (train step) is the model's matmul FLOPs (`models/flops.py`, as
  logged in training); `roofline` the bound they imply (`roofline.py`); `uncounted` why a
  function with loops has no roofline (a shallow copy was refused, or its compiled program
  still loops over matmuls: the counts are then the compiler's, a loop body once). For a
  program the compiler refused (`refused`: its message), `temp` is the temporaries the refusal
  names and `arguments` the sum of `parts`; there are no FLOPs.
  """

  arguments: int
  outputs: int
  alias: int
  temp: int
  code: int
  hbm: hbm_sizes.Capacity
  flops_per_device: float
  devices: int
  compile_seconds: float
  parts: Mapping[str, int]
  model_flops_per_step: Optional[float] = None
  refused: Optional[str] = None
  bytes_per_device: float = 0.0
  extrapolated: bool = False
  roofline: Optional[rooflines.Roofline] = None
  uncounted: Optional[str] = None
  count_seconds: float = 0.0
  kernel_flops_per_device: float = 0.0

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.alias + self.temp + self.code

  @property
  def work_flops_per_device(self) -> float:
    """The compiler's FLOPs and its uncounted kernels' together."""
    return self.flops_per_device + self.kernel_flops_per_device

  @property
  def fits(self) -> bool:
    return self.total <= self.hbm.usable

  def as_json(self) -> Dict[str, Any]:
    return {'per_device_bytes': {'arguments': self.arguments, 'outputs': self.outputs,
                                 'aliased': self.alias, 'temp': self.temp, 'code': self.code,
                                 'total': self.total, **{k: v for k, v in self.parts.items()}},
            'hbm_bytes_per_device': self.hbm.nominal,
            'usable_hbm_bytes_per_device': self.hbm.usable, 'fits': self.fits,
            'refused': self.refused, 'flops_per_device': self.flops_per_device,
            'kernel_flops_per_device': self.kernel_flops_per_device,
            'flops_per_step': self.work_flops_per_device * self.devices,
            'bytes_accessed_per_device': self.bytes_per_device,
            'extrapolated': self.extrapolated, 'uncounted': self.uncounted,
            'model_flops_per_step': self.model_flops_per_step,
            'roofline_seconds': None if self.roofline is None else self.roofline.seconds,
            'roofline_bound': None if self.roofline is None else self.roofline.bound,
            'mfu_at_roofline': None if self.roofline is None else self.roofline.mfu,
            'compile_seconds': round(self.compile_seconds, 1),
            'count_compile_seconds': round(self.count_seconds, 1)}


def compiled_counts(compiled: jax.stages.Compiled) -> Tuple[float, float]:
  """(FLOPs, bytes accessed) per device of one call, as the compiler counts them."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))


def _loopless_counts(lowered: jax.stages.Lowered, loops: int = 0) -> step_count.Counts:
  """(FLOPs, bytes accessed) of a counting copy, compiled with `COUNTING_OPTIONS`; raises
  `step_count.Uncountable` if the compiled program loops over matmuls other than `loops`
  times (a loop is counted once: the microbatches' accumulation, where it is left a loop for
  `step_count.extrapolate_microbatches`)."""
  compiled = lowered.compile(COUNTING_OPTIONS)
  found = step_count.loops_over_matmuls(compiled.as_text())
  if len(found) != loops:
    where = f', at {found[0]}' if found else ''
    raise step_count.Uncountable(f'the compiled copy loops over matmuls {len(found)} times, '
                                 f'not {loops}{where}')
  return compiled_counts(compiled)


def _microbatch_counts(lower_with_unroll: Callable[[int], jax.stages.Lowered],
                       microbatches: int) -> step_count.Counts:
  """The counts of a step over `microbatches` from its counting copies, `lower_with_unroll(u)`
  lowering the copy whose microbatch loop runs u per iteration: every microbatch unrolled up
  to `step_count.UNROLLED_MICROBATCHES`, else extrapolated from loops of one and two."""
  if microbatches <= step_count.UNROLLED_MICROBATCHES:
    return _loopless_counts(lower_with_unroll(microbatches))
  return step_count.extrapolate_microbatches(
      lambda unroll: _loopless_counts(lower_with_unroll(unroll), loops=1), microbatches)


def uncounted_flops(objective: Any, batch: Mapping[str, Any], *, train: bool,
                    microbatches: int = 1) -> float:
  """FLOPs per device and call of the kernels the compiler counts as nothing, under the
  current mesh: the model config's `uncounted_flops` (`LlamaConfig`'s splash kernel) on each
  microbatch of `batch` (shapes); 0 for a model without such kernels."""
  count = getattr(objective.model.config, 'uncounted_flops', None)
  if count is None:
    return 0.0
  rows, length = objective.init_batch(batch)[0].shape
  return microbatches * count(rows // microbatches, length, train=train)


def compile_report(lowered: jax.stages.Lowered, *, hbm: hbm_sizes.Capacity, devices: int,
                   parts: Mapping[str, int], model_flops_per_step: Optional[float] = None,
                   kernel_flops_per_device: float = 0.0) -> FunctionReport:
  """Compiles `lowered` and reads the compiler's per-device memory, FLOPs and bytes; a program
  the compiler refuses for want of HBM is reported with the temporaries its refusal names."""
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    first = str(e).strip().splitlines()[0]
    refused = hbm_sizes.refusal(first) if 'RESOURCE_EXHAUSTED' in first else None
    if refused is None:
      raise
    return FunctionReport(
        arguments=sum(parts.values()), outputs=0, alias=0, temp=refused[0], code=0, hbm=hbm,
        flops_per_device=0.0, devices=devices, compile_seconds=time.perf_counter() - start,
        parts=dict(parts), model_flops_per_step=model_flops_per_step, refused=first)
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  flops, accessed = compiled_counts(compiled)
  return FunctionReport(
      arguments=int(memory.argument_size_in_bytes), outputs=int(memory.output_size_in_bytes),
      alias=int(memory.alias_size_in_bytes), temp=int(memory.temp_size_in_bytes),
      code=int(memory.generated_code_size_in_bytes), hbm=hbm, flops_per_device=flops,
      bytes_per_device=accessed, devices=devices, compile_seconds=seconds, parts=dict(parts),
      model_flops_per_step=model_flops_per_step, kernel_flops_per_device=kernel_flops_per_device)


def with_roofline(report: FunctionReport, *, device_kind: str, megacore: bool,
                  count: Optional[Callable[[], step_count.Counts]] = None,
                  not_work: Optional[str] = None) -> FunctionReport:
  """`report` with its roofline; with `count` (the function's FLOPs and bytes extrapolated
  from shallow copies, `step_count.extrapolate`), its counts replaced by that count first.
  `not_work`: why the counts are not the function's work (`exchange_buffers`): the counts
  are kept, with no roofline and that reason."""
  if report.refused:
    return report
  if count is not None:
    start = time.perf_counter()
    try:
      flops, accessed = count()
    except (jax.errors.JaxRuntimeError, step_count.Uncountable) as e:
      if isinstance(e, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      return dataclasses.replace(report, uncounted=(
          'no roofline: a shallow copy of the function, compiled to count every layer and '
          f'microbatch, could not be counted ({str(e).strip().splitlines()[0]}); the FLOPs '
          'and bytes shown count a loop body once'))
    report = dataclasses.replace(
        report, flops_per_device=flops, bytes_per_device=accessed, extrapolated=True,
        count_seconds=time.perf_counter() - start)
  if not_work:
    return dataclasses.replace(report, uncounted=not_work)
  return dataclasses.replace(report, roofline=rooflines.roofline(
      flops_per_device=report.work_flops_per_device, bytes_per_device=report.bytes_per_device,
      device_kind=device_kind, megacore=megacore, devices=report.devices,
      model_flops=report.model_flops_per_step))


def exchange_buffers(model_config: Any, mesh: jax.sharding.Mesh) -> Optional[str]:
  """Why the compiler's counts of a step are not its work, where a dropless MoE block of
  `model_config` exchanges its rows over the mesh's expert axis (`upcycle.moe.exchange`):
  its grouped matmuls run over a receive buffer with room for every chip's rows, and
  megablox (like `ragged_dot`) declares its cost over all of them. None otherwise."""
  from upcycle.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  moes = [getattr(model_config, f.name) for f in dataclasses.fields(model_config)]
  if mesh.shape['expert'] == 1 or not any(
      isinstance(moe, MoeConfig) and moe.dropless for moe in moes):
    return None
  return ('no roofline: the expert-parallel dropless block multiplies a receive buffer of '
          f"{mesh.shape['expert']} x the rows a balanced routing sends, and its grouped matmul "
          'declares its cost over all of them (it runs only the rows received), so the FLOPs '
          'and bytes shown overstate the experts\' work')


def v4_topology(chips: int) -> Optional[str]:
  """The v4 topology of `chips` chips, a power of two from 4 ('v4:2x2x1', 'v4:2x2x2',
  'v4:2x2x4', 'v4:2x4x4', 'v4:4x4x4', ...: each doubling doubles the shortest axis, the last
  of the shortest); None for another count."""
  if chips < 4 or chips & (chips - 1):
    return None
  axes = [2, 2, 1]
  while axes[0] * axes[1] * axes[2] < chips:
    shortest = min(axes)
    last = max(i for i, n in enumerate(axes) if n == shortest)
    axes[last] *= 2
  return 'v4:' + 'x'.join(map(str, axes))


def larger_slice(report: FunctionReport, search: batch_fit.BatchSearch, *, devices: int,
                 device_kind: str, megacore: bool) -> str:
  """The lever when --find_batch finds that no batch fits: the train step's total at the
  smallest batch (compiled, or the line's) and the slice it would fit on
  (`batch_fit.larger_slice`), named as a v4 topology where it is one."""
  total, compiled = search.smallest()
  state = report.parts.get('parameters', 0) + report.parts.get('optimizer_state', 0)
  said = (f'no BATCH_SIZE fits, not even the smallest, {search.multiple}: '
          f'{total / GIB:.2f} GiB per device ({"compiled" if compiled else "predicted"})')
  needed = batch_fit.larger_slice(total=total, state=state, usable=report.hbm.usable,
                                  devices=devices)
  if needed is None:
    return (f'{said}, {(total - state) / GIB:.2f} GiB of it besides the parameters and '
            'optimizer state: a larger slice does not hold it either')
  chips = needed if megacore or device_kind != 'TPU v4' else needed // 2
  name = v4_topology(chips) if device_kind == 'TPU v4' else None
  return (f'{said}: a larger slice of {needed} devices' + (f' (--topology={name})' if name
                                                           else '')
          + ' would hold it with the parameters and optimizer state split over them (FSDP, '
          'expert partitions)')


def advice(report: FunctionReport, settings: levers.Settings,
           search: Optional[batch_fit.BatchSearch] = None, slice_lever: str = '',
           step: str = '') -> str:
  """One line: by how much `report` fits within the usable HBM or not and, when it does not,
  what dominates and the levers the run has not set that would shrink it (`levers.py`;
  `search`, --find_batch's, and `slice_lever`, `larger_slice`, for the train and eval
  steps; `step`, which of `BATCH_STEPS` `report` is, '' for another function)."""
  usable = report.hbm.usable / GIB
  margin = (report.hbm.usable - report.total) / GIB
  if report.fits:
    return f'fits, {margin:.2f} GiB to spare of the {usable:.2f} GiB the compiler can use'
  refused = f' (the compiler refused it: {report.refused})' if report.refused else ''
  return (f'does NOT fit{refused}: {-margin:.2f} GiB over the {usable:.2f} GiB the compiler '
          f'can use (of {report.hbm.nominal / GIB:.0f} GiB); ' + levers.summary(
              settings, parameters=report.parts.get('parameters', 0),
              optimizer_state=report.parts.get('optimizer_state', 0), temp=report.temp,
              search=search, larger_slice=slice_lever, step=step))


@dataclasses.dataclass(frozen=True)
class CompiledRun:
  """A run compiled for a topology: its mesh, the memory levers its config sets, a report
  per compiled function, the functions that were not compiled with the one-line reason (a
  restore hook whose checkpoint cannot be read here, a lowering error), and the largest
  batch found to fit (`--find_batch`)."""

  devices: Sequence[jax.Device]
  mesh: jax.sharding.Mesh
  megacore: bool
  settings: levers.Settings
  reports: Dict[str, FunctionReport]
  not_compiled: Dict[str, str]
  batch_search: Optional[batch_fit.BatchSearch] = None

  def advice(self) -> Dict[str, str]:
    """{function: its advice line}; the train step's names the batch found to fit, or the
    larger slice when none does."""
    out = {}
    for name, r in self.reports.items():
      search = self.batch_search if name in BATCH_STEPS else None
      slice_lever = '' if search is None or not search.none_fits() else larger_slice(
          r, search, devices=len(self.devices), device_kind=self.devices[0].device_kind,
          megacore=self.megacore)
      out[name] = advice(r, self.settings, search, slice_lever,
                         step=name if name in BATCH_STEPS else '')
    return out

  def describe(self, topology: str) -> Dict[str, Any]:
    """The `--json` document."""
    return {'topology': topology, 'devices': len(self.devices),
            'device_kind': self.devices[0].device_kind, 'megacore': self.megacore,
            'mesh': {name: int(size) for name, size in self.mesh.shape.items()},
            'levers_set': levers.already_set(self.settings),
            'functions': {k: r.as_json() for k, r in self.reports.items()},
            'advice': self.advice(), 'not_compiled': dict(self.not_compiled),
            'batch_search': None if self.batch_search is None else self.batch_search.as_json()}


def table(run: CompiledRun) -> str:
  """The console table of a compiled run (GiB per device)."""
  reports = run.reports
  head = ('function', 'params', 'opt state', 'args', 'outputs', 'temp', 'total', 'usable HBM',
          'TFLOP/dev', 'GB/dev', 'model TFLOP/step', 'roofline ms', 'MFU max', 'compile s',
          'count s')
  rows = [head]
  for name, r in reports.items():
    model_flops = r.model_flops_per_step
    rows.append((name, *(f'{x / GIB:.2f}' for x in (
        r.parts.get('parameters', 0), r.parts.get('optimizer_state', 0), r.arguments,
        r.outputs - r.alias, r.temp, r.total, r.hbm.usable)),
                 '-' if r.refused else f'{r.work_flops_per_device / 1e12:.2f}',
                 '-' if r.refused else f'{r.bytes_per_device / 1e9:.2f}',
                 '-' if model_flops is None else f'{model_flops / 1e12:.1f}',
                 '-' if r.roofline is None else
                 f'{r.roofline.seconds * 1e3:.1f} ({r.roofline.bound})',
                 '-' if r.roofline is None or r.roofline.mfu is None else
                 f'{100 * r.roofline.mfu:.0f}%',
                 f'{r.compile_seconds:.0f}',
                 f'{r.count_seconds:.0f}' if r.extrapolated else '-'))
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  lines = ['  '.join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in rows]
  mesh = ' x '.join(f'{k} {v}' for k, v in run.mesh.shape.items())
  lines.insert(0, f'{len(run.devices)} x {run.devices[0].device_kind} '
                  f'({"megacore: one device per chip" if run.megacore else "one device per core"}'
                  f'), mesh {mesh}')
  lines.append("(GiB per device; usable HBM: what the TPU compiler can use of the device's; "
               "TFLOP/dev, GB/dev: FLOPs (the compiler's, and in closed form a kernel's it "
               'counts as nothing) and HBM bytes accessed per call, every loop iteration '
               'counted; roofline ms: the least time per call they allow, and '
               'what bounds it; MFU max: the model FLOPs utilization at that time; compile s: '
               "the function's compile, count s: its shallow copies', compiled to count every "
               'layer and microbatch)')
  lines.append('levers set: ' + (', '.join(levers.already_set(run.settings)) or 'none'))
  lines += [f'{name}: {line}' for name, line in run.advice().items()]
  lines += [f'{name}: {r.uncounted}' for name, r in reports.items() if r.uncounted]
  lines += [f'{name}: {reason}' for name, reason in run.not_compiled.items()]
  if run.batch_search is not None:
    lines += run.batch_search.lines()
  return '\n'.join(lines)


def _batch(spec: Mapping[str, Any], mesh: jax.sharding.Mesh) -> Dict[str, jax.ShapeDtypeStruct]:
  """{feature: (shape, dtype)} -> ShapeDtypeStructs placed as the trainer places batches."""
  return {k: jax.ShapeDtypeStruct(shape, dtype,
                                  sharding=partitioning.batch_sharding(mesh, len(shape)))
          for k, (shape, dtype) in spec.items()}


def steps_total(reports: Mapping[str, FunctionReport], steps: Sequence[str]) -> Optional[int]:
  """The larger of `steps`' totals per device (the run's `BATCH_STEPS`); None when one of them
  has none (its lowering failed, or the compiler refused it without naming its temporaries):
  a batch is not said to fit on the other step's bytes alone."""
  if any(name not in reports for name in steps):
    return None
  return max(reports[name].total for name in steps)


def _sequence_length(spec: Mapping[str, Any]) -> int:
  """The length of the rows' targets (what the loss runs over); 0 for a batch without."""
  shape, _ = spec.get('decoder_target_tokens', ((0, 0), None))
  return shape[1]


def _compile_or_reason(name: str, lower, *, hbm: hbm_sizes.Capacity, devices: int,
                       parts: Mapping[str, int], reports: Dict[str, FunctionReport],
                       not_compiled: Dict[str, str],
                       model_flops_per_step: Optional[float] = None,
                       kernel_flops_per_device: float = 0.0) -> None:
  """Lowers and compiles one function into `reports`, or its one-line reason into
  `not_compiled`."""
  try:
    lowered = lower()
  except Exception as e:  # pylint: disable=broad-except  (one function's reason; the rest go on)
    lines = str(e).strip().splitlines()
    not_compiled[name] = f'not lowered: {type(e).__name__}: {lines[0] if lines else ""}'
    return
  try:
    reports[name] = compile_report(lowered, hbm=hbm, devices=devices, parts=parts,
                                   model_flops_per_step=model_flops_per_step,
                                   kernel_flops_per_device=kernel_flops_per_device)
  except jax.errors.JaxRuntimeError as e:
    first = str(e).splitlines()[0]
    if 'RESOURCE_EXHAUSTED' not in first:
      raise
    not_compiled[name] = (f'does NOT fit: the TPU compiler refused it ({first}); parameters '
                          f'{parts.get("parameters", 0) / GIB:.2f} GiB, optimizer state '
                          f'{parts.get("optimizer_state", 0) / GIB:.2f} GiB per device.')


@platforms.compilation_cache_off()
def compile_run(*, objective, optimizer, config, train_data, eval_data=None, initializer=None,
                devices: Sequence[jax.Device], megacore: bool = True,
                find_batch: bool = False) -> CompiledRun:
  """Builds the run over `devices` (`train.built_run.build_run`, as the trainer does) and compiles
  its functions (module docstring); with `find_batch`, the train and eval steps at up to two
  more batch sizes (`batch_fit.py`).

  The arguments are `python -m upcycle.train`'s (gin-built); nothing is read from the data,
  nothing is written to the run's directory, and a restore hook reads only its checkpoint's
  metadata.
  """
  host_batch = train_data.batch_spec(config.batch_size // jax.process_count())
  built = build_run(objective=objective, optimizer=optimizer, config=config,
                    host_batch=host_batch, devices=devices)
  mesh, n = built.mesh, len(devices)
  hbm = hbm_sizes.capacity(devices[0].device_kind, megacore)
  settings = levers.read(config=config, objective=objective, optimizer=optimizer, mesh=mesh,
                         sequence_length=_sequence_length(host_batch))
  reports: Dict[str, FunctionReport] = {}
  not_compiled: Dict[str, str] = {}
  search = None
  abstract = built.abstract
  with partitioning.activate(mesh, built.rules):
    state_parts = {'parameters': per_device_bytes(abstract.params),
                   'optimizer_state': per_device_bytes(abstract.opt_state)}
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec()))
    batch = _batch(train_data.batch_spec(config.batch_size), mesh)
    eval_batch = (None if eval_data is None else
                  _batch(eval_data.batch_spec(config.batch_size), mesh))
    # The compiler counts a loop body once: where there are loops, count shallow copies.
    scans = bool(objective.model.config.scan_layers)
    full_periods = step_count.periods(objective.model.config)
    counted = functools.partial(with_roofline, device_kind=devices[0].device_kind,
                                megacore=megacore,
                                not_work=exchange_buffers(objective.model.config, mesh))

    @functools.lru_cache(maxsize=None)   # the train and eval copies share their runs
    def shallow_run(stack_periods: Tuple[int, ...]):
      return build_run(objective=step_count.shallow(objective, stack_periods),
                       optimizer=optimizer, config=config, host_batch=host_batch,
                       devices=devices)

    def train_step_counts(stack_periods: Tuple[int, ...]) -> step_count.Counts:
      run = shallow_run(stack_periods)
      return _microbatch_counts(
          lambda unroll: run.jit_train_step(microbatch_unroll=unroll).lower(
              run.abstract, batch, rng), config.num_microbatches)

    def eval_step_counts(stack_periods: Tuple[int, ...]) -> step_count.Counts:
      run = shallow_run(stack_periods)
      return _microbatch_counts(
          lambda unroll: run.jit_eval_step(microbatch_unroll=unroll).lower(
              run.abstract.params, eval_batch), config.eval_microbatches)

    def compile_train_step(size: int, into: Dict[str, FunctionReport],
                           reasons: Dict[str, str]) -> None:
      sized = _batch(train_data.batch_spec(size), mesh)
      _compile_or_reason('train_step', lambda: built.train_step.lower(abstract, sized, rng),
                         hbm=hbm, devices=n,
                         parts={**state_parts, 'batch': per_device_bytes(sized)},
                         reports=into, not_compiled=reasons,
                         model_flops_per_step=step_flops(objective, sized,
                                                         config.num_microbatches),
                         kernel_flops_per_device=uncounted_flops(
                             objective, sized, train=True,
                             microbatches=config.num_microbatches))

    def compile_eval_step(size: int, into: Dict[str, FunctionReport],
                          reasons: Dict[str, str]) -> None:
      sized = _batch(eval_data.batch_spec(size), mesh)
      _compile_or_reason(
          'eval_step', lambda: built.eval_step.lower(abstract.params, sized),
          hbm=hbm, devices=n,
          parts={'parameters': state_parts['parameters'], 'batch': per_device_bytes(sized)},
          reports=into, not_compiled=reasons,
          kernel_flops_per_device=uncounted_flops(objective, sized, train=False,
                                                  microbatches=config.eval_microbatches))

    steps = BATCH_STEPS if eval_data is not None else BATCH_STEPS[:1]

    def total_at(size: int) -> Optional[int]:
      found: Dict[str, FunctionReport] = {}
      compile_train_step(size, found, {})
      if 'train_step' not in found:
        return None
      if eval_data is not None:
        compile_eval_step(size, found, {})
      return steps_total(found, steps)

    compile_train_step(config.batch_size, reports, not_compiled)
    if 'train_step' in reports:
      loops = scans or config.num_microbatches > 1 or step_count.loss_loops(objective)
      reports['train_step'] = counted(reports['train_step'], count=functools.partial(
          step_count.extrapolate, train_step_counts, full_periods) if loops else None)
    if initializer is not None:
      def lower_restore():
        with report_file.planned(config.model_dir):   # its summary; nothing is written
          return initializer.lower(abstract, built.optimizer, objective.model.config)

      _compile_or_reason(
          'restore_hook', lower_restore,
          hbm=hbm, devices=n, parts=state_parts, reports=reports, not_compiled=not_compiled)
      if 'restore_hook' in reports:
        reports['restore_hook'] = with_roofline(
            reports['restore_hook'], device_kind=devices[0].device_kind, megacore=megacore)
    if eval_data is not None:
      compile_eval_step(config.batch_size, reports, not_compiled)
      if 'eval_step' in reports:
        reports['eval_step'] = counted(reports['eval_step'], count=functools.partial(
            step_count.extrapolate, eval_step_counts, full_periods)
            if scans or config.eval_microbatches > 1 or step_count.loss_loops(objective)
            else None)
    total = steps_total(reports, steps)
    if find_batch and total is not None:
      search = batch_fit.search(total_at, batch=config.batch_size, total=total,
                                usable=hbm.usable, multiple=settings.batch_multiple())
  return CompiledRun(list(devices), mesh, megacore, settings, reports, not_compiled, search)
