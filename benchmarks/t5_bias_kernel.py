"""Would a bias-capable attention kernel pay for T5's relative position bias? Compiled for TPU.

  python benchmarks/t5_bias_kernel.py [--batch 16] [--lengths 512,2048] [--heads 12]
      [--output benchmarks/results/t5_bias_kernel.json]

T5 adds a learned relative position bias `[1, heads, q, k]` to its attention logits, which the
splash kernel (the Llamas' default on TPU) cannot take, so T5 attends by the einsum
(`layers.MultiHeadAttention`: float32 logits and their softmax in HBM). The one kernel in jax
that takes a bias is Pallas' TPU flash attention (`jax.experimental.pallas.ops.tpu.
flash_attention`, argument `ab`); it wants the bias whole, `[batch, heads, q, k]`, and returns
its gradient whole. Both are compiled here, ahead of time for one TPU v4 chip (libtpu, no TPU):
the gradient of a loss of the attention's output with respect to queries, keys, values and the
bias (the bias is trained), at T5 v1.1 Base's heads (12 of 64) and `--batch` rows of
`--lengths` tokens (T5's encoder: 512; the fit table's T5 rows hold 16 rows of 512 per chip on
a v4-32), bfloat16 activations.

The compiler counts what runs outside a Pallas kernel and nothing inside, so the kernel's
column adds in closed form what it must at least move (`kernel_bias_bytes`): the bias read by
the forward kernel and by both backward kernels (each recomputes the probabilities) and its
gradient written, 4 x 4 bytes per score; its re-reads of queries, keys and values per block
are left out, so the kernel's bytes are a lower bound. Prints a markdown table and writes
`--output` (every number, the versions).
"""

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from upcycle.fit import aot  # pylint: disable=g-import-not-at-top,wrong-import-position

HEAD_DIM = 64
GIB = 2 ** 30


def einsum_attention(q, k, v, bias):
  """T5's attention (`layers.MultiHeadAttention`): q, k, v `[b, s, h, d]`, bias `[1, h, s, s]`
  -> `[b, s, h, d]`."""
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) + bias
  weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum('bhqk,bkhd->bqhd', weights.astype(q.dtype), v)


def kernel_attention(q, k, v, bias):
  """The same by Pallas' TPU flash attention with the bias broadcast to every row."""
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=g-import-not-at-top
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  batch, length, heads, _ = q.shape
  ab = jnp.broadcast_to(bias, (batch, heads, length, length))
  y = flash_attention.flash_attention(heads_first(q), heads_first(k), heads_first(v), ab=ab,
                                      sm_scale=1.0)
  return heads_first(y)


def kernel_bias_bytes(*, batch: int, heads: int, length: int) -> int:
  """The least HBM traffic of the bias inside the kernels: read 3 times, its gradient written
  once, float32 `[batch, heads, length, length]`."""
  return 4 * 4 * batch * heads * length * length


def compile_gradient(attention: Callable, *, batch: int, heads: int, length: int,
                     device: Any) -> Dict[str, float]:
  """The compiler's counts of d(sum(y^2)) / d(q, k, v, bias) on `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  qkv = jax.ShapeDtypeStruct((batch, length, heads, HEAD_DIM), jnp.bfloat16, sharding=sharding)
  bias = jax.ShapeDtypeStruct((1, heads, length, length), jnp.float32, sharding=sharding)
  loss = lambda q, k, v, b: jnp.sum(attention(q, k, v, b).astype(jnp.float32) ** 2)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(qkv, qkv, qkv, bias).compile()
  flops, accessed = aot.compiled_counts(compiled)
  return {'bytes_accessed': accessed, 'flops': flops,
          'temp_bytes': int(compiled.memory_analysis().temp_size_in_bytes)}


def measure(*, batch: int, heads: int, length: int, device: Any) -> Dict[str, Any]:
  einsum = compile_gradient(einsum_attention, batch=batch, heads=heads, length=length,
                            device=device)
  kernel = compile_gradient(kernel_attention, batch=batch, heads=heads, length=length,
                            device=device)
  inside = kernel_bias_bytes(batch=batch, heads=heads, length=length)
  kernel['bytes_at_least'] = kernel['bytes_accessed'] + inside
  return {'batch': batch, 'heads': heads, 'length': length, 'einsum': einsum,
          'kernel': kernel, 'kernel_bias_bytes': inside,
          'bytes_ratio_at_least': kernel['bytes_at_least'] / einsum['bytes_accessed'],
          'temp_ratio': kernel['temp_bytes'] / einsum['temp_bytes']}


def table(rows) -> str:
  lines = ['| rows x length, heads | einsum: GB, temp GiB | kernel: GB outside + bias inside '
           '(at least), temp GiB | kernel / einsum: bytes (at least), temp |',
           '|---|---|---|---|']
  for r in rows:
    e, k = r['einsum'], r['kernel']
    lines.append(
        f"| {r['batch']} x {r['length']}, {r['heads']} | {e['bytes_accessed'] / 1e9:.2f}, "
        f"{e['temp_bytes'] / GIB:.3f} | {k['bytes_accessed'] / 1e9:.2f} + "
        f"{r['kernel_bias_bytes'] / 1e9:.2f} = {k['bytes_at_least'] / 1e9:.2f}, "
        f"{k['temp_bytes'] / GIB:.3f} | {r['bytes_ratio_at_least']:.2f}, "
        f"{r['temp_ratio']:.2f} |")
  return '\n'.join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=16, help='rows per chip')
  parser.add_argument('--lengths', default='512,2048', help='comma-separated sequence lengths')
  parser.add_argument('--heads', type=int, default=12)
  parser.add_argument('--output', default=os.path.join(REPO, 'benchmarks', 'results',
                                                       't5_bias_kernel.json'))
  return parser


def main(argv=None) -> None:
  args = build_parser().parse_args(argv)
  device = aot.topology_devices('v4:2x2x1')[0]
  rows = [measure(batch=args.batch, heads=args.heads, length=int(n), device=device)
          for n in args.lengths.split(',')]
  print(table(rows))
  versions = {p: importlib.metadata.version(p) for p in ('jax', 'jaxlib', 'libtpu')}
  with open(args.output, 'w') as f:
    json.dump({'device': 'TPU v4 (one chip, megacore)', 'rows': rows, 'versions': versions},
              f, indent=2)


if __name__ == '__main__':
  main()
