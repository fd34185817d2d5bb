"""`python -m upcycle.convert`: round trip, the trainer reading the output, refusals, dry run."""

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import gin
import numpy as np
import pytest

from tests.checkpoints import helpers, t5x_writer
from tests.helpers import REPO
from upcycle import checkpoints, console, convert, partitioning, tree
from upcycle.locks.file_lock import FileLock
from upcycle.models.families import abstract_params
from upcycle.checkpoints import orbax
from upcycle.models import T5, scan_layout
from upcycle.moe import MoeConfig, routers
from upcycle.train import objectives, optimizers
from upcycle.train.built_run import build_run
from upcycle.restore import Restore
from upcycle.train.trainer import TrainConfig
from upcycle.upcycling import experts, modes, stream
from upcycle.upcycling.surgery import upcycle

GIN = '''
from __gin__ import dynamic_registration
from upcycle import models
from upcycle.moe import config as moe
from upcycle.moe import routers

MODEL = @models.T5()
models.T5.config = @models.T5Config()
models.T5Config:
  vocab_size = 32
  d_model = 8
  num_heads = 2
  d_kv = 4
  d_ff = 12
  num_encoder_layers = 2
  num_decoder_layers = 2
  relative_attention_num_buckets = 8
  relative_attention_max_distance = 16
  encoder_moe = @encoder/moe.MoeConfig()
  decoder_moe = @decoder/moe.MoeConfig()
encoder/moe.MoeConfig.num_experts = 4
decoder/moe.MoeConfig:
  num_experts = 4
  router = @routers.TopK()
'''
CONFIG = dataclasses.replace(helpers.CHECKPOINT_T5, encoder_moe=MoeConfig(num_experts=4),
                             decoder_moe=MoeConfig(num_experts=4, router=routers.TopK()))
DROP = 'drop(ratio=0.5, index_sharing="per_matrix")'


@pytest.fixture(autouse=True)
def _fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(scope='module')
def source(tmp_path_factory):
  """A dense T5 in the T5X format at step 6 (one leaf in zarr), and the gin file of its MoE."""
  root = tmp_path_factory.mktemp('convert')
  params = helpers.random_params(helpers.CHECKPOINT_T5, seed=2)
  layout = t5x_writer.Layout(zarr={'target/decoder/layers_1/mlp/wo/kernel': 'gzip'})
  directory = t5x_writer.write(str(root / 'dense'), 6, params, layout=layout)
  gin_file = root / 'moe.gin'
  gin_file.write_text(GIN)
  return dict(params=params, dir=directory, gin=str(gin_file))


def _main(source, output_dir, *extra):
  return convert.main(['--source', source['dir'], '--gin_file', source['gin'],
                       '--output_dir', str(output_dir), *extra])


def test_round_trip_equals_in_memory_surgery_and_trains_on(source, tmp_path, capsys, caplog):
  before = helpers.snapshot(source['dir'])
  out = tmp_path / 'moe'
  assert _main(source, out, '--experts', DROP, '--seed', '3') == 0
  # No library warning reaches the console (orbax's on a handler registry without jax.Array).
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
  assert helpers.snapshot(source['dir']) == before
  assert os.listdir(tmp_path) == ['moe']  # No temporary directory left behind.
  printed = capsys.readouterr().out
  assert 'Wrote' in printed
  ckpt = checkpoints.load(str(out))
  arrays = len(tree.flatten(ckpt.params))
  assert f'convert: {arrays}/{arrays} arrays (100%)' in printed   # progress
  assert (ckpt.format, ckpt.step, ckpt.optimizer_state) == ('orbax', 6, None)
  want, _ = upcycle(source['params'], abstract_params(CONFIG), rng=3,
                    experts=experts.Drop(0.5, index_sharing='per_matrix'))
  got = tree.flatten(ckpt.params)
  assert got.keys() == tree.flatten(want).keys()
  for path, x in tree.flatten(want).items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(x), err_msg=path)

  # The trainer's hook reads it as it is, on the mesh.
  train = TrainConfig(model_dir='unused', train_steps=1, batch_size=4, num_expert_partitions=2,
                      num_model_partitions=2)
  batch = {'encoder_input_tokens': np.zeros((4, 6), np.int32),
           'decoder_input_tokens': np.zeros((4, 4), np.int32)}
  built = build_run(objective=objectives.Seq2Seq(T5(CONFIG)), optimizer=optimizers.Adafactor(),
                    config=train, host_batch=batch)
  with partitioning.activate(built.mesh):
    state = Restore(str(out), modes.Continue(), reuse_optimizer_state=False)(built.abstract,
                                                                          built.optimizer)
  assert int(state.step) == 6
  for path, x in tree.flatten(state.params).items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(got[path]), err_msg=path)
    assert x.sharding == tree.flatten(built.abstract.params)[path].sharding


def test_a_scanned_dense_run_converts_into_unrolled_moe_layers(tmp_path, capsys):
  """A dense run trained with SCAN_LAYERS = True (`layers/subblock_0 [layers, ...]`), converted
  for a scanned MoE model: the output holds T5X's unrolled layers (which a scanned run
  restores), each the copy-upcycle of the dense run's layer."""
  depths = dict(num_encoder_layers=4, num_decoder_layers=4)
  dense = dataclasses.replace(helpers.CHECKPOINT_T5, scan_layers=True, **depths)
  params = helpers.random_params(dense, seed=4)
  with orbax.CheckpointManager(str(tmp_path / 'dense'), async_save=False) as manager:
    manager.save(6, params)
  moe = dataclasses.replace(CONFIG, **depths)
  console.show_progress()   # as the entry point does
  convert.convert(str(tmp_path / 'dense'), dataclasses.replace(moe, scan_layers=True),
                  str(tmp_path / 'moe'))
  assert 'holds scanned layers: reading them unrolled' in capsys.readouterr().out
  want, _ = upcycle(scan_layout.unstack(params, dense), abstract_params(moe), rng=0)
  got = tree.flatten(checkpoints.load(str(tmp_path / 'moe')).params)
  assert got.keys() == tree.flatten(want).keys()
  for path, x in tree.flatten(want).items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(x), err_msg=path)


def test_t5x_output_is_t5x_native_with_flaxformer_moe_names(source, tmp_path, capsys):
  out = tmp_path / 'moe_t5x'
  assert _main(source, out, '--experts', DROP, '--seed', '3', '--output_format', 't5x') == 0
  assert f'Wrote {out}/checkpoint_6.' in capsys.readouterr().out
  assert os.listdir(tmp_path) == ['moe_t5x']
  assert sorted(os.listdir(out)) == ['checkpoint_6', 'config.gin', 'upcycling_report.txt']
  assert os.path.isdir(out / 'checkpoint_6' / 'target.encoder.layers_1.mlp.expert.wi_0.kernel')
  ckpt = checkpoints.load(str(out))
  assert (ckpt.format, ckpt.step) == ('t5x', 6)
  assert ckpt.optimizer_state == {'step': 6, 'param_states': {}}
  want, _ = upcycle(source['params'], abstract_params(CONFIG), rng=3,
                    experts=experts.Drop(0.5, index_sharing='per_matrix'))
  got = tree.flatten(ckpt.params)
  assert got.keys() == tree.flatten(want).keys()
  assert got['decoder/layers_1/mlp/router/router_weights/w/kernel'].shape == (8, 4)
  for path, x in tree.flatten(want).items():
    np.testing.assert_array_equal(got[path], np.asarray(x), err_msg=path)


def test_grows_a_trained_moe_on_disk_experts_and_depth(source, tmp_path, capsys):
  """--grow_experts / --grow_depth: each new expert (and router column), each new layer, the
  copy of the source's the flag names (reference: numpy indexing of the source leaves)."""
  moe_dir = tmp_path / 'moe'
  assert _main(source, moe_dir, '--seed', '3') == 0   # 4 experts per block, 2 + 2 layers
  moe = tree.flatten(checkpoints.load(str(moe_dir)).params)
  grow = lambda gin_text, *flags: convert.main([
      '--source', str(moe_dir), '--gin_file', str(_write(tmp_path / 'grown.gin', gin_text)),
      '--output_dir', str(tmp_path / 'grown'), '--overwrite', *flags])

  assert grow(GIN.replace('num_experts = 4', 'num_experts = 6'),
              '--grow_experts', '[3, 0]') == 0
  assert ('encoder/layers_1/mlp: 4 -> 6 experts, new experts [4, 5] copy [3, 0]'
          in capsys.readouterr().out)
  got = tree.flatten(checkpoints.load(str(tmp_path / 'grown')).params)
  assert got.keys() == moe.keys()
  for path, x in moe.items():
    x = np.asarray(x)
    if '/expert/' in path:
      x = np.concatenate([x, x[[3, 0]]], axis=0)
    elif '/router/' in path:
      x = np.concatenate([x, x[:, [3, 0]]], axis=1)
    np.testing.assert_array_equal(np.asarray(got[path]), x, err_msg=path)

  assert grow(GIN.replace('num_encoder_layers = 2', 'num_encoder_layers = 4'),
              '--grow_depth', 'tile') == 0
  got = tree.flatten(checkpoints.load(str(tmp_path / 'grown')).params)
  for path, x in got.items():
    source_path = path.replace('encoder/layers_2/', 'encoder/layers_0/').replace(
        'encoder/layers_3/', 'encoder/layers_1/')
    np.testing.assert_array_equal(np.asarray(x), np.asarray(moe[source_path]), err_msg=path)
  assert 'encoder/layers_3/mlp/expert/wi_0/kernel' in got

  capsys.readouterr()
  assert grow(GIN, '--grow_experts', 'tile', '--experts', 'drop') == 1
  assert capsys.readouterr().err.strip() == (
      "error: --grow_experts copies the source's own experts and router columns; --experts, "
      "--router and --cast apply to upcycling a dense checkpoint. Fix: drop them.")


def _write(path, text):
  path.write_text(text)
  return path


def test_an_output_name_of_250_characters_converts_and_is_replaced(source, tmp_path):
  """The hidden work and replaced directories beside it fit the filesystem's 255 bytes."""
  out = tmp_path / ('c' * 250)
  assert _main(source, out) == 0
  assert _main(source, out, '--overwrite', '--experts', DROP) == 0
  assert os.listdir(tmp_path) == [out.name] and os.listdir(out)


def test_the_restore_hooks_initializer_bindings_are_honoured_or_refused(source, tmp_path,
                                                                         capsys):
  """--gin_file=upcycling/drop.gin does in convert what it does in training; a flag that
  disagrees stops in one line."""
  assert _main(source, tmp_path / 'gin', '--gin_file=upcycling/drop.gin', '--seed', '3') == 0
  assert _main(source, tmp_path / 'flag', '--experts', 'drop(ratio=0.5)', '--seed', '3') == 0
  by_gin = tree.flatten(checkpoints.load(str(tmp_path / 'gin')).params)
  by_flag = tree.flatten(checkpoints.load(str(tmp_path / 'flag')).params)
  for path, leaf in by_flag.items():
    np.testing.assert_array_equal(by_gin[path], leaf, err_msg=path)
  wo = 'decoder/layers_1/mlp/expert/wo/kernel'
  assert not np.array_equal(by_gin[wo][0], source['params']['decoder']['layers_1']['mlp']['wo'][
      'kernel'])   # not copies: Drop redrew units
  capsys.readouterr()
  assert _main(source, tmp_path / 'both', '--gin_file=upcycling/drop.gin', '--experts', 'copy') == 1
  assert capsys.readouterr().err.strip() == (
      "error: --experts=copy and the gin binding modes.Upcycle.experts = "
      "Drop(ratio=0.5, index_sharing='shared') disagree. Fix: give one of them.")
  assert sorted(os.listdir(tmp_path)) == ['flag', 'gin']


def test_branch_train_mix_converts_from_several_sources(source, tmp_path, capsys):
  """upcycling/btx.gin with --source given twice: every expert the MLP of the source its
  assignment names, every other leaf the two sources' mean (against the arrays written);
  several sources with a one-source initializer stop in one line."""
  other_params = helpers.random_params(helpers.CHECKPOINT_T5, seed=5)
  other = t5x_writer.write(str(tmp_path / 'branch_b'), 6, other_params)
  out = tmp_path / 'btx'
  assert _main(source, out, '--source', other, '--gin_file=upcycling/btx.gin',
               '--gin.sources.FromCheckpoints.assignment=[1, 0, 0, 1]') == 0
  moe = tree.flatten(checkpoints.load(str(out)).params)
  a, b = tree.flatten(source['params']), tree.flatten(other_params)
  assert checkpoints.load(str(out)).step == 6
  for layer in ('encoder/layers_1', 'decoder/layers_1'):
    for name in ('wi_0/kernel', 'wi_1/kernel', 'wo/kernel'):
      dense = f'{layer}/mlp/{name}'
      want = np.stack([b[dense], a[dense], a[dense], b[dense]])
      np.testing.assert_array_equal(moe[f'{layer}/mlp/expert/{name}'], want)
  for path in ('token_embedder/embedding', 'encoder/layers_0/mlp/wi_0/kernel',
               'decoder/layers_1/self_attention/query/kernel'):
    np.testing.assert_allclose(moe[path], (a[path] + b[path]) / 2, rtol=1e-6, atol=1e-7)
  capsys.readouterr()
  assert _main(source, tmp_path / 'two', '--source', other, '--experts', 'copy') == 1
  assert capsys.readouterr().err.strip() == (
      'error: --source is given 2 times, and the initializer Copy() makes experts from one '
      'checkpoint. Fix: give one --source, or an initializer that reads several '
      '(--gin_file=upcycling/btx.gin or upit.gin).')
  assert not (tmp_path / 'two').exists()


def test_dry_run_prints_the_report_and_writes_nothing(source, tmp_path, capsys):
  out = tmp_path / 'moe'
  assert _main(source, out, '--dry_run', '--router', 'zeros', '--step', 'reset') == 0
  text = capsys.readouterr().out
  assert f'(t5x, step 6) -> {out}/0' in text
  assert '6 expert leaves in 2 MoE blocks (experts 4; Copy()), 2 router leaves (Zeros())' in text
  assert 'Dry run: nothing written.' in text
  assert os.listdir(tmp_path) == []


def test_the_console_shows_the_summary_and_the_output_keeps_every_leaf(source, tmp_path,
                                                                        capsys):
  """The report a dry run prints (as every conversion printed it before) is the output's
  upcycling_report.txt; a conversion prints its summary and where the report is."""
  flags = ('--experts', DROP, '--seed', '3')
  out = tmp_path / 'moe'
  assert _main(source, out, '--dry_run', *flags) == 0
  lines = capsys.readouterr().out.splitlines()
  first = next(i for i, line in enumerate(lines) if 'target leaves: ' in line)
  printed = '\n'.join(lines[first:lines.index('Dry run: nothing written.')]) + '\n'
  assert _main(source, out, *flags) == 0
  report = (out / 'upcycling_report.txt').read_text()
  assert report == printed
  lines = capsys.readouterr().out.splitlines()
  assert report.splitlines()[0] in lines
  assert f'Full upcycling report (every leaf): {out}/upcycling_report.txt' in lines
  assert not [line for line in lines if line.startswith(('copied ', 'experts ', 'router '))]


def test_refuses_to_touch_the_source_or_an_existing_output(source, tmp_path, capsys):
  before = helpers.snapshot(source['dir'])
  for inside in (os.path.join(source['dir'], 'moe'), os.path.dirname(source['dir'])):
    assert _main(source, inside, '--overwrite') == 1
    assert 'lies inside the source' in capsys.readouterr().err
  assert helpers.snapshot(source['dir']) == before

  out = tmp_path / 'moe'
  out.mkdir()
  (out / 'notes.txt').write_text('mine')
  assert _main(source, out) == 1
  assert 'already exists and is not empty' in capsys.readouterr().err
  assert os.listdir(out) == ['notes.txt']
  assert _main(source, out, '--overwrite', '--step', '9') == 0
  assert sorted(os.listdir(out)) == ['9', 'config.gin', 'upcycling_report.txt']
  assert checkpoints.load(str(out)).step == 9
  assert sorted(os.listdir(tmp_path)) == ['moe']

  assert _main(source, tmp_path / 'other', '--experts', 'drop(0.5)') == 1
  assert "--experts='drop(0.5)': cannot parse it" in capsys.readouterr().err
  assert _main(source, tmp_path / 'other', '--experts', 'dropp') == 1
  assert "'dropp' is not one of" in capsys.readouterr().err


class _Killed(Exception):
  pass


def test_a_conversion_that_dies_leaves_no_checkpoint(source, tmp_path, monkeypatch):
  """Dies after the first MoE block: nothing at the output, leftovers not loadable."""
  blocks = []
  pop = stream.BlockValues.pop

  def dying_pop(self, path):
    if blocks and self is not blocks[0]:
      raise _Killed()
    blocks[:] = [self]
    return pop(self, path)

  monkeypatch.setattr(stream.BlockValues, 'pop', dying_pop)
  monkeypatch.setattr(shutil, 'rmtree', lambda *a, **k: None)  # As if killed.
  out = tmp_path / 'moe'
  with pytest.raises(Exception) as raised:
    convert.convert(source['dir'], CONFIG, str(out))
  assert isinstance(raised.value, _Killed) or '_Killed' in repr(raised.value)
  assert not out.exists()
  leftovers = os.listdir(tmp_path)
  assert len(leftovers) == 1 and leftovers[0].startswith('.moe.converting-')
  with pytest.raises(checkpoints.CheckpointError):
    checkpoints.load(str(tmp_path / leftovers[0]))


def test_target_comes_from_the_model_macro(source):
  gin.parse_config_files_and_bindings([source['gin']], [])
  assert convert.target_from_gin() == CONFIG
  gin.clear_config()
  with pytest.raises(convert.ConvertError, match='No gin macro MODEL'):
    convert.target_from_gin()


@pytest.mark.parametrize('umask, mode', [(0o022, 0o755), (0o027, 0o750)])
def test_the_output_directory_has_the_mode_the_umask_gives(source, tmp_path, umask, mode):
  before = os.umask(umask)
  try:
    assert _main(source, tmp_path / 'moe') == 0
  finally:
    os.umask(before)
  assert oct(os.stat(tmp_path / 'moe').st_mode & 0o777) == oct(mode)   # as training's, export's


def _killed_conversion(work_dir, lock):
  """A work directory and lock file as a conversion killed while writing leaves them."""
  os.makedirs(os.path.join(work_dir, '0'))
  code = ('import os, signal, sys; from upcycle.locks.file_lock import FileLock; '
          'FileLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)')
  killed = subprocess.run([sys.executable, '-c', code, lock], cwd=REPO)
  assert killed.returncode == -signal.SIGKILL
  return json.loads(open(lock).read())['pid']


def test_a_later_conversion_removes_what_killed_ones_left(source, tmp_path, capsys):
  lock = str(tmp_path / '.moe.converting.lock')
  unowned = tmp_path / '.moe.converting-unknown'   # not a work directory's name: left alone
  unowned.mkdir()
  with FileLock(lock):
    assert _main(source, tmp_path / 'moe') == 1
    assert (f'another conversion into {tmp_path}/moe is running: {lock} is locked by pid '
            f'{os.getpid()}' in capsys.readouterr().err)
  stale = str(tmp_path / '.moe.converting-1700000000-4242')
  pid = _killed_conversion(stale, lock)
  assert _main(source, tmp_path / 'moe') == 0
  printed = capsys.readouterr()
  assert f'Removed {stale}, left by a killed conversion (pid {pid} on host' in printed.out
  assert sorted(os.listdir(tmp_path)) == ['.moe.converting-unknown', 'moe']


@pytest.mark.slow
def test_gcs_output_equals_the_local_one_and_is_refused_and_cleaned_alike(
    source, tmp_path, gcs_emulator):
  env = {**os.environ, **gcs_emulator}   # the same XLA_FLAGS: initializers' values are exact
  done = subprocess.run([sys.executable, '-m', 'tests.convert_on_gcs', source['dir'],
                         source['gin'], str(tmp_path), DROP],
                        cwd=REPO, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.load(open(tmp_path / 'gcs.json'))
  runs = report['runs']
  assert [code for code, _ in runs[:4]] == [1, 1, 0, 0], runs
  assert ('error: another conversion into gs://bucket/moe is running: '
          f"gs://bucket/.moe.converting.lock is held by pid {report['pid']} on host") in runs[0][1]
  assert 'gs://bucket/moe already exists and is not empty' in runs[1][1]
  assert ('Taking over gs://bucket/.moe.converting.lock from pid 1 on host elsewhere, since then: '
          'its last heartbeat was') in runs[2][1]
  assert ('Removed gs://bucket/.moe.converting-1700000000-4242, left by a killed conversion.'
          in runs[2][1])
  assert 'Wrote gs://bucket/moe/6.' in runs[2][1]
  assert 'Wrote gs://bucket/moe_t5x/checkpoint_6.' in runs[3][1]
  assert runs[4:] == [['orbax', 6, 'gs://bucket/moe/6'],
                      ['t5x', 6, 'gs://bucket/moe_t5x/checkpoint_6']]
  assert 'upcycling_report.txt' in report['listing']['moe']
  assert 'config.gin' in report['listing']['moe']
  assert all(n.startswith('6/') for n in report['listing']['moe']
             if n not in ('upcycling_report.txt', 'config.gin'))
  assert report['listing']['hidden'] == [   # no work directory, no lock left
      'gs://bucket/.moe.converting-x.converting-1-2/6/_METADATA']

  remote = np.load(tmp_path / 'gcs.npz')
  for name, out, extra in (('orbax', 'moe', []), ('t5x', 'moe_t5x', ['--output_format', 't5x'])):
    assert _main(source, tmp_path / out, '--experts', DROP, '--seed', '3', *extra) == 0
    local = tree.flatten(checkpoints.load(str(tmp_path / out)).params)
    got = {k[len(name) + 1:]: remote[k] for k in remote.files if k.startswith(name + '/')}
    assert got.keys() == local.keys()
    for path, x in local.items():
      np.testing.assert_array_equal(got[path], np.asarray(x), err_msg=path)
      assert got[path].dtype == np.asarray(x).dtype, path
  msgpack = open(tmp_path / 'moe_t5x' / 'checkpoint_6' / 'checkpoint', 'rb').read()
  assert remote['t5x_msgpack'].tobytes() == msgpack


@pytest.mark.parametrize('drop', ['drop', 'drop(index_sharing="per_matrix")'],
                         ids=['paper', 'official-code'])
def test_a_sharded_hf_llama_converts_to_drop_upcycled_mixtral_experts(tmp_path, drop):
  """Drop-Upcycling offline from a sharded HF Llama: each expert is the dense MLP with half of
  its d_ff units redrawn from the mean and std of the values they replace; everything else is
  copied. As the paper writes it, one set of units shared by the gate, up and down
  projections; as the official code does it, a set drawn for each matrix."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.models import llama_hf  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(
          tmp_path / 'hf', max_shard_size='20KB')
  assert (tmp_path / 'hf' / 'model.safetensors.index.json').exists()
  dense, dense_config = pretrained.load_hf(str(tmp_path / 'hf'))
  config = dataclasses.replace(dense_config, moe=llama_hf.mixtral_moe(4, 2, 0.02))
  convert.convert(str(tmp_path / 'hf'), config, str(tmp_path / 'moe'),
                  experts=convert.parse_init(drop, experts.EXPERT_INITS, '--experts'),
                  router='uniform')
  moe = tree.flatten(pretrained.load(str(tmp_path / 'moe'), model_config=config).params)
  dense = tree.flatten(dense)
  for layer in range(2):
    mlp = f'decoder/layers_{layer}/mlp'
    gate, up, down = (moe[f'{mlp}/expert/{name}/kernel'] for name in ('wi_0', 'wi_1', 'wo'))
    for e in range(4):
      redrawn = [np.flatnonzero(np.any(gate[e] != dense[f'{mlp}/wi_0/kernel'], axis=0)),
                 np.flatnonzero(np.any(up[e] != dense[f'{mlp}/wi_1/kernel'], axis=0)),
                 np.flatnonzero(np.any(down[e] != dense[f'{mlp}/wo/kernel'], axis=1))]
      assert [len(r) for r in redrawn] == [24, 24, 24]
      shared = all(np.array_equal(r, redrawn[0]) for r in redrawn)
      assert shared == (drop == 'drop')
      new = np.asarray(up[e][:, redrawn[1]], np.float64)
      replaced = np.asarray(dense[f'{mlp}/wi_1/kernel'][:, redrawn[1]], np.float64)
      assert abs(new.mean() - replaced.mean()) < 0.2 * replaced.std()
      assert new.std() == pytest.approx(replaced.std(), rel=0.2)
    assert moe[f'{mlp}/router/router_weights/w/kernel'].std() == pytest.approx(0.02, rel=0.3)
  for path, leaf in dense.items():
    if '/mlp/' not in path:
      np.testing.assert_array_equal(moe[path], leaf, err_msg=path)


@pytest.fixture(scope='module')
def sharded_hf_llama(tmp_path_factory):
  """A dense HF Llama saved in several safetensors shards, and the config it reads into."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  directory = tmp_path_factory.mktemp('sharded_llama') / 'hf'
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8)).save_pretrained(
          directory, max_shard_size='20KB')
  dense, config = pretrained.load_hf(str(directory))
  return str(directory), tree.flatten(dense), config


@pytest.mark.parametrize('initializer, expert_d_ff', [
    ('copy', 48), ('noise', 48), ('random', 48), ('partial(copied=2)', 48),
    ('granular(granularity=2)', 24), ('zero_output(inner="copy")', 48)])
def test_every_single_source_initializer_converts_a_sharded_hf_llama(
    sharded_hf_llama, initializer, expert_d_ff, tmp_path):
  """The initializers besides Drop (above) from the same sharded HF Llama into Mixtral's
  block (with a shared expert for zero_output): experts of the expected shape, attention and
  embeddings copied bit for bit; copied experts are the dense MLP exactly; zero_output's
  shared expert is the dense MLP and its experts output nothing."""
  from upcycle import pretrained  # pylint: disable=g-import-not-at-top
  from upcycle.models import llama_hf  # pylint: disable=g-import-not-at-top
  source, dense, dense_config = sharded_hf_llama
  moe = llama_hf.mixtral_moe(4, 2, 0.02)
  shared = initializer.startswith('zero_output')
  config = dataclasses.replace(dense_config, d_ff=expert_d_ff,
                               moe=dataclasses.replace(moe, shared_expert=shared))
  convert.convert(source, config, str(tmp_path / 'moe'),
                  experts=convert.parse_init(initializer, experts.EXPERT_INITS, '--experts'),
                  router='uniform')
  moe = tree.flatten(pretrained.load(str(tmp_path / 'moe'), model_config=config).params)
  gate = moe['decoder/layers_1/mlp/expert/wi_0/kernel']
  assert gate.shape == (4, 32, expert_d_ff)
  for path, leaf in dense.items():
    if '/mlp/' not in path:
      np.testing.assert_array_equal(moe[path], leaf, err_msg=path)
  copied = {'copy': 4, 'partial(copied=2)': 2, 'zero_output(inner="copy")': 4}.get(
      initializer, 0)
  for e in range(copied):
    np.testing.assert_array_equal(gate[e], dense['decoder/layers_1/mlp/wi_0/kernel'])
  if shared:
    for name in ('wi_0', 'wi_1', 'wo'):
      np.testing.assert_array_equal(moe[f'decoder/layers_1/mlp/shared_expert/{name}/kernel'],
                                    dense[f'decoder/layers_1/mlp/{name}/kernel'])
    assert not np.any(moe['decoder/layers_1/mlp/expert/wo/kernel'])
  if initializer in ('noise', 'random'):
    assert not np.array_equal(gate[0], dense['decoder/layers_1/mlp/wi_0/kernel'])



def test_a_llama_step_whose_tokenizer_was_replaced_is_refused(tmp_path):
  """The step's data position records the digest of the tokenizer it was trained with (the
  offline BPE): the run's tokenizer/ replaced by another (two ids swapped) is refused in one
  line, nothing written, instead of being kept beside the MoE; the right one is kept."""
  from tests.helpers import save_swapped_tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from upcycle.data.lm import LmPipeline  # pylint: disable=g-import-not-at-top
  from upcycle.models import LlamaConfig, llama_hf  # pylint: disable=g-import-not-at-top
  from upcycle.train import host_data, host_states  # pylint: disable=g-import-not-at-top
  dense = LlamaConfig(vocab_size=4096, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      d_ff=256, num_layers=2, layer_norm_epsilon=1e-5)
  position = host_states.gather(host_data.HostData(
      LmPipeline('offline_stdlib_text', 'train', {'targets': 16}), global_batch_size=2,
      seed=0).get_state())
  run = tmp_path / 'run'
  with orbax.CheckpointManager(str(run / 'checkpoints'), async_save=False) as manager:
    manager.save(2, helpers.random_params(dense), dataset_state=position)
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  kept = save_swapped_tokenizer(offline, str(run / tokenizer_lib.RUN_SUBDIR))
  step, out = str(run / 'checkpoints' / '2'), tmp_path / 'moe'
  moe_config = dataclasses.replace(dense, moe=llama_hf.mixtral_moe(4, 2, 0.02))
  with pytest.raises(convert.ConvertError) as refused:
    convert.convert(step, moe_config, str(out))
  assert str(refused.value) == (
      f'convert reads {kept} (tokenizer digest {tokenizer_lib.load(kept).short_digest}), but '
      f'the weights of {step} were trained with tokenizer {offline.short_digest} (the data '
      f"position saved in {step}/dataset): they would read another tokenizer's ids. Fix: put "
      f'the tokenizer {step} was trained with in {kept}.')
  assert not out.exists()
  offline.save(kept)
  convert.convert(step, moe_config, str(out))
  assert tokenizer_lib.load(str(out)).files['tokenizer.json'] == offline.files['tokenizer.json']


def test_a_non_finite_source_weight_is_refused_in_one_line(tmp_path, capsys, caplog):
  """An Inf written (by the safetensors library) into an HF Llama's embedding: the streamed
  write stops on it with one line naming the tensor and file, no traceback logged by orbax's
  writer thread, and no output left."""
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  source = str(tmp_path / 'llama')
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
      tie_word_embeddings=False)).save_pretrained(source)   # models/llama/tiny.gin's
  weights = os.path.join(source, 'model.safetensors')
  tensors = load_file(weights)
  tensors['model.embed_tokens.weight'][5, 3] = np.inf
  save_file(tensors, weights, metadata={'format': 'pt'})
  out = tmp_path / 'moe'
  assert convert.main(['--source', source, '--gin_file=models/llama/tiny.gin',
                       '--gin_file=moe/mixtral.gin', '--gin.models.LlamaConfig.num_layers=2',
                       '--output_dir', str(out)]) == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"error: {weights}: parameter 'model.embed_tokens.weight': the tensor holds values that "
      'are not finite. Expected finite values, found 0 NaN and 1 Inf among those read. The '
      'file is damaged: re-download or re-export it.')
  assert not [r for r in caplog.records if r.exc_info]
  assert not out.exists()
