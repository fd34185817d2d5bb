"""The start-up line of a run: processes, devices, mesh, parameters in all and per device (from
their shardings), where checkpoints go."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from upcycle import partitioning
from upcycle.train import startup


def test_the_start_up_line_counts_each_device_s_share_of_the_parameters():
  mesh = partitioning.make_mesh(num_expert_partitions=2)   # 8 CPU devices: data 4, expert 2
  params = {
      'experts': jax.ShapeDtypeStruct((2, 8, 1000), jnp.float32,
                                      sharding=NamedSharding(mesh, PartitionSpec('expert'))),
      'dense': jax.ShapeDtypeStruct((500,), jnp.bfloat16,
                                    sharding=NamedSharding(mesh, PartitionSpec()))}
  assert startup.summary(params, mesh, 'gs://b/run/checkpoints') == (
      'Training on 1 process(es), 8 cpu devices (8 on this one), mesh data=4 x expert=2 x '
      'model=1: 16.5K parameters, 8.5K (32.2 KiB) on each device; checkpoints go to '
      'gs://b/run/checkpoints.')
