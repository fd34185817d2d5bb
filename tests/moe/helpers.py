"""Shared by the MoE tests: the jaxpr walk, and the arrays Flaxformer computed."""

import functools
import pathlib

import jax
import jax.extend
import numpy as np

# Written by make_routing.py beside it, from a Flaxformer checkout (its docstring says what).
FLAXFORMER_ROUTING = (pathlib.Path(__file__).resolve().parents[1] / 'fixtures' / 'flaxformer' /
                      'routing.npz')


@functools.lru_cache(maxsize=None)
def flaxformer_arrays() -> dict:
  """{name: array} of FLAXFORMER_ROUTING, read once."""
  with np.load(FLAXFORMER_ROUTING) as arrays:
    return {name: arrays[name] for name in arrays.files}


def primitive_names(fn, *args) -> set:
  """The names of every primitive in `fn`'s jaxpr on `args`, nested jaxprs included."""
  names = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      names.add(eqn.primitive.name)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names
