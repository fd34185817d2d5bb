"""Which axis of each dense MLP leaf is the intermediate (d_ff) axis.

Initializers that act per intermediate unit (Drop-Upcycling, neuron noise,
granular slicing) must find the d_ff axis of every matrix of one MLP. The
table is explicit rather than guessed from shapes: d_model == d_ff happens in
tiny models, and a wrong guess would silently mix up rows and columns.

A unit j of the MLP owns column j of every input projection (and entry j of
its bias) and row j of the output projection. The output bias (ViT
`Dense_1/bias [d]`) belongs to no unit: None in the table.
"""

from typing import Dict, Mapping, Optional, Sequence

# layer name -> {leaf name -> d_ff axis of that leaf, or None}.
D_FF_AXES: Dict[str, Dict[str, Optional[int]]] = {
    # T5 v1.1 gated MLP (T5X/Flaxformer names).
    'wi_0': {'kernel': 1},            # [d_model, d_ff]
    'wi_1': {'kernel': 1},            # [d_model, d_ff]
    # T5 v1.0 MLP (one input projection).
    'wi': {'kernel': 1},              # [d_model, d_ff]
    'wo': {'kernel': 0},              # [d_ff, d_model]
    # ViT MlpBlock (big_vision names).
    'Dense_0': {'kernel': 1, 'bias': 0},     # [d, mlp_dim], [mlp_dim]
    'Dense_1': {'kernel': 0, 'bias': None},  # [mlp_dim, d], [d]
}

# Layers whose d_ff axis is their output (the "input projections"); the rest
# take d_ff as their input.
INPUT_LAYERS = ('wi_0', 'wi_1', 'wi', 'Dense_0')


def d_ff_axis(name: str, layer: str = '') -> Optional[int]:
  """The d_ff axis of MLP leaf `name` ('wi_0/kernel'), None if it has none."""
  parts = name.split('/')
  if len(parts) != 2 or parts[0] not in D_FF_AXES or parts[1] not in D_FF_AXES[parts[0]]:
    where = f' in the MLP at {layer}' if layer else ''
    known = ', '.join(f'{k}/{leaf}' for k, leaves in D_FF_AXES.items() for leaf in leaves)
    raise ValueError(
        f'Dense MLP leaf {name!r}{where} is not in the d_ff axis table, so this '
        f'initializer cannot tell which axis holds the intermediate units. Known '
        f'leaves: {known}. Fix: add the leaf with its d_ff axis to D_FF_AXES in '
        f'upcycle/upcycling/ffn.py, or use an initializer that does not need it '
        f'(Copy, Random, FromCheckpoints).')
  return D_FF_AXES[parts[0]][parts[1]]


def d_ff_axes(mlp_shapes: Mapping[str, Sequence[int]], layer: str = '') -> Dict[str, Optional[int]]:
  """d_ff axes of all leaves of one MLP, checking that they agree on d_ff."""
  axes = {name: d_ff_axis(name, layer) for name in mlp_shapes}
  sizes = {name: tuple(mlp_shapes[name])[axis] for name, axis in axes.items() if axis is not None}
  if not sizes:
    raise ValueError(f'The MLP at {layer or "?"} has no leaf with a d_ff axis: '
                     f'{sorted(mlp_shapes)}.')
  if len(set(sizes.values())) > 1:
    detail = ', '.join(f'{n} {tuple(mlp_shapes[n])} (axis {axes[n]} = {s})'
                       for n, s in sizes.items())
    raise ValueError(
        f'The leaves of the MLP at {layer or "?"} disagree on d_ff: {detail}. Fix: check the '
        f'checkpoint maps onto the naming contract (kernels [d_model, d_ff] in, [d_ff, d_model] '
        f'out).')
  return axes


def d_ff(mlp_shapes: Mapping[str, Sequence[int]], layer: str = '') -> int:
  axes = d_ff_axes(mlp_shapes, layer)
  return next(tuple(mlp_shapes[n])[a] for n, a in axes.items() if a is not None)


def is_output(name: str, layer: str = '') -> bool:
  """Whether MLP leaf `name` belongs to the output projection (wo, Dense_1: kernel and bias)."""
  d_ff_axis(name, layer)   # raises for a leaf the table does not know
  return matrix_of(name) not in INPUT_LAYERS


def matrix_of(name: str) -> str:
  """The layer a leaf belongs to: 'Dense_0/bias' -> 'Dense_0'.

  Drop-Upcycling's per-matrix index sets are per layer, so a bias follows its
  kernel.
  """
  return name.split('/')[0]
