"""HBM per TPU device: the chip's nominal size and what the TPU compiler can use of it.

The compiler keeps part of every chip's HBM for itself and refuses a program whose
temporaries exceed the rest, saying how much is left ("... exceeds available HBM (30.75G)"
on a v4 chip). A run fits when its total per device is within that usable figure, not within
the nominal one. The usable figures below are the compiler's own (libtpu 0.0.x as jax[tpu]
pins it), read from that refusal for a program far too large for each device kind
(`tests/test_aot.py` asks the compiler again); the nominal ones are Cloud TPU's system
architecture pages' (v5p's 95 GiB is less than the 95.74 the compiler says it can use).

Device kinds as libtpu reports them: v4, v5p ('TPU v5'), v5e ('TPU v5 lite'), v6e ('TPU v6
lite'). A v4 chip has two TensorCores, which a Cloud TPU VM shows as one device (megacore) and
libtpu's topology description as two unless asked for the chip view; one core's usable HBM
is less than half the chip's (15.25 of 30.75 GiB). v5p's description is per chip already.
"""

import dataclasses
import re
from typing import Optional, Tuple

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Capacity:
  """One device's HBM in bytes: nominal (the chip's spec) and usable (the compiler's)."""

  nominal: int
  usable: int


# {device kind: (one device per chip, one device per TensorCore)}; None where the kind has
# one device per chip either way.
CAPACITIES = {
    'TPU v4': (Capacity(32 * GIB, int(30.75 * GIB)), Capacity(16 * GIB, int(15.25 * GIB))),
    'TPU v5': (Capacity(95 * GIB, int(95.74 * GIB)), None),
    'TPU v5 lite': (Capacity(16 * GIB, int(15.75 * GIB)), None),
    'TPU v6 lite': (Capacity(32 * GIB, int(31.25 * GIB)), None),
}


class UnknownDeviceError(ValueError):
  pass


def capacity(device_kind: str, megacore: bool = True) -> Capacity:
  """The HBM of one device of `device_kind`: a chip's, or a core's for v4 without megacore."""
  if device_kind not in CAPACITIES:
    raise UnknownDeviceError(f'No HBM size known for {device_kind!r}; known: '
                             f'{sorted(CAPACITIES)}.')
  chip, core = CAPACITIES[device_kind]
  return chip if megacore or core is None else core


_REFUSAL = re.compile(r'HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available HBM '
                      r'\(([0-9.]+)([KMGT])\)')
_UNITS = {'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}


def refusal(message: str) -> Optional[Tuple[int, int]]:
  """(temporaries, usable HBM) in bytes from the compiler's RESOURCE_EXHAUSTED message
  ("... HLO temporaries (32.98G) exceeds available HBM (30.75G)", binary units, two
  decimals); None for a message without them."""
  found = _REFUSAL.search(message)
  if found is None:
    return None
  temp, temp_unit, usable, usable_unit = found.groups()
  return (int(float(temp) * _UNITS[temp_unit]), int(float(usable) * _UNITS[usable_unit]))
