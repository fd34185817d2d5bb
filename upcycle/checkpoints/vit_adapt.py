"""Adapting ViT checkpoints: the exact class-token fold, and resizes or new heads only when asked.

Position embeddings are resampled on their 2-D grid with bilinear zoom
(`scipy.ndimage.zoom(order=1)`, as vit_jax and big_vision do); the class token
lives apart (`cls`) and is untouched. A head for a different number of classes
is dropped (the model initializes its own) or re-initialized to zeros (big_vision's
`head_zeroinit`).
"""

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import scipy.ndimage

from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.lazy import LazyArray

HEAD_MODES = ('drop', 'reinit')


def fold_cls(cls: LazyArray, pos: LazyArray) -> Tuple[LazyArray, LazyArray]:
  """Moves a position embedding's class-token slot into the class token, exactly.

  vit_jax and HuggingFace prepend `cls [1, 1, D]` and then add `pos [1, 1+N, D]`;
  big_vision adds `pos_embedding [1, N, D]` and then prepends `cls`. Returns
  (`cls + pos[:, :1]`, added in float32 and stored in cls's dtype, `pos[:, 1:]`).
  """
  dtype = cls.dtype
  folded = LazyArray(cls.shape, dtype, lambda: (
      cls.read().astype(np.float32) + pos.read()[:, :1].astype(np.float32)).astype(dtype),
                     cls.source, cls.param)
  rest = pos.map(lambda a: a[:, 1:], (pos.shape[0], pos.shape[1] - 1, *pos.shape[2:]))
  return folded, rest


def resize_pos_embedding(pos: np.ndarray, grid: Tuple[int, int],
                         old_grid: Tuple[int, int]) -> np.ndarray:
  """`[1, gh*gw, D]` on `old_grid` -> `[1, grid[0]*grid[1], D]`, computed in float32."""
  old = np.asarray(pos, np.float32).reshape(*old_grid, -1)
  zoom = (grid[0] / old_grid[0], grid[1] / old_grid[1], 1)
  new = scipy.ndimage.zoom(old, zoom, order=1)
  return new.reshape(1, grid[0] * grid[1], -1).astype(np.asarray(pos).dtype)


def _square_grid(tokens: int) -> Optional[Tuple[int, int]]:
  side = math.isqrt(tokens)
  return (side, side) if side * side == tokens else None


def _resize(params: Dict[str, Any], grid: Tuple[int, int], source: str, notes: List[str]):
  pos = params.get('pos_embedding')
  if pos is None:
    raise checkpoint_error(source, 'cannot resize: no position embedding', param='pos_embedding',
                           expected='[1, N, D]', found='absent')
  old_grid = _square_grid(pos.shape[1])
  if old_grid is None:
    raise checkpoint_error(source, 'cannot tell the patch grid of a non-square position '
                           'embedding', param='pos_embedding', expected='N = g*g tokens',
                           found=pos.shape, fix='Resize it with resize_pos_embedding(pos, grid, '
                           'old_grid) and an explicit old_grid')
  grid = tuple(grid)
  if grid == old_grid:
    return params
  shape = (1, grid[0] * grid[1], pos.shape[2])
  if isinstance(pos, LazyArray):
    new = pos.map(lambda a: resize_pos_embedding(a, grid, old_grid), shape)
  else:
    new = resize_pos_embedding(pos, grid, old_grid)
  notes.append(f'pos_embedding resized from a {old_grid[0]}x{old_grid[1]} to a '
               f'{grid[0]}x{grid[1]} grid (bilinear), {pos.shape} -> {shape}')
  return {**params, 'pos_embedding': new}


def _adapt_head(params: Dict[str, Any], num_classes: int, head: Optional[str], source: str,
                notes: List[str]):
  kernel = params.get('head', {}).get('kernel')
  if kernel is None or kernel.shape[-1] == num_classes:
    return params
  if head not in HEAD_MODES:
    raise checkpoint_error(
        source, 'the head has a different number of classes', param='head/kernel',
        expected=f'{num_classes} classes', found=f'{kernel.shape[-1]} classes {kernel.shape}',
        fix="Pass head='drop' (the model initializes a new head) or head='reinit' (zeros)")
  params = {k: v for k, v in params.items() if k != 'head'}
  if head == 'drop':
    notes.append(f'head dropped: it had {kernel.shape[-1]} classes, the model has {num_classes}')
    return params
  notes.append(f'head re-initialized to zeros for {num_classes} classes '
               f'(it had {kernel.shape[-1]})')
  params['head'] = {'kernel': np.zeros((kernel.shape[0], num_classes), kernel.dtype),
                    'bias': np.zeros((num_classes,), kernel.dtype)}
  return params


def adapt(params: Dict[str, Any], *, grid: Optional[Tuple[int, int]] = None,
          num_classes: Optional[int] = None, head: Optional[str] = None,
          source: str = 'params') -> Tuple[Dict[str, Any], List[str]]:
  """Returns (new params, one note per change). Nothing changes unless an argument asks."""
  notes = []
  if grid is not None:
    params = _resize(params, grid, source, notes)
  if num_classes is not None:
    params = _adapt_head(params, num_classes, head, source, notes)
  return params, notes
