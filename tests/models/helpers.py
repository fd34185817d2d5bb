"""Tiny model configs, the dense -> MoE tiling used by model tests (independent of surgery),
and `jitted` / `llama_logits` (a whole model applied op by op takes tens of seconds on CPU)."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np

from upcycle.models import Llama, T5Config, ViTConfig

# The model tests' T5 and ViT: tiny, jitted whole. The checkpoint tests' are smaller
# (tests/checkpoints/helpers.py), the training tests' larger (tests/train/helpers.py).
MODEL_T5 = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                    num_encoder_layers=2, num_decoder_layers=2)
MODEL_VIT = ViTConfig(num_classes=5, image_size=(8, 8), patch_size=(4, 4), width=16, depth=2,
                      mlp_dim=32, num_heads=2, head_zeroinit=False)


def tile_experts(dense_params, moe_abstract, seed=0):
  """Expert leaves = the dense MLP tiled; router random (normal, std 1); the rest copied."""
  flat_dense = flax.traverse_util.flatten_dict(dense_params)
  out = {}
  rng = np.random.default_rng(seed)
  for path, leaf in flax.traverse_util.flatten_dict(moe_abstract).items():
    if 'expert' in path:
      i = path.index('expert')
      dense = flat_dense[path[:i] + path[i + 1:]]
      out[path] = jnp.stack([dense] * leaf.shape[0])
    elif 'router' in path:
      out[path] = jnp.asarray(rng.normal(size=leaf.shape), jnp.float32)
    else:
      out[path] = flat_dense[path]
  return flax.traverse_util.unflatten_dict(out)


def tokens(seed, shape, vocab):
  return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, shape), jnp.int32)


def jitted(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` under one `jax.jit` (e.g. `jitted(model.apply, {'params': p}, x)`):
  arguments that are arrays or trees of arrays are traced, the rest (flags, `mutable=`,
  `method=`, rngs) are fixed for this call."""
  traced = [bool(jax.tree.leaves(a)) and all(isinstance(x, (np.ndarray, jax.Array))
                                             for x in jax.tree.leaves(a)) for a in args]

  def call(arrays):
    arrays = iter(arrays)
    return fn(*[next(arrays) if t else a for a, t in zip(args, traced)], **kwargs)

  return jax.jit(call)([a for a, t in zip(args, traced) if t])


@functools.lru_cache(maxsize=None)
def _llama_apply(config):
  return jax.jit(lambda params, *inputs: Llama(config).apply({'params': params}, *inputs))


def llama_logits(params, config, tokens, segment_ids=None, positions=None) -> np.ndarray:
  """`Llama(config)` logits `[batch, length, vocab]`, compiled once per config and input
  shapes for the whole test session."""
  return np.asarray(_llama_apply(config)(params, tokens, segment_ids, positions))
