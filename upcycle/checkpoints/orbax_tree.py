"""Lazy reading of one orbax PyTree item directory (T5X's `checkpoint_N/state`, our items).

Orbax records the tree in `_METADATA` (names, shapes, dtypes); each array is a
zarr array named by its '.'-joined key path, inside the directory's OCDBT
database when `manifest.ocdbt` is present, else in a sub-directory of that name.
The directory may be local or gs:// (read with tensorstore's GCS driver).
"""

import os
from typing import Any

import jax

from upcycle.checkpoints import paths
from upcycle.checkpoints.errors import checkpoint_error
from upcycle.checkpoints.zarr_leaf import kvstore_for, zarr_array

METADATA = '_METADATA'


def is_item_dir(path: str) -> bool:
  return paths.isfile(os.path.join(path, METADATA))


def read(directory: str) -> Any:
  """An orbax PyTree item directory -> its tree, every array a LazyArray.

  Raises:
    CheckpointError: `directory` is not a finished orbax item (no `_METADATA`).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  directory = paths.absolute(directory)
  try:
    metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory))
  except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
    if is_item_dir(directory):   # there, but damaged
      cause = f'{type(e).__name__}: {str(e).splitlines()[0].split(" [")[0][:200]}' if str(
          e).strip() else type(e).__name__
      raise checkpoint_error(
          os.path.join(directory, METADATA), f'the tree metadata is unreadable ({cause})',
          fix='The checkpoint copy is corrupt; copy it again from its source') from e
    raise checkpoint_error(
        directory, f'not a readable orbax checkpoint item ({e})',
        expected=f'{METADATA} written by orbax', found=paths.listdir(directory),
        fix='Pass a finished checkpoint; unfinished saves live in *.orbax-checkpoint-tmp-* '
        'directories and are not readable') from e
  ocdbt = paths.isfile(os.path.join(directory, 'manifest.ocdbt'))
  base = f'{directory}/' if paths.is_url(directory) else f'file://{directory}/'
  driver = 'zarr3' if metadata.use_zarr3 else 'zarr'

  def leaf(meta: Any) -> Any:
    if not hasattr(meta, 'shape') or not hasattr(meta, 'name'):
      return meta
    kvstore = ({'driver': 'ocdbt', 'base': base, 'path': meta.name}
               if ocdbt else kvstore_for(directory, meta.name))
    return zarr_array(kvstore, tuple(meta.shape), meta.dtype, meta.name.replace('.', '/'),
                      directory, driver=driver)

  is_leaf = lambda x: hasattr(x, 'shape') and hasattr(x, 'name')
  return jax.tree.map(leaf, metadata.tree, is_leaf=is_leaf)

