"""How many processes the Cloud TPU slice this process runs on has, decided as
`jax.distributed.initialize()` decides it.

JAX's cluster detection (jax/_src/clusters/cloud_tpu_cluster.py) recognises, on a machine with
TPU chips and libtpu (`running_in_cloud_tpu_vm`):
- a GKE TPU pod: TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES lists the workers;
- a Cloud TPU VM: the GCE metadata server answers `agent-worker-number` (unless
  TPU_SKIP_MDS_QUERY is set), and `worker-network-endpoints` lists the workers.
Either way the process count is the workers of one slice times MEGASCALE_NUM_SLICES (from the
environment, else the metadata's `tpu-env`). The detection is JAX's own, so `--multi_host=auto`
initializes exactly where `jax.distributed.initialize()` would find its peers.
"""


def processes() -> int:
  """The processes JAX's detection finds for this TPU slice; 1 off a Cloud TPU VM."""
  import jax  # pylint: disable=g-import-not-at-top,unused-import  (sets running_in_cloud_tpu_vm)
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  for cluster in (clusters.GkeTpuCluster, clusters.GceTpuCluster):   # JAX's order
    if cluster.is_env_present():
      return cluster.get_process_count()
  return 1
