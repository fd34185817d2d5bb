"""The line a run logs before its first step: the processes and devices it runs on, the mesh,
the parameters in all and on each device (from their shardings), and where checkpoints go."""

import math
from typing import Any

import jax


def _count(n: int) -> str:
  """1234 -> '1.2K', 76_500_000 -> '76.5M', 1_230_000_000 -> '1.23B'."""
  for size, suffix, digits in ((1e9, 'B', 2), (1e6, 'M', 1), (1e3, 'K', 1)):
    if n >= size:
      return f'{n / size:.{digits}f}{suffix}'
  return str(n)


def _bytes(n: int) -> str:
  for size, unit in ((2 ** 30, 'GiB'), (2 ** 20, 'MiB'), (2 ** 10, 'KiB')):
    if n >= size:
      return f'{n / size:.1f} {unit}'
  return f'{n} B'


def summary(params: Any, mesh: jax.sharding.Mesh, checkpoint_dir: str) -> str:
  """`params`: the state's parameters as arrays or ShapeDtypeStructs with their shardings."""
  leaves = jax.tree.leaves(params)
  on_device = [math.prod(x.sharding.shard_shape(x.shape)) for x in leaves]
  per_device_bytes = sum(n * x.dtype.itemsize for n, x in zip(on_device, leaves))
  axes = ' x '.join(f'{axis}={size}' for axis, size in mesh.shape.items())
  return (f'Training on {jax.process_count()} process(es), {jax.device_count()} '
          f'{jax.default_backend()} devices ({jax.local_device_count()} on this one), mesh '
          f'{axes}: {_count(sum(math.prod(x.shape) for x in leaves))} parameters, '
          f'{_count(sum(on_device))} ({_bytes(per_device_bytes)}) on each device; checkpoints '
          f'go to {checkpoint_dir}.')
