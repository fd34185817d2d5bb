"""Every gin file under configs/ parses (typos in bindings fail) and builds its model."""

import glob
import os

import gin
import jax
import numpy as np
import pytest

from upcycle import gin_utils
from upcycle.models import families
from upcycle.moe import balance, capacity, grouping, routers
from upcycle.study import drop_runs
from upcycle.train import objectives

CONFIGS = gin_utils.CONFIGS_DIR
FILES = sorted(os.path.relpath(p, CONFIGS)
               for p in glob.glob(os.path.join(CONFIGS, '**', '*.gin'), recursive=True))
# models/hf.gin's directory: a config.json transformers' LlamaConfig(...).save_pretrained wrote
# (vocab 256, hidden 32, 2 layers, 4 heads over 2 of 8, d_ff 64, context 256).
HF_CONFIG = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf_llama_config')
MACROS = ["MODEL_DIR = '/tmp/unused'", 'TRAIN_STEPS = 10', "INITIAL_CHECKPOINT_PATH = '/tmp/x'",
          "CHECKPOINT_PATH = '/tmp/x'", f"HF_MODEL = '{HF_CONFIG}'"]


def context(name):
  """The files a user would give before `name` on the command line."""
  vit = 'vit' in name or 'digits' in name
  llm = 'llama' in name or 'llm' in name or 'mixtral' in name or name.endswith('_lm.gin')
  model = ('models/vit/tiny.gin' if vit else 'models/llama/tiny.gin' if llm
           else 'models/t5_1_1/tiny.gin')
  run = ('runs/vit_pretrain.gin' if vit else 'runs/llm_pretrain.gin' if llm
         else 'runs/pretrain.gin')
  if name.endswith('/pod.gin'):      # pod defaults, included by the published sizes
    return [model, name]
  if name.startswith('models/'):
    return [name]
  if name == run:
    return [model, name, 'data/offline_stdlib_lm.gin']
  if name.startswith('runs/'):
    return [model, name]
  if name.startswith(('upcycling/', 'experiments/')):
    moe = [] if vit else ['moe/paper_t5.gin']
    return [model] + moe + [run.replace('pretrain', 'upcycle'), name]
  return [model, run, name]


def parse(files, bindings):
  gin_utils.parse_files_and_bindings(files, bindings, finalize=False)


@gin.configurable
def probe(model=gin.REQUIRED):
  return model


pytestmark = pytest.mark.usefixtures('entry_points')


def test_all_config_groups_are_present():
  for expected in ['models/t5_1_1/base.gin', 'models/t5_1_1/xl.gin', 'models/vit/b16.gin',
                   'models/vit/l32.gin', 'moe/experts_choose.gin', 'moe/tokens_choose_top2.gin',
                   'moe/switch.gin', 'upcycling/drop.gin', 'upcycling/btx.gin',
                   'upcycling/upit.gin', 'runs/pretrain.gin', 'runs/upcycle.gin',
                   'runs/continue_dense.gin', 'runs/finetune.gin', 'runs/eval.gin',
                   'runs/infer.gin']:
    assert expected in FILES


@pytest.mark.slow
@pytest.mark.parametrize('name', FILES)
def test_config_parses_and_builds_its_model(name):
  parse(context(name), MACROS + ['probe.model = %MODEL'])
  model = probe()
  family = families.of(model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *family.example_inputs(model.config))
  assert jax.tree.leaves(shapes)
  # The objective the model's architecture.gin binds is the one its family registers.
  objective = gin.query_parameter('OBJECTIVE/gin.macro.value')
  assert objective.configurable.wrapped is objectives.OBJECTIVES[family.objective]


def test_mixtral_gin_is_the_block_a_mixtral_config_json_reads_into():
  """moe/mixtral.gin and `llama_hf.mixtral_moe` (what MixtralForCausalLM's config.json reads
  into, tests/checkpoints/test_hf_mixtral.py) are one MoE block (over a published Llama: the
  tiny one binds its own router init)."""
  from upcycle.models import llama_hf  # pylint: disable=g-import-not-at-top
  parse(['models/llama/llama3_2_1b.gin', 'moe/mixtral.gin'], ['probe.model = %MODEL'])
  assert probe().config.moe == llama_hf.mixtral_moe(8, 2, 0.02)


def test_the_load_balancing_ablations_bind_their_objects():
  """experiments/load_balancing_pooled_batch.gin pools both T5 stacks' statistics over the
  batch at paper_t5.gin's weight; the drop suite's per-layer ablation (`drop_runs.LAYERWISE`)
  keeps moe/mixtral.gin's weight and scope, a loss per layer."""
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin',
         'experiments/load_balancing_pooled_batch.gin'], ['probe.model = %MODEL'])
  cfg = probe().config
  pooled = balance.PooledSwitch(weight=0.01, scope='batch')
  assert cfg.encoder_moe.balance == cfg.decoder_moe.balance == pooled
  gin.clear_config()
  parse(['models/llama/tiny.gin', 'moe/mixtral.gin', drop_runs.LAYERWISE],
        ['probe.model = %MODEL'])
  assert probe().config.moe.balance == balance.Switch(weight=0.02, scope='batch')


def test_published_sizes():
  parse(['models/t5_1_1/xl.gin'], ['probe.model = %MODEL'])
  cfg = probe().config
  assert (cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_encoder_layers, cfg.vocab_size) == (
      2048, 5120, 32, 24, 32128)


def test_paper_default_moe():
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin'], ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.encoder_moe.router == routers.ExpertsChoose() and cfg.encoder_moe.num_experts == 32
  assert cfg.encoder_moe.train_capacity_factor == 2.0
  assert cfg.decoder_moe.router == routers.TopK(k=2, batch_priority=False)
  for moe in (cfg.encoder_moe, cfg.decoder_moe):   # T5X's conventions in both stacks
    assert moe.capacity_convention == capacity.T5X(minimum=4)
    assert moe.grouping == grouping.Flaxformer(max_group_size=4096, num_expert_replicas=1)
    assert moe.balance == balance.Switch(weight=0.01, scope='group')
  assert cfg.sparse_layers('encoder') == (1, 3, 5, 7, 9, 11)
  # The dispatch of the lowest roofline time at the paper's groups of 4096 (pod.gin); the CPU
  # recipe keeps the masked one.
  assert (cfg.encoder_moe.dispatch, cfg.decoder_moe.dispatch) == ('indices', 'masked')
  assert cfg.encoder_moe.router_init == cfg.decoder_moe.router_init == 'constant'
  gin.clear_config()
  parse(['models/t5_1_1/tiny.gin', 'moe/paper_t5.gin'], ['probe.model = %MODEL'])
  tiny = probe().config
  assert (tiny.encoder_moe.dispatch, tiny.decoder_moe.dispatch) == ('masked', 'masked')
  # The tiny width draws its routers at T5 Base's logit scale, 0.02 * sqrt(768 / 64).
  for moe in (tiny.encoder_moe, tiny.decoder_moe):
    assert moe.router_init == 'width_scaled'
    np.testing.assert_allclose(moe.router_std(tiny.d_model), 0.02 * np.sqrt(12), rtol=1e-12)


@pytest.mark.parametrize('model,router_init', [('models/llama/tiny.gin', 'width_scaled'),
                                               ('models/llama/llama3_2_1b.gin', 'constant')])
def test_a_llama_moe_router_init_is_the_width_scaled_one_only_at_the_tiny_width(model,
                                                                                 router_init):
  parse([model, 'moe/mixtral.gin'], ['probe.model = %MODEL'])
  assert probe().config.moe.router_init == router_init


def test_router_ablations_bind_each_stack_its_own_router():
  """A router is bound per stack through gin's scopes: the encoder's Top-2 with BPR of
  router_top2_encoder.gin leaves the paper's decoder Top-2 without it; switch.gin gives both
  stacks Top-1."""
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin', 'experiments/router_top2_encoder.gin'],
        ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.encoder_moe.router == routers.TopK(k=2, batch_priority=True)
  assert cfg.decoder_moe.router == routers.TopK(k=2, batch_priority=False)
  assert cfg.encoder_moe.capacity(4096, deterministic=False) == 160   # t5x: 1.25 * 4096 / 32
  gin.clear_config()
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin', 'experiments/router_switch.gin'],
        ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.encoder_moe.router == cfg.decoder_moe.router == routers.TopK(k=1)


def test_placement_ablations_place_the_moe_blocks_of_every_stack():
  """experiments/moe_last_2_layers.gin over the paper's T5 and ViT files puts MoE in the last
  two blocks of each stack (T5 Base: 12 + 12 layers, ViT-B/16: 12) and keeps the routing;
  moe/mixtral.gin over a Llama puts it in every layer."""
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin', 'experiments/moe_last_2_layers.gin'],
        ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.sparse_layers('encoder') == cfg.sparse_layers('decoder') == (10, 11)
  assert cfg.encoder_moe.router == routers.ExpertsChoose()
  gin.clear_config()
  parse(['models/vit/b16.gin', 'moe/paper_vit.gin', 'experiments/moe_last_2_layers.gin'],
        ['probe.model = %MODEL'])
  assert probe().config.sparse_layers() == (10, 11)
  gin.clear_config()
  parse(['models/llama/drop_upcycling_152m.gin', 'moe/mixtral.gin'], ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.sparse_layers() == tuple(range(cfg.num_layers)) and len(cfg.sparse_layers()) > 1


def test_shared_expert_gin_adds_one_to_every_moe_stack():
  parse(['models/t5_1_1/base.gin', 'moe/paper_t5.gin', 'moe/shared_expert.gin',
         'upcycling/zero_output.gin'], MACROS[:1] + ['probe.model = %MODEL'])
  cfg = probe().config
  assert cfg.encoder_moe.shared_d_ff(cfg.d_ff) == cfg.decoder_moe.shared_d_ff(cfg.d_ff) == 2048
  assert cfg.encoder_moe.router == routers.ExpertsChoose()   # the moe/ file's settings kept


def test_a_typo_in_a_binding_is_an_error_that_names_it():
  with pytest.raises(ValueError, match='d_modle'):
    parse(['models/t5_1_1/tiny.gin'], ['models.T5Config.d_modle = 3'])


INCLUDING = [name for name in FILES
             if 'include ' in open(os.path.join(CONFIGS, name)).read()]
GROUP_FOLDERS = ('runs', 'data', 'models', 'moe', 'upcycling', 'experiments')


def _empty_group_folders(root):
  for folder in GROUP_FOLDERS:
    (root / folder).mkdir()


def _real_run_outputs(root):
  run = root / 'runs' / 'quickstart' / 'dense'
  (run / 'checkpoints' / '100').mkdir(parents=True)
  (run / 'metrics.jsonl').write_text('{"step": 1, "split": "train", "loss": 3.0}\n')
  (run / 'config.gin').write_text("MODEL_DIR = 'runs/quickstart/dense'\n")


@pytest.mark.parametrize('layout', [_empty_group_folders, _real_run_outputs])
def test_includes_do_not_depend_on_the_working_directory(layout, tmp_path, monkeypatch):
  layout(tmp_path)
  monkeypatch.chdir(tmp_path)
  assert len(INCLUDING) > 20
  for name in INCLUDING:
    gin.clear_config(clear_constants=True)
    parse(context(name), MACROS + ['probe.model = %MODEL'])
    assert families.of(probe()), name


def test_a_missing_gin_file_names_the_search_paths(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(IOError, match=r"'models/t5_1_1/tinny.gin' not found in the search paths"):
    parse(['models/t5_1_1/tinny.gin'], [])


def test_search_paths_come_first_then_configs_then_the_working_directory(tmp_path, monkeypatch):
  mine = tmp_path / 'mine' / 'models' / 't5_1_1'
  mine.mkdir(parents=True)
  (mine / 'architecture.gin').write_text(
      open(os.path.join(CONFIGS, 'models/t5_1_1/architecture.gin')).read().replace(
          'DROPOUT_RATE = 0.0', 'DROPOUT_RATE = 0.25'))
  (tmp_path / 'own.gin').write_text('models.T5Config.d_kv = 5\n')
  monkeypatch.chdir(tmp_path)
  gin_utils.parse_files_and_bindings(['models/t5_1_1/tiny.gin', 'own.gin'],
                                     ['probe.model = %MODEL'], [str(tmp_path / 'mine')],
                                     finalize=False)
  assert (probe().config.dropout_rate, probe().config.d_kv) == (0.25, 5)


@pytest.mark.parametrize('name, count', [
    ('llama3_2_1b', 1_235_814_400),        # meta-llama/Llama-3.2-1B (tied embedding)
    ('llama3_1_8b', 8_030_261_248),        # meta-llama/Llama-3.1-8B
    ('mistral_7b', 7_248_023_552),         # mistralai/Mistral-7B-v0.3
    # Drop-Upcycling's "152M": 2 x 99584 x 512 (untied) + 12 x (4 x 512^2 + 3 x 512 x 2048
    # + 2 x 512) + 512
    ('drop_upcycling_152m', 152_318_464),
])
def test_published_llama_sizes_have_their_parameter_counts(name, count):
  from upcycle.models.families import abstract_params  # pylint: disable=g-import-not-at-top
  parse([f'models/llama/{name}.gin'], ['probe.model = %MODEL'])
  shapes = jax.tree.leaves(abstract_params(probe().config))
  assert sum(int(np.prod(s.shape)) for s in shapes) == count


@pytest.mark.parametrize('run, data, tokenizer', [
    ('runs/llm_pretrain.gin', 'data/offline_stdlib_lm.gin', 'offline_stdlib_bpe'),
    ('runs/llm_pretrain.gin', 'data/offline_packages_lm.gin', 'offline_packages_bpe'),
    ('runs/llm_continue.gin', 'data/offline_stdlib_lm.gin', '/ckpt/llama'),   # the checkpoint's own
    ('runs/llm_continue.gin', 'data/offline_packages_lm.gin', '/ckpt/llama'),
    ('runs/llm_upcycle.gin', 'data/offline_stdlib_lm.gin', '/ckpt/llama'),
    ('runs/llm_upcycle.gin', 'data/offline_packages_lm.gin', '/ckpt/llama'),
])
def test_a_decoder_only_run_reads_the_tokenizer_of_its_initial_checkpoint(run, data, tokenizer):
  """From scratch: the offline BPE of the data file's corpus; continuing or upcycling: the
  checkpoint's own."""
  parse(['models/llama/tiny.gin', run, data],
        MACROS[:2] + ["INITIAL_CHECKPOINT_PATH = '/ckpt/llama'",
                      'probe.model = @train/lm.LmPipeline()'])
  assert probe().tokenizer == tokenizer


@pytest.mark.parametrize('model, run', [('models/t5_1_1/tiny.gin', 'runs/upcycle.gin'),
                                        ('models/vit/tiny.gin', 'runs/vit_upcycle.gin'),
                                        ('models/llama/tiny.gin', 'runs/llm_upcycle.gin')])
def test_convert_upcycles_with_the_router_of_its_familys_recipe(model, run):
  """`python -m upcycle.convert`'s default router is the family's upcycling recipe's."""
  from upcycle.models import families  # pylint: disable=g-import-not-at-top
  parse([model, run], MACROS + ['probe.model = %MODEL'])
  assert gin.query_parameter('upcycle.upcycling.modes.Upcycle.router') == (
      families.of(probe()).upcycle_router)



def test_the_main_jobs_moe_recipe_is_one_file_with_width_scaled_routers():
  """runs/upcycle_main_job.gin, the quickstart's MoE stage and the study's main-job recipe:
  the paper's T5 routing, normalized combine weights, the dense optimizer state reused, and
  Sparse Upcycling's N(0, 0.02^2) router scaled to the tiny T5's width 64,
  0.02 * sqrt(768 / 64) = 0.069282."""
  from upcycle import router_scale  # pylint: disable=g-import-not-at-top
  from upcycle.study import runs  # pylint: disable=g-import-not-at-top
  assert runs.MAIN_JOB_MOE == ('runs/upcycle_main_job.gin',)
  parse(['models/t5_1_1/tiny.gin', *runs.MAIN_JOB_MOE], MACROS + ['probe.model = %MODEL'])
  std = gin.query_parameter('ROUTER_STD/gin.macro.value')
  assert gin.query_parameter('upcycle.upcycling.modes.Upcycle.router').selector.endswith(
      'router_init.Normal')
  assert std == 'width_scaled' and probe().config.d_model == 64
  assert router_scale.router_init_std(std, 64) == pytest.approx(0.069282, abs=1e-6)
  assert gin.query_parameter('restore.Restore.reuse_optimizer_state') is True
  for stack in ('encoder', 'decoder'):
    assert gin.query_parameter(f'{stack}/moe.MoeConfig.normalize_combine_weights') is True
  assert gin.query_parameter('encoder/moe.MoeConfig.router_z_loss_weight') == 0.0
  assert gin.query_parameter('GROUP_SIZE/gin.macro.value') == 4096


def test_an_sft_data_file_gives_the_run_sft_pipelines_and_the_router_stage_unpacks_them():
  sft_run = ['models/llama/tiny.gin', 'runs/llm_sft.gin', 'data/offline_sft.gin']
  parse(sft_run, MACROS[:2] + ["INITIAL_CHECKPOINT_PATH = '/ckpt/llama'",
                               'probe.model = @train/sft.SftPipeline()'])
  pipeline = probe()
  assert (pipeline.task, pipeline.tokenizer, pipeline.template, pipeline.pack) == (
      'offline_stdlib_sft', '/ckpt/llama', 'plain', True)
  gin.clear_config()
  parse(['models/llama/tiny.gin', 'moe/mixtral.gin', 'runs/llm_upcycle.gin',
         'data/offline_sft.gin', 'upcycling/upit.gin', 'runs/upit_router_stage.gin'],
        MACROS[:2] + ["INITIAL_CHECKPOINT_PATH = ['/ckpt/sft/1', '/ckpt/sft/2']",
                      'probe.model = @train/sft.SftPipeline()'])
  assert probe().pack is False   # one sample per row: the stage scores samples


@pytest.mark.parametrize('scope', ['layer', 'model'])
def test_upit_gin_binds_the_merge_pair_scope(scope):
  """upcycling/upit.gin picks pairs per layer; `sources.Merge.pair_scope` reaches the Merge
  the restore hook and convert make; a bad value is one line naming the binding."""
  bindings = [] if scope == 'layer' else [f"sources.Merge.pair_scope = '{scope}'"]
  parse(['upcycling/upit.gin'], bindings + ['probe.model = @sources.Merge'])
  dense = {'mlp': {'wi': {'kernel': np.ones((2, 3), np.float32)}}}
  merge = probe()(sources=[dense, dense], dare_base=dense)
  assert (merge.method, merge.drop_rate, merge.pair_scope) == ('dare', 0.5, scope)
  gin.clear_config()
  parse(['upcycling/upit.gin'], ["sources.Merge.pair_scope = 'global'",
                                 'probe.model = @sources.Merge'])
  with pytest.raises(ValueError) as refused:
    probe()(sources=[dense, dense], dare_base=dense)
  assert gin_utils.message(refused.value) == (
      "sources.Merge.pair_scope='global': expected one of ('layer', 'model').")
