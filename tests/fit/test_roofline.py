"""The roofline bound and the MFU it allows, by hand from the chips' published peaks."""

import pytest

from upcycle.fit.roofline import roofline


def test_the_slower_of_compute_and_memory_bounds_the_step():
  # A v4 chip: 275 TFLOP/s, 1228 GB/s. 550 TFLOP take 2 s; 1228 GB take 1 s.
  bound = roofline(flops_per_device=550e12, bytes_per_device=1228e9, device_kind='TPU v4',
                   devices=8, model_flops=8 * 275e12)
  assert (bound.seconds, bound.bound) == (pytest.approx(2.0), 'compute')
  assert bound.mfu == pytest.approx(0.5)   # the model's FLOPs are half of what the chips do
  memory = roofline(flops_per_device=275e12, bytes_per_device=3 * 1228e9, device_kind='TPU v4')
  assert (memory.seconds, memory.bound, memory.mfu) == (pytest.approx(3.0), 'memory', None)


def test_a_v4_core_has_half_a_chip_and_unknown_chips_have_no_bound():
  per_core = roofline(flops_per_device=275e12, bytes_per_device=0.0, device_kind='TPU v4',
                      megacore=False)
  assert per_core.seconds == pytest.approx(2.0)
  v5e = roofline(flops_per_device=197e12, bytes_per_device=0.0, device_kind='TPU v5 lite')
  assert v5e.seconds == pytest.approx(1.0)
  assert roofline(flops_per_device=1.0, bytes_per_device=1.0, device_kind='cpu') is None
