"""--multi_host=auto on a Cloud TPU VM slice: decided by JAX's own cluster detection, from the
environment a TPU VM worker has and its GCE metadata server (a local fake here, reached through
JAX's GCE_METADATA_IP); only the TPU chips are pretended (`running_in_cloud_tpu_vm`)."""

import http.server
import os
import socket
import subprocess
import sys
import threading

import jax
from jax._src.clusters import cloud_tpu_cluster
import pytest

from tests.helpers import REPO
from upcycle import distributed, tpu_slice


def metadata_server(attributes: dict):
  """A GCE metadata server answering `instance/attributes/<key>` from `attributes`; returns
  (server, the keys asked for)."""
  asked = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # pylint: disable=invalid-name
      key = self.path.rsplit('/', 1)[-1]
      asked.append(key)
      ok = key in attributes and self.headers.get('Metadata-Flavor') == 'Google'
      body = attributes.get(key, '').encode()
      self.send_response(200 if ok else 404)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      del args

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
  threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
  return server, asked


def worker_metadata(workers: int, worker: int = 0) -> dict:
  """What a TPU VM worker's metadata holds (v4: 4 chips, 8 TensorCores per host)."""
  return {'agent-worker-number': str(worker),
          'accelerator-type': f'v4-{8 * workers}',
          'worker-network-endpoints': ','.join(f'10.130.0.{i + 2}' for i in range(workers)),
          'tpu-env': f"ACCELERATOR_TYPE: 'v4-{8 * workers}'\nWORKER_ID: '{worker}'\n"}


@pytest.fixture
def tpu_vm(monkeypatch):
  """This process as a TPU VM worker whose metadata server serves `attributes`."""
  for name in ('TPU_SKIP_MDS_QUERY', 'TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES',
               'MEGASCALE_NUM_SLICES', 'MEGASCALE_SLICE_ID', 'MEGASCALE_COORDINATOR_ADDRESS',
               'UPCYCLE_COORDINATOR_ADDRESS', 'UPCYCLE_NUM_PROCESSES', 'UPCYCLE_PROCESS_ID'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(cloud_tpu_cluster, 'running_in_cloud_tpu_vm', True)
  servers = []

  def serve(attributes):
    server, asked = metadata_server(attributes)
    servers.append(server)
    monkeypatch.setenv('GCE_METADATA_IP', f'127.0.0.1:{server.server_address[1]}')
    return asked

  yield serve
  for server in servers:
    server.shutdown()


@pytest.fixture
def initialize_calls(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: calls.append(kw))
  return calls


@pytest.mark.parametrize('workers', [1, 2, 8])
def test_a_tpu_vm_worker_counts_the_workers_its_metadata_lists(tpu_vm, workers):
  tpu_vm(worker_metadata(workers))
  assert tpu_slice.processes() == workers


def test_multislice_multiplies_by_the_number_of_slices(tpu_vm, monkeypatch):
  tpu_vm(worker_metadata(4))
  monkeypatch.setenv('MEGASCALE_NUM_SLICES', '2')
  assert tpu_slice.processes() == 8


def test_a_gke_tpu_pod_is_read_from_tpu_worker_hostnames(tpu_vm, monkeypatch):
  asked = tpu_vm({'tpu-env': ''})
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'w-0,w-1,w-2,w-3')
  monkeypatch.setenv('TPU_WORKER_ID', '1')
  assert tpu_slice.processes() == 4 and 'worker-network-endpoints' not in asked


def test_off_a_tpu_vm_nothing_is_asked_and_one_process_runs(tpu_vm, monkeypatch):
  asked = tpu_vm(worker_metadata(8))
  monkeypatch.setattr(cloud_tpu_cluster, 'running_in_cloud_tpu_vm', False)
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'w-0,w-1')   # not a TPU VM: JAX ignores it too
  assert tpu_slice.processes() == 1
  monkeypatch.setattr(cloud_tpu_cluster, 'running_in_cloud_tpu_vm', True)
  monkeypatch.delenv('TPU_WORKER_HOSTNAMES')
  monkeypatch.setenv('TPU_SKIP_MDS_QUERY', '1')   # what jax sets on a VM without TPU chips
  assert tpu_slice.processes() == 1 and asked == []


def test_auto_initializes_on_a_multi_worker_slice_only(tpu_vm, initialize_calls):
  tpu_vm(worker_metadata(1))
  distributed.join('auto')   # v4-8: one host, nothing to join
  assert initialize_calls == []
  asked = tpu_vm(worker_metadata(8))
  distributed.join('no')
  assert initialize_calls == [] and asked == []
  with pytest.raises(SystemExit):
    distributed.join('auto')
  assert initialize_calls == [{}]   # JAX detects the coordinator and process id itself


def test_a_slice_whose_processes_did_not_join_stops_with_one_line(tpu_vm, initialize_calls):
  """initialize() mocked to join nothing: the worker sees 1 process of 8 and stops at once."""
  tpu_vm(worker_metadata(8))
  with pytest.raises(SystemExit) as stopped:
    distributed.join('yes')
  assert str(stopped.value) == (
      'This TPU slice has 8 workers but JAX runs 1 process(es) (jax.distributed initialized: '
      'False): run the same command on every worker at once with --multi_host=auto or yes '
      '(launch/tpu_vm.py train does).')


def test_yes_with_no_cluster_to_join_is_one_line():
  """A fresh process (initialize() must come before JAX's backend starts): no TPU slice."""
  done = subprocess.run(
      [sys.executable, '-c', 'from upcycle import distributed\n'
                             "distributed.join('yes')"],
      env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': REPO}, capture_output=True,
      text=True, check=False, timeout=120)
  assert done.returncode == 1 and done.stderr == (
      '--multi_host: jax.distributed.initialize() failed: coordinator_address should be '
      'defined. (every worker must run the same command at once; --multi_host=no runs this '
      'process alone).\n')


_WORKER = """
import os, jax
os.environ.pop('TPU_SKIP_MDS_QUERY')   # jax sets it on a machine without TPU chips
from upcycle import distributed
distributed.join('auto')
print(jax.process_index(), jax.process_count())
"""


def test_two_workers_of_a_slice_join_through_jax_s_own_detection(tpu_vm):
  """Two processes, each with its worker's metadata server (agent-worker-number 0 and 1),
  join with --multi_host=auto: JAX reads the coordinator (the first worker endpoint), the
  process count and id from the metadata, as on a v4-16."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  workers = []
  for worker in (0, 1):
    tpu_vm({**worker_metadata(2, worker), 'worker-network-endpoints': '127.0.0.1,127.0.0.1'})
    env = {**os.environ, 'JAX_FORCE_TPU_INIT': '1', 'JAX_PLATFORMS': 'cpu',
           'JAX_COORDINATOR_PORT': str(port), 'PYTHONPATH': REPO, 'XLA_FLAGS': ''}
    workers.append(subprocess.Popen([sys.executable, '-c', _WORKER], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
  outputs = [w.communicate(timeout=120) for w in workers]
  assert [out for out, _ in outputs] == ['0 2\n', '1 2\n'], outputs
