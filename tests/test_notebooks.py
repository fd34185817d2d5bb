"""notebooks/*.ipynb run top to bottom in a real kernel (nbclient); any cell error fails, and
what each notebook shows a user is checked against a reference outside it (`CHECKS`).

The kernel is this interpreter (a kernelspec written for the test, so a user-level 'python3'
kernel elsewhere cannot stand in), imports this checkout, and runs in a temporary directory;
routing.ipynb and ablations.ipynb share one runs directory (UPCYCLE_NOTEBOOK_RUNS), so the
dense run routing.ipynb trains is reused. Outputs are stripped in git (checked here too).
"""

import json
import os
import pathlib
import re
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


def _printed(nb):
  """Everything the executed notebook's cells printed."""
  return ''.join(out.get('text', '') for cell in nb.cells if cell.cell_type == 'code'
                 for out in cell.outputs if out.output_type == 'stream')


def _number(printed, label):
  """The number printed right after `label`."""
  found = re.search(re.escape(label) + r'\s*([-+.e0-9]+)', printed)
  assert found, f'{label!r} not printed'
  return float(found.group(1))


def _check_upcycle_a_checkpoint(printed, env, work):
  """The dense model read from the HF checkpoint was compared with transformers' (the cell
  runs only when the notebook built the model itself, as here) and agrees."""
  del env, work
  assert _number(printed, 'max |ours - transformers|:') <= 1e-4


def _check_routing(printed, env, work):
  """The layers it plots are the MoE layers of moe/paper_t5.gin on 2 + 2 layers: T5X's every
  other layer, layers_1 of each stack."""
  del env, work
  assert "['decoder/layers_1/mlp', 'encoder/layers_1/mlp']" in printed


def _check_ablations(printed, env, work):
  """Its table shows each run's own final validation loss and FLOPs per step, as the trainer
  wrote them in the run's metrics.jsonl, after all 30 steps."""
  del work
  for label, run in (('dense (continued)', 'dense_continued'), ('Sparse Upcycling', 'moe_copy'),
                     ('Drop-Upcycling (r=0.5)', 'moe_drop')):
    with open(os.path.join(env['UPCYCLE_NOTEBOOK_RUNS'], run, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f]
    last_eval = max((r for r in rows if r['split'] == 'eval'), key=lambda r: r['step'])
    last_train = max((r for r in rows if r['split'] == 'train'), key=lambda r: r['step'])
    assert last_eval['step'] == 30, run
    line = (f"{label:24s} train FLOPs/step {last_train['train_flops_per_step']:.3g}  "
            f"final validation loss {last_eval['loss']:.4f}")
    assert line in printed.splitlines(), (line, printed)


def _check_upcycle_llama(printed, env, work):
  """The exported model is, for transformers, a Mixtral of the notebook's 4 experts, top-2,
  with the dense Llama's dimensions; the copy-upcycled model picks the dense model's next
  token everywhere."""
  del env
  import transformers  # pylint: disable=g-import-not-at-top
  root = os.path.join(work, 'llama_to_mixtral')
  dense = transformers.AutoConfig.from_pretrained(os.path.join(root, 'dense_llama'))
  mixtral = transformers.AutoConfig.from_pretrained(os.path.join(root, 'mixtral_hf'))
  assert mixtral.architectures == ['MixtralForCausalLM']
  assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
  for key in ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
              'num_attention_heads', 'num_key_value_heads', 'head_dim', 'rms_norm_eps'):
    assert getattr(mixtral, key) == getattr(dense, key), key
  assert re.search(r'^copy \(step 0\): .* same next token: 100%$', printed, re.M), printed


CHECKS = {'upcycle_a_checkpoint.ipynb': _check_upcycle_a_checkpoint,
          'routing.ipynb': _check_routing, 'ablations.ipynb': _check_ablations,
          'upcycle_llama.ipynb': _check_upcycle_llama}


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
  CHECKS[name](_printed(nb), env, work)
