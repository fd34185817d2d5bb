"""Tiny configs, random parameters and a read-only-ness check shared by the checkpoint tests."""

import functools
import os
import pathlib

import jax
import numpy as np

from upcycle import tree
from upcycle.optimizer_state import adafactor
from upcycle.models.families import abstract_params
from upcycle.models import T5, T5Config, ViT, ViTConfig

# Written by T5X's own checkpointer (t5x/testdata/tiny_t5, Apache-2.0); see its README.md.
T5X_FIXTURE = str(pathlib.Path(__file__).parents[1] / 'fixtures' / 't5x' / 'tiny_t5' /
                  'checkpoint_1')

# The checkpoint tests' T5 and ViT: the architectures of the `hf_t5` and `hf_vit` fixtures
# (tests/conftest.py). The model tests' are larger (tests/models/helpers.py), the training
# tests' larger still (tests/train/helpers.py).
CHECKPOINT_T5 = T5Config(vocab_size=32, d_model=8, num_heads=2, d_kv=4, d_ff=12,
                         num_encoder_layers=2, num_decoder_layers=2,
                         relative_attention_num_buckets=8, relative_attention_max_distance=16)
CHECKPOINT_VIT = ViTConfig(num_classes=5, image_size=(8, 8), patch_size=(4, 4), width=8, depth=2,
                           mlp_dim=12, num_heads=2, head_zeroinit=False)
ENCODER_TOKENS = np.array([[3, 4, 5, 6, 7, 9], [8, 9, 10, 11, 12, 2]], np.int32)
DECODER_TOKENS = np.array([[0, 5, 6, 7], [0, 7, 8, 9]], np.int32)
IMAGES = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)


def random_params(config, seed: int = 0, scale: float = 0.5) -> dict:
  """Every parameter of the model normal(0, scale) in float32 (norm scales around 1)."""
  rng = np.random.default_rng(seed)
  flat = {}
  for path, leaf in tree.flatten(abstract_params(config)).items():
    value = rng.normal(scale=scale, size=leaf.shape).astype(np.float32)
    flat[path] = value + 1 if path.endswith('scale') else value
  return tree.unflatten(flat)


def t5x_slots(params, rng=None):
  """T5X Adafactor slots with T5X's heuristic factoring (v_row drops the largest axis)."""
  rng = rng or np.random.default_rng(1)
  out = {}
  for key, x in params.items():
    if isinstance(x, dict):
      out[key] = t5x_slots(x, rng)
      continue
    zero = np.zeros((1,), np.float32)
    slot = {'v_row': zero, 'v_col': zero, 'v': zero, 'm': zero}
    if x.ndim >= 2 and min(x.shape) >= 4:
      d1, d0 = adafactor.factored_dims(x.shape)
      slot['v_row'] = rng.uniform(0.5, 2, np.delete(x.shape, d0)).astype(np.float32)
      slot['v_col'] = rng.uniform(0.5, 2, np.delete(x.shape, d1)).astype(np.float32)
    else:
      slot['v'] = rng.uniform(0.5, 2, x.shape).astype(np.float32)
    out[key] = slot
  return out


@functools.lru_cache(maxsize=None)
def _jitted_apply(config):
  model = T5(config) if isinstance(config, T5Config) else ViT(config)
  return jax.jit(model.apply)


def t5_logits(params, config=CHECKPOINT_T5) -> np.ndarray:
  """[2, 4, vocab] logits of `params` (lazy or bf16 leaves are read and cast to float32)."""
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  return np.asarray(_jitted_apply(config)({'params': params}, ENCODER_TOKENS, DECODER_TOKENS))


def vit_logits(params, config=CHECKPOINT_VIT, images=IMAGES) -> np.ndarray:
  """[2, classes] logits of `params` on `images` [2, 8, 8, 3]."""
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  return np.asarray(_jitted_apply(config)({'params': params}, images))


def apply_as_documented(params, config) -> np.ndarray:
  """The documented call (docs/python_api.md), `T5(config).apply({'params': params}, ...)` (or
  ViT's), on a loader's output exactly as returned: no conversion of the leaves, no jit."""
  if isinstance(config, T5Config):
    return np.asarray(T5(config).apply({'params': params}, ENCODER_TOKENS, DECODER_TOKENS))
  return np.asarray(ViT(config).apply({'params': params}, IMAGES, train=False))


def snapshot(path: str) -> dict:
  """relative path -> (size, mtime) of everything under `path`, to prove nothing was written."""
  if os.path.isfile(path):
    return {'': (os.path.getsize(path), os.stat(path).st_mtime_ns)}
  out = {}
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      full = os.path.join(root, name)
      out[os.path.relpath(full, path)] = (os.path.getsize(full), os.stat(full).st_mtime_ns)
  return out


def torch_t5_logits(model, encoder_tokens, decoder_tokens) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(input_ids=torch.tensor(encoder_tokens, dtype=torch.long),
                 decoder_input_ids=torch.tensor(decoder_tokens, dtype=torch.long)).logits.numpy()


def torch_vit_logits(model, images) -> np.ndarray:
  """`images` [b, h, w, c] (ours, NHWC) -> logits; HuggingFace takes NCHW pixel_values."""
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(pixel_values=torch.tensor(images.transpose(0, 3, 1, 2))).logits.numpy()
