"""Tiny dense trees in the naming contract, and MoE targets made from them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from upcycle import tree
from upcycle.upcycling import ffn

S = jax.ShapeDtypeStruct


def _normal(rng, shape, mean=0.0, std=1.0):
  return (mean + std * rng.standard_normal(shape)).astype(np.float32)


def dense_t5(seed=0, d_model=8, d_ff=32, num_layers=2):
  """T5X names; each matrix has its own mean/std so mixed-up statistics show."""
  rng = np.random.default_rng(seed)
  tree = {'token_embedder': {'embedding': _normal(rng, (16, d_model))}, 'encoder': {}}
  for i in range(num_layers):
    tree['encoder'][f'layers_{i}'] = {
        'attention': {'query': {'kernel': _normal(rng, (d_model, d_model))}},
        'pre_mlp_layer_norm': {'scale': np.ones(d_model, np.float32)},
        'mlp': {'wi_0': {'kernel': _normal(rng, (d_model, d_ff), 1.0, 2.0)},
                'wi_1': {'kernel': _normal(rng, (d_model, d_ff), -1.0, 0.5)},
                'wo': {'kernel': _normal(rng, (d_ff, d_model), 0.3, 1.5)}}}
  tree['encoder']['encoder_norm'] = {'scale': np.ones(d_model, np.float32)}
  return tree


def dense_vit(seed=0, width=8, mlp_dim=32, depth=2):
  """big_vision names."""
  rng = np.random.default_rng(seed)
  tree = {'Transformer': {}, 'head': {'kernel': _normal(rng, (width, 10)),
                                      'bias': _normal(rng, (10,))}}
  for i in range(depth):
    tree['Transformer'][f'encoderblock_{i}'] = {
        'LayerNorm_1': {'scale': np.ones(width, np.float32), 'bias': np.zeros(width, np.float32)},
        'MlpBlock_0': {
            'Dense_0': {'kernel': _normal(rng, (width, mlp_dim), 0.5, 2.0),
                        'bias': _normal(rng, (mlp_dim,), -0.2, 0.7)},
            'Dense_1': {'kernel': _normal(rng, (mlp_dim, width), -0.4, 1.2),
                        'bias': _normal(rng, (width,), 0.1, 0.3)}}}
  return tree


def moe_target(dense, mlps, num_experts, d_model=8, expert_d_ff=None, shared_d_ff=None):
  """Abstract MoE tree: the MLPs at `mlps` become `expert/` + `router/` blocks, plus a
  `shared_expert/` MLP of `shared_d_ff` units when given."""
  flat = {p: S(np.shape(x), np.asarray(x).dtype) for p, x in tree.flatten(dense).items()}
  out = {}
  for path, leaf in flat.items():
    mlp = next((m for m in mlps if path.startswith(m + '/')), None)
    if mlp is None:
      out[path] = leaf
      continue
    name = path[len(mlp) + 1:]
    shape = list(leaf.shape)
    if expert_d_ff is not None:
      axis = ffn.d_ff_axis(name)
      if axis is not None:
        shape[axis] = expert_d_ff
    out[f'{mlp}/expert/{name}'] = S((num_experts, *shape), leaf.dtype)
    if shared_d_ff is not None:
      shape, axis = list(leaf.shape), ffn.d_ff_axis(name)
      if axis is not None:
        shape[axis] = shared_d_ff
      out[f'{mlp}/shared_expert/{name}'] = S(tuple(shape), leaf.dtype)
  for mlp in mlps:
    out[f'{mlp}/router/router_weights/w/kernel'] = S((d_model, num_experts), jnp.float32)
  return tree.unflatten(out)


def untouched_units(dense_mlp, experts, num_experts):
  """bool `[E, d_ff]`: unit j of expert e equals the dense unit in every matrix."""
  axes = ffn.d_ff_axes({n: np.shape(x) for n, x in dense_mlp.items()})
  d_ff = ffn.d_ff({n: np.shape(x) for n, x in dense_mlp.items()})
  same = np.ones((num_experts, d_ff), bool)
  for name, axis in axes.items():
    if axis is None:
      continue
    dense = np.moveaxis(np.asarray(dense_mlp[name]), axis, -1)
    out = np.moveaxis(np.asarray(experts[name]), axis + 1, -1)
    eq = (out == dense[None]).reshape(num_experts, -1, d_ff).all(axis=1)
    same &= eq
  return same


@pytest.fixture
def t5():
  return dense_t5


@pytest.fixture
def vit():
  return dense_vit


@pytest.fixture
def target():
  return moe_target


@pytest.fixture
def untouched():
  return untouched_units
