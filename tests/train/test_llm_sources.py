"""Several sharded HF Llama directories upcycled into one Mixtral, in the restore hook and by
`upcycle.convert`: Branch-Train-MiX (each expert one branch's MLP, everything else the
branches' mean) and UpIT's expansion (the sources' MLPs, then DARE merges around the base
model), compared with the safetensors files read directly."""

import dataclasses
import functools
import json
import os
import shutil

import glob
import itertools

import numpy as np
import pytest

from tests import hf_files
from upcycle import convert, partitioning, pretrained
from upcycle.models import Llama, LlamaConfig, llama_hf
from upcycle.train import objectives, optimizers
from upcycle.train.built_run import build_run
from upcycle.restore import Restore
from upcycle.train.trainer import TrainConfig
from upcycle.upcycling import modes, sources

E = 4


@pytest.fixture(scope='module')
def branches(tmp_path_factory):
  """A base Llama and two branches of it (its weights perturbed two ways), as HF directories
  of several safetensors shards; the Mixtral config, its trainer on 8 devices and its
  abstract state."""
  import transformers  # pylint: disable=g-import-not-at-top
  build = lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=4, tie_word_embeddings=False))
  root = tmp_path_factory.mktemp('branches')
  dirs = {name: str(root / name) for name in ('base', 'a', 'b')}
  for seed, name in enumerate(dirs, 1):
    hf_files.save_perturbed(build, dirs[name], seed=seed, max_shard_size='8KB')
    assert len(glob.glob(os.path.join(dirs[name], '*.safetensors'))) > 1
  dense = LlamaConfig.from_hf_config(json.load(open(os.path.join(dirs['a'], 'config.json'))))
  config = dataclasses.replace(dense, moe=llama_hf.mixtral_moe(E, 2, 0.02))
  train_config = TrainConfig(model_dir='unused', train_steps=1, batch_size=8,
                             num_expert_partitions=2)
  optimizer = optimizers.AdamW(optimizers.warmup_decay_schedule(1e-3, 1, 4))
  batch = {key: np.zeros((8, 8), np.int32) for key in (
      'decoder_input_tokens', 'decoder_target_tokens', 'decoder_loss_weights',
      'decoder_segment_ids', 'decoder_positions')}
  built = build_run(objective=objectives.CausalLm(Llama(config)), optimizer=optimizer,
                    config=train_config, host_batch=batch)
  return dirs, config, built, built.abstract


def _safetensors(directory):
  """{HF name: array} of every shard of `directory`."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  out = {}
  for shard in glob.glob(os.path.join(directory, '*.safetensors')):
    out.update(load_file(shard))
  return out


def _upcycled(branches, via, tmp_path, **hook_args):
  """The Mixtral params made from branches a and b by the restore hook or by convert."""
  dirs, config, built, abstract = branches
  sources = [dirs['a'], dirs['b']]
  if via == 'hook':
    with partitioning.activate(built.mesh):
      return Restore(sources, modes.Upcycle(**hook_args))(abstract, built.optimizer).params
  convert.convert(sources, config, str(tmp_path / 'moe'), **hook_args)
  return pretrained.load(str(tmp_path / 'moe'), model_config=config).params


# Our MLP kernels -> HF's projections (ours are their weights transposed).
MLP = {'wi_0': 'gate_proj', 'wi_1': 'up_proj', 'wo': 'down_proj'}


@pytest.mark.slow
@pytest.mark.parametrize('via', ['hook', 'convert'])
def test_branch_train_mix_from_hf_llamas(branches, via, tmp_path):
  dirs = branches[0]
  params = _upcycled(branches, via, tmp_path, router='uniform', experts=functools.partial(
      sources.FromCheckpoints, assignment=(0, 1, 1, 0)))
  a, b = _safetensors(dirs['a']), _safetensors(dirs['b'])
  for layer in range(2):
    moe = params['decoder'][f'layers_{layer}']['mlp']
    for ours, theirs in MLP.items():
      name = f'model.layers.{layer}.mlp.{theirs}.weight'
      want = np.stack([a[name].T, b[name].T, b[name].T, a[name].T])
      np.testing.assert_array_equal(np.asarray(moe['expert'][ours]['kernel']), want)
    query = params['decoder'][f'layers_{layer}']['self_attention']['query']['kernel']
    name = f'model.layers.{layer}.self_attn.q_proj.weight'
    np.testing.assert_allclose(np.asarray(query).reshape(16, -1),
                               ((a[name] + b[name]) / 2).T, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(params['token_embedder']['embedding']),
                             (a['model.embed_tokens.weight'] + b['model.embed_tokens.weight']) / 2,
                             rtol=1e-6, atol=1e-7)


def _merged_pair(merged, deltas):
  """The pair (i, j) of which `merged` (minus the base) is the DARE merge at p = 0.5: each
  entry 0, deltas[i], deltas[j] or their sum (kept / 0.5, averaged); None if no pair fits."""
  for i, j in itertools.combinations(range(len(deltas)), 2):
    candidates = np.stack([np.zeros_like(merged), deltas[i], deltas[j], deltas[i] + deltas[j]])
    if np.all(np.min(np.abs(merged[None] - candidates), axis=0) <= 1e-5):
      return i, j
  return None


@pytest.mark.slow
@pytest.mark.parametrize('via, pair_scope', [('hook', 'layer'), ('convert', 'layer'),
                                             ('hook', 'model'), ('convert', 'model')])
def test_upit_expansion_from_hf_llamas_merges_around_the_base(branches, via, pair_scope,
                                                               tmp_path):
  """Expert 2 is the one pair's merge; with pair_scope='model' expert 3 merges one pair in
  both layers (the plan gives the initializer every layer and the key, in both executors)."""
  dirs = branches[0]
  params = _upcycled(branches, via, tmp_path, router='uniform', experts=functools.partial(
      sources.Merge, method='dare', drop_rate=0.5, dare_base=dirs['base'],
      pair_scope=pair_scope))
  a, b, base = (_safetensors(dirs[name]) for name in ('a', 'b', 'base'))
  name = 'model.layers.1.mlp.gate_proj.weight'
  kernel = np.asarray(params['decoder']['layers_1']['mlp']['expert']['wi_0']['kernel'])
  np.testing.assert_array_equal(kernel[0], a[name].T)
  np.testing.assert_array_equal(kernel[1], b[name].T)
  # Expert 2 is DARE of a and b around the base: each delta entry kept (times 1 / (1 - 0.5))
  # or dropped, the two averaged, so every entry is one of four values.
  da, db, merged = (a[name] - base[name]).T, (b[name] - base[name]).T, kernel[2] - base[name].T
  candidates = np.stack([np.zeros_like(da), da, db, da + db])   # (kept / 0.5) / 2 each
  assert np.all(np.min(np.abs(merged[None] - candidates), axis=0) <= 1e-5)
  kept_a = np.isclose(merged, da, atol=1e-5) | np.isclose(merged, da + db, atol=1e-5)
  assert 0.35 < kept_a.mean() < 0.65            # about half of a's delta kept
  pairs = set()
  for layer in range(2):
    name = f'model.layers.{layer}.mlp.gate_proj.weight'
    kernel = np.asarray(params['decoder'][f'layers_{layer}']['mlp']['expert']['wi_0']['kernel'])
    deltas = kernel - base[name].T
    pairs.add(_merged_pair(deltas[3], deltas[:3]))
  assert None not in pairs and (pair_scope == 'layer' or len(pairs) == 1), pairs


def test_each_merged_source_is_checked_against_the_runs_tokenizer(tmp_path):
  """Branch-Train-MiX with TOKENIZER given: a source whose own tokenizer files are another
  tokenizer (two ids swapped) is refused in one line; the one that carries it passes."""
  from tests.helpers import save_swapped_tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  a, b = str(tmp_path / 'a'), save_swapped_tokenizer(offline, str(tmp_path / 'b'))
  offline.save(a)
  Restore([a], modes.Upcycle(experts=sources.FromCheckpoints), format='hf').check_tokenizer(
      offline, 'TOKENIZER')
  with pytest.raises(tokenizer_lib.TokenizerError) as refused:
    Restore([a, b], modes.Upcycle(experts=sources.FromCheckpoints), format='hf').check_tokenizer(
        offline, 'TOKENIZER')
  assert str(refused.value) == (
      f'TOKENIZER reads offline_stdlib_bpe (tokenizer digest {offline.short_digest}), but the '
      f'weights of {b} were trained with tokenizer {tokenizer_lib.load(b).short_digest} (the '
      f"tokenizer files in {b}): they would read another tokenizer's ids. Fix: TOKENIZER = "
      f"'{b}', the checkpoint's own (runs/llm_continue.gin's and runs/llm_upcycle.gin's "
      'default); merged checkpoints must share one.')


def test_convert_keeps_the_tokenizer_merged_sources_share_and_refuses_two(branches, tmp_path):
  """Branch-Train-MiX by convert: sources carrying one tokenizer give the output that one; a
  source carrying another (two ids swapped) is refused in one line naming --source, before
  anything is written."""
  from tests.helpers import save_swapped_tokenizer  # pylint: disable=g-import-not-at-top
  from upcycle.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  dirs, config = branches[:2]
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  a, b, swapped = (str(tmp_path / name) for name in ('a', 'b', 'swapped'))
  for name, copy in ((dirs['a'], a), (dirs['b'], b), (dirs['b'], swapped)):
    shutil.copytree(name, copy)
  offline.save(a)
  offline.save(b)
  save_swapped_tokenizer(offline, swapped)
  experts = functools.partial(sources.FromCheckpoints, assignment=(0, 1, 1, 0))
  convert.convert([a, b], config, str(tmp_path / 'moe'), experts=experts)
  kept = tokenizer_lib.load(str(tmp_path / 'moe'))
  assert kept.files['tokenizer.json'] == offline.files['tokenizer.json']   # byte for byte
  with pytest.raises(convert.ConvertError) as refused:
    convert.convert([a, swapped], config, str(tmp_path / 'refused'), experts=experts)
  assert str(refused.value) == (
      f'--source: {swapped} carries another tokenizer ({swapped}, digest '
      f'{tokenizer_lib.load(swapped).short_digest}) than {a} ({a}, digest '
      f'{offline.short_digest}): their embeddings index different pieces and cannot be merged. '
      'Fix: give checkpoints trained with one tokenizer.')
  assert not (tmp_path / 'refused').exists()


@pytest.mark.parametrize('field, value', [('rope_theta', 500000.0),
                                          ('layer_norm_epsilon', 1e-5)])
def test_a_model_file_that_disagrees_with_config_json_is_refused_before_any_read(
    branches, tmp_path, field, value):
  """Shapes agree, the function does not: a hand-written model gin with another RoPE base or
  norm epsilon than the checkpoint's config.json is refused by the restore hook, convert and
  every reader given the model (eval, infer), naming the binding and both values."""
  dirs, config, built, abstract = branches
  wrong = dataclasses.replace(config, **{field: value})
  theirs = getattr(config, field)
  message = (f"^models.LlamaConfig.{field} = {value!r}, but the checkpoint's "
             f"{os.path.join(dirs['a'], 'config.json')} says {theirs!r}: the model would compute "
             f'another function of the same weights. Fix: bind it as the checkpoint has it '
             fr'\({theirs!r}\), or use the model file made for that checkpoint.$')
  with pytest.raises(ValueError, match=message):
    with partitioning.activate(built.mesh):
      Restore(dirs['a'], modes.Upcycle()).lower(abstract, built.optimizer, wrong)
  with pytest.raises(ValueError, match=message):
    convert.convert(dirs['a'], wrong, str(tmp_path / 'moe'))
  assert not (tmp_path / 'moe').exists()
  with pytest.raises(ValueError, match=message):
    pretrained.load(dirs['a'], model_config=dataclasses.replace(wrong, moe=None), lazy=True)
  assert pretrained.load(dirs['a'], model_config=dataclasses.replace(config, moe=None),
                         lazy=True).format == 'hf'
