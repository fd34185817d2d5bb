"""T5X-format output: T5X's chunking rule, our reader, and the independent reader of
tests/checkpoints/t5x_reader.py."""

import dataclasses
import os

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest

from tests.checkpoints import helpers, t5x_reader
from upcycle import checkpoints, optimizer_state, partitioning, tree
from upcycle.checkpoints import flax_msgpack, t5x_writer
from upcycle.models import T5
from upcycle.moe import MoeConfig, routers
from upcycle.train import optimizers

E = 4
MOE = dataclasses.replace(helpers.CHECKPOINT_T5, encoder_moe=MoeConfig(num_experts=E),
                          decoder_moe=MoeConfig(num_experts=E, router=routers.TopK()))


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  """An MoE T5 with a bf16 leaf and its T5X Adafactor state after 3 updates, at step 3 (T5X's
  `state/step` is also Adafactor's count)."""
  flat = tree.flatten(helpers.random_params(MOE, seed=7))
  flat['token_embedder/embedding'] = flat['token_embedder/embedding'].astype(ml_dtypes.bfloat16)
  params = tree.unflatten(flat)
  axes = partitioning.logical_axes(_boxed_abstract())
  optimizer = optimizers.T5XAdafactor(beta1=0.9).build(axes)
  f32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  state = optimizer.init(f32)
  for seed in (1, 2, 3):
    grads = jax.tree.map(lambda x: np.random.default_rng(seed).normal(size=x.shape)
                         .astype(np.float32), f32)
    _, state = optimizer.update(grads, state, f32)
  model_dir = str(tmp_path_factory.mktemp('t5x_out'))
  directory = t5x_writer.write(model_dir, int(state.count), params,
                               t5x_writer.adafactor_param_states(state))
  return dict(dir=directory, model_dir=model_dir, params=params, state=state,
              optimizer=optimizer, f32=f32)


def _boxed_abstract():
  tokens = np.ones((1, 4), np.int32)
  return jax.eval_shape(T5(MOE).init, jax.random.PRNGKey(0), tokens, tokens)['params']


def test_chunk_shape_is_t5x_rule():
  # T5X: 64 MiB per chunk; the largest dimension goes to its next smaller divisor first.
  assert t5x_writer.chunk_shape((4096, 16384), 2**24) == [4096, 4096]     # float32 [d, f]
  assert t5x_writer.chunk_shape((32, 4096, 16384), 2**25) == [32, 1024, 1024]   # bf16 experts
  assert t5x_writer.chunk_shape((6, 10), 12) == [3, 2]
  assert t5x_writer.chunk_shape((8, 8, 3), 10) == [2, 2, 1]
  assert t5x_writer.chunk_shape((7, 5), 35) == [7, 5] and t5x_writer.chunk_shape((), 1) == []
  spec = t5x_writer.spec('target/a/kernel', (32, 4096, 16384), ml_dtypes.bfloat16)
  assert spec['metadata']['chunks'] == [32, 1024, 1024] and spec['dtype'] == 'bfloat16'


@pytest.mark.slow
def test_layout_read_by_independent_reader(written):
  raw, state = t5x_reader.read(written['dir'])
  assert raw['version'] == 3 and set(raw) == {'version', 'optimizer'}
  assert set(raw['optimizer']) == {'target', 'state'}
  assert set(raw['optimizer']['state']) == {'step', 'param_states'}
  step = raw['optimizer']['state']['step']
  assert isinstance(step, np.int32) and step == 3     # inline numpy scalar, as T5X writes it
  specs = t5x_reader.by_path(raw['optimizer']['target'])
  expert = specs['encoder/layers_1/mlp/expert/wi_0/kernel']
  assert expert['metadata']['shape'] == [E, 8, 12]
  assert expert['kvstore'] == {'driver': 'file',
                               'path': 'target.encoder.layers_1.mlp.expert.wi_0.kernel/'}
  assert expert['metadata']['compressor'] == {'id': 'gzip', 'level': 1}
  assert specs['decoder/layers_1/mlp/router/router_weights/w/kernel']['metadata']['shape'] == \
      [8, E]
  assert specs['token_embedder/embedding']['dtype'] == 'bfloat16'
  got = t5x_reader.by_path(state['target'])
  want = tree.flatten(written['params'])
  assert got.keys() == want.keys()
  for path, value in want.items():
    assert got[path].dtype == value.dtype, path
    np.testing.assert_array_equal(got[path], value, err_msg=path)
  slots = t5x_reader.by_path(state['state']['param_states'])
  for path, s in tree.flatten(written['state'].param_states).items():
    for name in ('v_row', 'v_col', 'v', 'm'):
      np.testing.assert_array_equal(slots[f'{path}/{name}'], np.asarray(getattr(s, name)),
                                    err_msg=f'{path}/{name}')
  wi = written['state'].param_states['encoder']['layers_1']['mlp']['expert']['wi_0']['kernel']
  assert slots['encoder/layers_1/mlp/expert/wi_0/kernel/v_row'].shape == (E, 8) == wi.v_row.shape
  assert slots['encoder/layers_1/mlp/expert/wi_0/kernel/v'].shape == (1,)   # placeholder, inline


def test_spec_has_the_form_t5x_writes(written):
  """Same keys and compressor as a spec in the T5X-written fixture (T5X writes 'gfile' there
  for its internal filesystem; 'file' is what T5X's code writes for a local directory)."""
  with open(os.path.join(helpers.T5X_FIXTURE, 'checkpoint'), 'rb') as f:
    fixture = msgpack.unpackb(f.read(), ext_hook=t5x_reader.ext_hook, raw=False)
  theirs = fixture['optimizer']['state']['param_states']['kernel']
  raw, _ = t5x_reader.read(written['dir'])
  ours = raw['optimizer']['target']['decoder']['logits_dense']['kernel']
  assert set(ours) == set(theirs) and set(ours['metadata']) == set(theirs['metadata'])
  assert set(ours['kvstore']) == set(theirs['kvstore'])
  assert ours['metadata']['compressor'] == theirs['metadata']['compressor']
  assert ours['kvstore']['path'].endswith('/') and theirs['kvstore']['path'].endswith('/')


def test_round_trip_through_our_reader(written):
  ckpt = checkpoints.load(written['model_dir'])
  assert (ckpt.format, ckpt.step, ckpt.path) == ('t5x', 3, written['dir'])
  for path, value in tree.flatten(written['params']).items():
    got = tree.flatten(ckpt.params)[path]
    assert got.dtype == value.dtype, path
    np.testing.assert_array_equal(got, value, err_msg=path)
  restored = optimizer_state.from_t5x_adafactor(ckpt.optimizer_state, written['f32'],
                                            written['optimizer'])
  assert int(restored.count) == int(written['state'].count) == 3
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(written['state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(helpers.t5_logits(ckpt.params, MOE),
                                helpers.t5_logits(written['params'], MOE))


def test_existing_step_is_refused_and_nothing_is_left(written, tmp_path):
  before = helpers.snapshot(written['model_dir'])
  with pytest.raises(FileExistsError, match='checkpoint_3 already exists'):
    t5x_writer.write(written['model_dir'], 3, written['params'])
  assert helpers.snapshot(written['model_dir']) == before
  t5x_writer.write(str(tmp_path), 0, {'w': np.ones((2, 3), np.float32)})
  assert os.listdir(tmp_path) == ['checkpoint_0']       # the .tmp- directory was renamed
  assert flax_msgpack.restore(open(tmp_path / 'checkpoint_0' / 'checkpoint', 'rb').read(),
                              '')['optimizer']['state']['param_states'] == {}


def test_on_gcs_written_in_place_with_the_checkpoint_file_last(written, gcs_emulator,
                                                                monkeypatch):
  """gs:// (the emulator): the same objects and the same msgpack as locally, read back by our
  reader; existing steps refused, unfinished ones named. In this process, as the writer and
  the T5X reader use tensorstore alone, which TENSORSTORE_GCS_HTTP_URL redirects (etils.epath
  may already be bound to TensorFlow's GCS client here, which cannot be redirected)."""
  for k, v in gcs_emulator.items():
    monkeypatch.setenv(k, v)
  from upcycle.checkpoints import gcs  # pylint: disable=g-import-not-at-top
  url, local = 'gs://bucket/t5x_writer', written['dir']
  param_states = t5x_writer.adafactor_param_states(written['state'])
  assert t5x_writer.write(url, 3, written['params'], param_states) == f'{url}/checkpoint_3'
  files = sorted(os.path.relpath(os.path.join(d, f), local)
                 for d, _, fs in os.walk(local) for f in fs)
  assert gcs.names(f'{url}/checkpoint_3') == files
  with open(os.path.join(local, 'checkpoint'), 'rb') as f:
    assert gcs.read_bytes(f'{url}/checkpoint_3/checkpoint') == f.read()
  ckpt = checkpoints.load(url, format='t5x')   # detection would ask etils.epath (see above)
  assert (ckpt.format, ckpt.step, ckpt.path) == ('t5x', 3, f'{url}/checkpoint_3')
  for path, value in tree.flatten(written['params']).items():
    np.testing.assert_array_equal(tree.flatten(ckpt.params)[path], value, err_msg=path)
  with pytest.raises(FileExistsError, match='checkpoint_3 already exists; T5X'):
    t5x_writer.write(url, 3, written['params'])
  gcs.write_bytes(f'{url}/checkpoint_4/target.x/.zarray', b'{}')
  with pytest.raises(FileExistsError, match='no checkpoint file: a write that did not finish'):
    t5x_writer.write(url, 4, written['params'])
