"""The roofline bound on a compiled function's time per call, and the MFU it allows.

A TPU core can do no more than its peak FLOP/s and move no more than its HBM bandwidth, so a
program that executes F FLOPs and accesses B bytes of HBM per device takes at least
max(F / peak, B / bandwidth) seconds. The bound ignores communication between devices and
any imperfect overlap of compute with memory traffic: a real step is slower. The model FLOPs
utilization at that bound, model FLOPs per step / (devices x peak x bound), is the most a
run of this program can reach.

Peaks (bf16 matmuls) and HBM bandwidths per chip are Cloud TPU's system architecture pages':
v4 275 TFLOP/s and 1228 GB/s, v5p ('TPU v5') 459 and 2765, v5e ('TPU v5 lite') 197 and 819,
v6e ('TPU v6 lite') 918 and 1640. A v4 chip shown as two devices (one per TensorCore, no
megacore) gives each half of both.
"""

import dataclasses
from typing import Optional

# {device kind as libtpu names it: (peak bf16 FLOP/s, HBM bytes/s) per chip}
PEAKS = {
    'TPU v4': (275e12, 1228e9),
    'TPU v5': (459e12, 2765e9),
    'TPU v5 lite': (197e12, 819e9),
    'TPU v6 lite': (918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Roofline:
  """seconds: the lower bound on the time per call; bound: 'compute' or 'memory', whichever
  sets it; mfu: the model FLOPs utilization at that time (None without model FLOPs)."""

  seconds: float
  bound: str
  mfu: Optional[float]


def roofline(*, flops_per_device: float, bytes_per_device: float, device_kind: str,
             megacore: bool = True, devices: int = 1,
             model_flops: Optional[float] = None) -> Optional[Roofline]:
  """The bound for one call of a program (module docstring); None for a device kind
  without known peaks, or a program that counts nothing."""
  if device_kind not in PEAKS:
    return None
  peak, bandwidth = PEAKS[device_kind]
  if device_kind == 'TPU v4' and not megacore:
    peak, bandwidth = peak / 2, bandwidth / 2
  compute, memory = flops_per_device / peak, bytes_per_device / bandwidth
  seconds = max(compute, memory)
  if seconds <= 0:
    return None
  mfu = None if not model_flops else model_flops / (devices * peak * seconds)
  return Roofline(seconds, 'compute' if compute >= memory else 'memory', mfu)
