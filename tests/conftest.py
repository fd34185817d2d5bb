"""Test session setup: 8 simulated CPU devices, so sharding tests can build real meshes."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_flags = os.environ.get('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in _flags:
  _flags += ' --xla_force_host_platform_device_count=8'
if '--xla_backend_optimization_level' not in _flags:
  # Tests compile hundreds of tiny programs: skipping LLVM's optimizations roughly halves
  # compile time and leaves results within the tests' tolerances.
  _flags += ' --xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = _flags.strip()
