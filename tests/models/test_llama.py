"""The Llama model: its tree, packing, MoE blocks, scan and remat, RoPE, and HF config reading.

Logits against transformers' models: tests/checkpoints/test_hf_llama.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.helpers import llama_logits
from upcycle import fields, tree, upcycling
from upcycle.models.families import abstract_params
from upcycle.models import Llama, Llama3RopeScaling, LlamaConfig, scan_layout
from upcycle.models import rope
from upcycle.moe import MOE_COLLECTIONS, MoeConfig, aux_losses, routers

DENSE = LlamaConfig(vocab_size=97, d_model=32, num_heads=6, num_kv_heads=2, head_dim=10,
                    d_ff=48, num_layers=2)
# Every block MoE (a period of one block, so the stack scans); with k=2 of 4 experts and
# capacity factor 2 no token is dropped, and normalized combine weights make copied experts
# compute the dense MLP.
MOE = dataclasses.replace(DENSE, moe=MoeConfig(
    num_experts=4, router=routers.TopK(k=2), train_capacity_factor=2.0,
    eval_capacity_factor=2.0, normalize_combine_weights=True, dispatch='indices'))
TOKENS = np.random.default_rng(0).integers(0, DENSE.vocab_size, (2, 12)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _dense_params():
  return tree.unbox(jax.jit(Llama(DENSE).init)(jax.random.PRNGKey(0), TOKENS))['params']


@functools.lru_cache(maxsize=None)
def _moe_params():
  params, _ = upcycling.upcycle(_dense_params(), abstract_params(MOE), experts='copy',
                                router='normal', rng=jax.random.PRNGKey(1))
  return params


def test_parameter_tree_names_shapes_and_axes():
  boxed = jax.eval_shape(Llama(DENSE).init, jax.random.PRNGKey(0), TOKENS)['params']
  flat = tree.flatten(tree.unbox(boxed))
  layer = 'decoder/layers_1/'
  assert {path: tuple(leaf.shape) for path, leaf in flat.items()
          if not path.startswith('decoder/layers_0/')} == {
      'token_embedder/embedding': (97, 32),
      layer + 'pre_self_attention_layer_norm/scale': (32,),
      layer + 'self_attention/query/kernel': (32, 60),
      layer + 'self_attention/key/kernel': (32, 20),
      layer + 'self_attention/value/kernel': (32, 20),
      layer + 'self_attention/out/kernel': (60, 32),
      layer + 'pre_mlp_layer_norm/scale': (32,),
      layer + 'mlp/wi_0/kernel': (32, 48),
      layer + 'mlp/wi_1/kernel': (32, 48),
      layer + 'mlp/wo/kernel': (48, 32),
      'decoder/decoder_norm/scale': (32,),
      'decoder/logits_dense/kernel': (32, 97),
  }
  attention = boxed['decoder']['layers_0']['self_attention']
  assert attention['key']['kernel'].names == ('embed', 'joined_kv')
  assert attention['out']['kernel'].names == ('joined_kv', 'embed')
  biased = abstract_params(dataclasses.replace(DENSE, qkv_bias=True, logits_via_embedding=True))
  assert biased['decoder']['layers_0']['self_attention']['key']['bias'].shape == (20,)
  assert 'bias' not in biased['decoder']['layers_0']['self_attention']['out']
  assert 'logits_dense' not in biased['decoder']


@pytest.mark.parametrize('config', [DENSE, MOE], ids=['dense', 'moe'])
def test_packed_examples_do_not_see_each_other(config):
  """Two examples packed into one row (segment ids, positions restarting at 0) give the logits
  each gives alone in a padded row (MoE: padding is not routed)."""
  first, second = TOKENS[0, :7], TOKENS[1, :5]
  tokens = np.zeros((3, 14), np.int32)
  segments = np.zeros((3, 14), np.int32)
  positions = np.zeros((3, 14), np.int32)
  tokens[0, :12], segments[0, :12] = np.concatenate([first, second]), [1] * 7 + [2] * 5
  positions[0, :12] = np.concatenate([np.arange(7), np.arange(5)])
  for row, example in ((1, first), (2, second)):
    n = len(example)
    tokens[row, :n], segments[row, :n], positions[row, :n] = example, 1, np.arange(n)
  params = _dense_params() if config is DENSE else _moe_params()
  logits = llama_logits(params, config, tokens, segments, positions)
  np.testing.assert_allclose(logits[0, :7], logits[1, :7], rtol=0, atol=1e-5)
  np.testing.assert_allclose(logits[0, 7:12], logits[2, :5], rtol=0, atol=1e-5)
  assert np.abs(logits[0, 7:12] - logits[0, :5]).max() > 1e-3   # The examples differ.


def _loss_fn(config):
  def loss(params):
    logits, state = Llama(config).apply({'params': params}, TOKENS, mutable=MOE_COLLECTIONS)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1]) + aux_losses(state)['total'], logits
  return loss


@functools.lru_cache(maxsize=None)
def _unrolled_moe():
  return jax.jit(jax.value_and_grad(_loss_fn(MOE), has_aux=True))(_moe_params())


def test_copied_experts_compute_the_dense_model():
  """SwiGLU experts are the dense MLP's parameters under `mlp/expert/`: upcycled by copying,
  they compute the dense logits."""
  (_, logits), _ = _unrolled_moe()
  np.testing.assert_allclose(logits, llama_logits(_dense_params(), DENSE, TOKENS),
                             rtol=0, atol=1e-5)


@pytest.mark.parametrize('scan,policy', [(True, 'full'), (False, 'minimal')])
def test_scan_and_remat_equal_the_unrolled_model(scan, policy):
  (loss, logits), grads = _unrolled_moe()
  config = dataclasses.replace(MOE, scan_layers=scan, remat_policy=policy)
  layout = (lambda t: scan_layout.stack(t, config)) if scan else (lambda t: t)
  (got_loss, got_logits), got_grads = jax.jit(
      jax.value_and_grad(_loss_fn(config), has_aux=True))(layout(_moe_params()))
  np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-5)
  np.testing.assert_allclose(got_loss, loss, rtol=0, atol=1e-5)
  got = tree.flatten(scan_layout.unstack(got_grads, config) if scan else got_grads)
  assert got.keys() == tree.flatten(grads).keys()
  for path, leaf in tree.flatten(grads).items():
    np.testing.assert_allclose(got[path], leaf, rtol=0, atol=1e-5, err_msg=path)


def test_splash_kernel_equals_the_einsum_logits_and_gradients():
  """attention='splash_interpret' (the TPU kernel, interpreted) against the einsum, on 200
  tokens (padded to the kernel's 256): a row packing two examples and padding, a row of one;
  grouped-query heads, a sliding window as long as the rows."""
  einsum = dataclasses.replace(DENSE, num_layers=1, sliding_window=200, attention='einsum')
  splash = dataclasses.replace(einsum, attention='splash_interpret')
  tokens = np.random.default_rng(1).integers(0, DENSE.vocab_size, (2, 200)).astype(np.int32)
  segments = np.stack([np.repeat([1, 2, 0], [90, 100, 10]), np.ones(200, int)]).astype(np.int32)
  positions = np.stack([np.concatenate([np.arange(90), np.arange(100), np.zeros(10, int)]),
                        np.arange(200)]).astype(np.int32)
  params = tree.unbox(jax.jit(Llama(einsum).init)(jax.random.PRNGKey(0), tokens))['params']

  def logits_and_grads(config):
    def loss(params):
      logits = Llama(config).apply({'params': params}, tokens, segments, positions)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, want), want_grads = logits_and_grads(einsum)
  (_, got), got_grads = logits_and_grads(splash)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  for path, leaf in tree.flatten(want_grads).items():
    np.testing.assert_allclose(tree.flatten(got_grads)[path], leaf, rtol=0, atol=1e-6,
                               err_msg=path)


def test_auto_attention_is_the_einsum_on_cpu_bit_for_bit():
  packed = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12], np.int32)
  auto = llama_logits(_dense_params(), DENSE, TOKENS, packed)
  einsum = llama_logits(_dense_params(), dataclasses.replace(DENSE, attention='einsum'),
                        TOKENS, packed)
  np.testing.assert_array_equal(auto, einsum)


def test_scanned_dense_tree():
  config = dataclasses.replace(DENSE, num_layers=3, scan_layers=True)
  flat = tree.flatten(abstract_params(config))
  assert flat['decoder/layers/subblock_0/self_attention/query/kernel'].shape == (3, 32, 60)


def test_rope_frequencies_are_transformers():
  import transformers  # pylint: disable=g-import-not-at-top
  from transformers import modeling_rope_utils  # pylint: disable=g-import-not-at-top
  scaling = {'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
             'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
             'original_max_position_embeddings': 200}
  hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                rope_parameters=scaling)
  theirs, _ = modeling_rope_utils._compute_llama3_parameters(hf)  # pylint: disable=protected-access
  ours = rope.inverse_frequencies(32, 10000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 200))
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
  plain = rope.inverse_frequencies(32, 10000.0)
  kept, stretched = ours == plain, ours == plain / 8
  assert kept.any() and stretched.any() and (~kept & ~stretched).any()   # and interpolated


def test_rotation_is_hf_rotate_half():
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 4))
  positions = jnp.array([[0, 1, 5]])
  inv_freq = rope.inverse_frequencies(4, 100.0)
  angles = np.asarray(positions)[0, :, None] * inv_freq     # [3, 2]
  cos, sin = np.cos(np.tile(angles, 2)), np.sin(np.tile(angles, 2))
  half = np.concatenate([-np.asarray(x)[..., 2:], np.asarray(x)[..., :2]], axis=-1)
  want = np.asarray(x) * cos[None, :, None] + half * sin[None, :, None]
  np.testing.assert_allclose(rope.rotate(x, positions, inv_freq), want, rtol=1e-6, atol=1e-6)


HF_LLAMA = {'model_type': 'llama', 'vocab_size': 97, 'hidden_size': 32,
            'intermediate_size': 48, 'num_hidden_layers': 2, 'num_attention_heads': 4,
            'num_key_value_heads': 2, 'max_position_embeddings': 64, 'hidden_act': 'silu',
            'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0}}


def test_from_hf_config_reads_both_rope_spellings():
  llama3 = {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
            'original_max_position_embeddings': 16}
  new = dict(HF_LLAMA, rope_parameters={'rope_type': 'llama3', 'rope_theta': 5e5, **llama3})
  old = dict(HF_LLAMA, rope_theta=5e5, rope_scaling={'type': 'llama3', **llama3})
  del old['rope_parameters']
  config = LlamaConfig.from_hf_config(new)
  assert config == LlamaConfig.from_hf_config(old)
  assert (config.rope_theta, config.rope_scaling) == (5e5, Llama3RopeScaling(8.0, 1.0, 4.0, 16))
  assert (config.head_dim, config.num_kv_heads, config.sliding_window) == (8, 2, None)


def test_sliding_window_as_long_as_the_run_is_kept_and_longer_inputs_refused():
  mistral = dict(HF_LLAMA, model_type='mistral', sliding_window=12)
  config = LlamaConfig.from_hf_config(mistral, max_length=12)
  assert config.sliding_window == 12
  assert LlamaConfig.from_hf_config(dict(mistral, sliding_window=None)).sliding_window is None
  qwen2 = dict(HF_LLAMA, model_type='qwen2', sliding_window=4, use_sliding_window=False)
  assert LlamaConfig.from_hf_config(qwen2, max_length=12).sliding_window is None
  with pytest.raises(ValueError, match=r'sequences of 13 tokens, but models.LlamaConfig.'
                     r'sliding_window = 12.*Fix: feed at most 12 tokens'):
    jax.eval_shape(Llama(config).init, jax.random.PRNGKey(0), jnp.ones((1, 13), jnp.int32))


@pytest.mark.parametrize('changes,field', [
    ({'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0}}, 'rope_parameters.rope_type'),
    ({'rope_scaling': {'type': 'linear', 'factor': 2.0}}, 'rope_scaling.type'),
    ({'rope_parameters': {'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0}},
     'rope_parameters.low_freq_factor'),
    ({'partial_rotary_factor': 0.5}, 'partial_rotary_factor'),
    ({'mlp_bias': True}, 'mlp_bias'),
    ({'hidden_act': 'gelu'}, 'hidden_act'),
    ({'model_type': 'mistral', 'sliding_window': 8}, 'sliding_window'),
    ({'model_type': 'qwen2', 'use_sliding_window': True, 'sliding_window': 8}, 'sliding_window'),
    ({'model_type': 'qwen3'}, 'model_type'),
    ({'hidden_size': None}, 'hidden_size'),
])
def test_from_hf_config_refuses_in_one_line(changes, field):
  with pytest.raises(fields.ConfigError) as e:
    LlamaConfig.from_hf_config(dict(HF_LLAMA, **changes), max_length=16, source='m/config.json')
  message = str(e.value)
  assert message.startswith(f'm/config.json: field "{field}"')
  assert 'Fix: ' in message and '\n' not in message


@pytest.mark.parametrize('changes,binding', [
    ({'num_kv_heads': 4}, 'models.LlamaConfig.num_kv_heads = 4'),
    ({'head_dim': 9}, 'models.LlamaConfig.head_dim = 9'),
    ({'moe': MoeConfig(num_experts=4)}, 'models.LlamaConfig.moe.router = ExpertsChoose'),
    ({'attention': 'flash'}, "models.LlamaConfig.attention = 'flash'"),
    ({'attention': 'cudnn'}, "models.LlamaConfig.attention = 'cudnn': cuDNN's fused attention "
     "takes bfloat16 or float16, but dtype = 'float32'"),
    ({'attention': 'splash', 'dropout_rate': 0.1},
     "models.LlamaConfig.attention = 'splash': the kernel has no attention dropout"),
    ({'moe': MoeConfig(num_experts=4, router=routers.TopK()), 'moe_layers': 'last_1',
      'scan_layers': True}, 'models.LlamaConfig.moe_layers'),
])
def test_config_refuses_what_it_cannot_build(changes, binding):
  with pytest.raises(fields.ConfigError, match=binding.replace('.', r'\.')):
    dataclasses.replace(DENSE, **changes)
