"""notebooks/*.ipynb run top to bottom in a real kernel (nbclient); any cell error fails.

The kernel is this interpreter (a kernelspec written for the test, so a user-level 'python3'
kernel elsewhere cannot stand in), imports this checkout, and runs in a temporary directory;
routing.ipynb and ablations.ipynb share one runs directory (UPCYCLE_NOTEBOOK_RUNS), so the
dense run routing.ipynb trains is reused. Outputs are stripped in git (checked here too).
"""

import json
import os
import pathlib
import sys
import time

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from tests.helpers import REPO

NOTEBOOKS = ('upcycle_a_checkpoint.ipynb', 'routing.ipynb', 'ablations.ipynb',  # in this order
             'upcycle_llama.ipynb')
KERNEL = 'upcycle-test-python'


@pytest.fixture(scope='module')
def kernel(tmp_path_factory):
  """(kernel manager factory, env, working directory) shared by the notebooks."""
  specs = tmp_path_factory.mktemp('kernels')
  os.makedirs(specs / KERNEL)
  with open(specs / KERNEL / 'kernel.json', 'w') as f:
    json.dump({'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
               'display_name': 'upcycle (test)', 'language': 'python'}, f)
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_backend_optimization_level=0'    # one CPU device, as a user has
  env['PYTHONPATH'] = os.pathsep.join([REPO, env.get('PYTHONPATH', '')]).rstrip(os.pathsep)
  env.update(MPLBACKEND='Agg', TF_CPP_MIN_LOG_LEVEL='3', JAX_PLATFORMS='cpu',
             UPCYCLE_NOTEBOOK_RUNS=str(tmp_path_factory.mktemp('notebook_runs')))
  work = tmp_path_factory.mktemp('notebook_cwd')

  def manager():
    return KernelManager(kernel_name=KERNEL,
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs)]))

  return manager, env, str(work)


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_is_stripped(name):
  nb = nbformat.read(pathlib.Path(REPO, 'notebooks', name), as_version=4)
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert not cell.outputs and cell.execution_count is None, f'{name}: strip the outputs'


@pytest.mark.slow
@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_runs(name, kernel):
  manager, env, work = kernel
  nb = nbformat.read(pathlib.Path(REPO, 'notebooks', name), as_version=4)
  client = nbclient.NotebookClient(nb, km=manager(), timeout=300,
                                   resources={'metadata': {'path': work}})
  start = time.time()
  client.execute(env=env)   # raises CellExecutionError naming the cell on any error
  print(f'{name}: {time.time() - start:.0f} s')
