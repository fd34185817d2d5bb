"""Shared by the MoE tests."""

import jax
import jax.extend


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
