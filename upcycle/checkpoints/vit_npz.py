"""ViT `.npz` checkpoints: vit_jax (pre-Linen names) and big_vision (Linen names).

Both store one array per '/'-joined parameter path. vit_jax (optionally under
`opt/target/`) names blocks `MultiHeadDotProductAttention_1`, `LayerNorm_2`,
`MlpBlock_3` and keeps `Transformer/posembed_input/pos_embedding [1, 1+N, D]` with a
class-token slot that is added to the class token: we fold it, `cls += pos[:, :1]`,
and keep `pos_embedding = pos[:, 1:]` (the same function, exactly). big_vision
(optionally under `params/`) already uses our names; a scanned encoder
(`Transformer/encoderblock/...` with a leading depth axis) is unstacked. bfloat16 arrays,
which numpy saves as void `|V2`, come back as bfloat16. Leaves are numpy arrays, or
LazyArrays with `lazy=True`.
"""

import os
import re
import zipfile
from typing import Any, Dict, Optional, Tuple

import ml_dtypes
import numpy as np

from upcycle import tree
from upcycle.checkpoints import vit_adapt
from upcycle.checkpoints.checkpoint import Checkpoint
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

_VIT_JAX_POS = 'Transformer/posembed_input/pos_embedding'
_VIT_JAX_BLOCK = {'MultiHeadDotProductAttention_1': 'MultiHeadDotProductAttention_0',
                  'LayerNorm_0': 'LayerNorm_0', 'LayerNorm_2': 'LayerNorm_1',
                  'MlpBlock_3': 'MlpBlock_0'}
_TOP = ('embedding/', 'cls', 'head/', 'pre_logits/', 'Transformer/encoder_norm/', 'MAPHead_0/')
_PREFIXES = {'vit_jax': ('opt/target/',), 'big_vision': ('params/',)}


def _member(archive: zipfile.ZipFile, member: str, path: str) -> LazyArray:
  """One `.npy` member -> LazyArray, reading only its header now."""
  with archive.open(member) as f:
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, _, dtype = read_header(f)
  bf16 = dtype.kind == 'V' and dtype.itemsize == 2

  def read():
    with zipfile.ZipFile(path) as z, z.open(member) as f:
      array = np.lib.format.read_array(f, allow_pickle=False)
    return array.view(ml_dtypes.bfloat16) if bf16 else array

  name = member[:-len('.npy')]
  return LazyArray(shape, ml_dtypes.bfloat16 if bf16 else dtype, read, path, name)


def read_npz(path: str) -> Dict[str, LazyArray]:
  """All arrays of an .npz, by key, without reading their data."""
  try:
    with zipfile.ZipFile(path) as archive:
      return {m[:-len('.npy')]: _member(archive, m, path)
              for m in archive.namelist() if m.endswith('.npy')}
  except (zipfile.BadZipFile, ValueError, OSError) as e:
    raise checkpoint_error(path, f'not a readable .npz archive ({e})',
                           fix='The file is truncated or corrupt; download it again') from e


def detect(keys) -> Optional[str]:
  """'vit_jax', 'big_vision' or None, from the keys of an .npz."""
  keys = set(keys)
  if any(k.endswith(_VIT_JAX_POS) for k in keys):
    return 'vit_jax'
  if 'pos_embedding' in keys or 'params/pos_embedding' in keys or any(
      k.startswith(('Transformer/encoderblock', 'params/Transformer/')) for k in keys):
    return 'big_vision'
  return None


def _strip(flat: Dict[str, Any], prefixes) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """-> (parameters with the wrapper prefix removed, everything else, e.g. optimizer slots)."""
  for prefix in prefixes:
    if any(k.startswith(prefix) for k in flat):
      inside = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
      return inside, {k: v for k, v in flat.items() if not k.startswith(prefix)}
  return flat, {}


def from_vit_jax(flat: Dict[str, LazyArray], source: str) -> Dict[str, Any]:
  """vit_jax names -> big_vision names; folds the class-token slot of the position embedding."""
  params, unknown = {}, []
  for key, leaf in flat.items():
    m = re.fullmatch(r'Transformer/encoderblock_(\d+)/([^/]+)/(.+)', key)
    if m and m.group(2) in _VIT_JAX_BLOCK:
      block = f'Transformer/encoderblock_{m.group(1)}'
      params[f'{block}/{_VIT_JAX_BLOCK[m.group(2)]}/{m.group(3)}'] = leaf
    elif key.startswith(_TOP):
      params[key] = leaf
    elif key != _VIT_JAX_POS:
      unknown.append(key)
  if unknown:
    raise checkpoint_error(source, 'arrays a vit_jax ViT does not have', expected='embedding, '
                           'cls, Transformer/{posembed_input, encoderblock_i, encoder_norm}, '
                           'pre_logits, head', found=sorted(unknown)[:8],
                           fix='Hybrid (ResNet+ViT) and other variants are not supported')
  if _VIT_JAX_POS not in flat:
    raise checkpoint_error(source, 'no position embedding', param=_VIT_JAX_POS,
                           expected='[1, 1+N, D] or [1, N, D]', found='absent')
  pos = flat[_VIT_JAX_POS]
  if 'cls' in params:  # Classifier 'token': the embedding has a class-token slot.
    params['cls'], pos = vit_adapt.fold_cls(params['cls'], pos)
  params['pos_embedding'] = pos
  return params


def _unscan(flat: Dict[str, LazyArray]) -> Dict[str, Any]:
  """`Transformer/encoderblock/X [depth, ...]` -> `Transformer/encoderblock_{i}/X [...]`."""
  out = {}
  for key, leaf in flat.items():
    if not key.startswith('Transformer/encoderblock/'):
      out[key] = leaf
      continue
    rest = key[len('Transformer/encoderblock/'):]
    for i in range(leaf.shape[0]):
      out[f'Transformer/encoderblock_{i}/{rest}'] = leaf.map(lambda a, i=i: a[i], leaf.shape[1:])
  return out


def load(path: str, *, grid: Optional[Tuple[int, int]] = None,
         num_classes: Optional[int] = None, head: Optional[str] = None,
         lazy: bool = False) -> Checkpoint:
  """A vit_jax or big_vision .npz -> Checkpoint with big_vision-named params.

  Args:
    path: the .npz file.
    grid: if given, resize `pos_embedding` to this (h, w) patch grid (vit_adapt).
    num_classes: if given and different from the head's, apply `head`.
    head: 'drop' or 'reinit' (zeros), required when `num_classes` differs.
    lazy: return LazyArray leaves read on demand instead of numpy arrays.
  Every adaptation made is listed in `Checkpoint.notes`.
  """
  path = os.fspath(path)
  arrays = read_npz(path)
  kind = detect(arrays)
  if kind is None:
    raise checkpoint_error(
        path, 'not a ViT checkpoint', expected=f"'{_VIT_JAX_POS}' (vit_jax) or 'pos_embedding' "
        "(big_vision), optionally under 'opt/target/' or 'params/'",
        found=sorted(arrays)[:8], fix='Pass a vit_jax or big_vision ViT .npz')
  flat, rest = _strip(arrays, _PREFIXES[kind])
  params = from_vit_jax(flat, path) if kind == 'vit_jax' else _unscan(flat)
  params, notes = vit_adapt.adapt(tree.unflatten(params), grid=grid, num_classes=num_classes,
                                  head=head, source=path)
  opt = {k[len('opt/'):]: v for k, v in rest.items() if k.startswith('opt/')}
  ckpt = Checkpoint(params=params, step=None, optimizer_state=tree.unflatten(opt) or None,
                    format=kind, path=path, notes=tuple(notes))
  return ckpt if lazy else ckpt.read()
