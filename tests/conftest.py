"""Test session setup: 8 simulated CPU devices, so sharding tests can build real meshes."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
