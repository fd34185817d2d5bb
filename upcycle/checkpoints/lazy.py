"""`LazyArray`: a checkpoint leaf whose shape and dtype are known but whose data is read on demand.

Readers return trees of LazyArrays (or plain numpy arrays) so that a checkpoint
larger than host memory can be inspected, validated and streamed leaf by leaf:
`np.asarray(leaf)` reads one leaf, `materialize(tree)` reads them all, and
`leaf.read(index)` reads one block, so that each device can fetch only its shard:
`jax.make_array_from_callback(leaf.shape, sharding, leaf.read)`.
"""

from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import numpy as np

from upcycle.checkpoints.errors import checkpoint_error


class LazyArray:
  """Shape and dtype now, data on `np.asarray(self)` (or `self.read()`).

  Attributes:
    shape: tuple of ints.
    dtype: numpy dtype (bfloat16 is `ml_dtypes.bfloat16`).
    source: the file or directory the data comes from, for error messages.
    param: the parameter path in the tree, for error messages.
  """

  def __init__(self, shape: Sequence[int], dtype: Any, read: Callable[[], np.ndarray],
               source: str, param: str = '',
               read_block: Optional[Callable[[Tuple[slice, ...]], np.ndarray]] = None,
               finite: bool = False):
    """`read()` returns the whole array; `read_block(index)`, if given, only `array[index]`.
    With `finite`, a read of floating-point values refuses any NaN or Inf among them (a
    source's damage, refused where its values are read, not passed on to a model)."""
    self.shape = tuple(int(d) for d in shape)
    self.dtype = np.dtype(dtype)
    self.source = str(source)
    self.param = param
    self._read = read
    self._read_block = read_block
    self._finite = finite and jax.numpy.issubdtype(self.dtype, jax.numpy.floating)

  def finite(self) -> 'LazyArray':
    """This array, its reads refusing NaN and Inf values (`finite` above)."""
    return LazyArray(self.shape, self.dtype, self._read, self.source, self.param,
                     read_block=self._read_block, finite=True)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  @property
  def reads_blocks(self) -> bool:
    """Whether `read(index)` reads only the block (else it reads everything, then slices)."""
    return self._read_block is not None

  def read(self, index: Optional[Tuple[slice, ...]] = None) -> np.ndarray:
    """Reads `self[index]` (default: everything) and checks the dtype (and full shape)."""
    if index is not None:
      array = np.asarray(self._read_block(index) if self._read_block else self._read()[index])
      if array.dtype != self.dtype:
        raise checkpoint_error(self.source, 'stored data disagrees with its own metadata',
                               param=self.param, expected=self.dtype, found=array.dtype)
      return self._checked(array)
    array = np.asarray(self._read())
    if array.shape != self.shape or array.dtype != self.dtype:
      raise checkpoint_error(
          self.source, 'stored data disagrees with its own metadata', param=self.param,
          expected=f'{self.shape} {self.dtype}', found=f'{array.shape} {array.dtype}',
          fix='The checkpoint is inconsistent; re-export it from its source')
    return self._checked(array)

  def _checked(self, array: np.ndarray) -> np.ndarray:
    """`array` (values just read), refused if `finite` and any is NaN or Inf: one pass over
    memory, no second read of the file."""
    if not self._finite or np.isfinite(array).all():
      return array
    nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
    raise checkpoint_error(
        self.source, 'the tensor holds values that are not finite', param=self.param,
        expected='finite values', found=f'{nan} NaN and {inf} Inf among those read',
        fix='The file is damaged: re-download or re-export it')

  def __array__(self, dtype=None, copy=None):
    del copy  # Every read makes a fresh array.
    array = self.read()
    return array if dtype is None else array.astype(dtype)

  def map(self, fn: Callable[[np.ndarray], np.ndarray], shape: Sequence[int],
          dtype: Optional[Any] = None) -> 'LazyArray':
    """A lazy `fn(self)`; `fn` must turn `self.shape` into `shape` (a rename is not a read)."""
    return LazyArray(shape, self.dtype if dtype is None else dtype,
                     lambda: fn(self.read()), self.source, self.param)

  def __getitem__(self, k: int) -> 'LazyArray':
    """Entry `k` of the first axis, still lazy: one layer of a scanned stack, as
    `scan_layout.unstack` slices it; reading it reads only that block where the reader can."""
    if not isinstance(k, (int, np.integer)) or not self.shape or not (
        -self.shape[0] <= k < self.shape[0]):
      raise IndexError(f'LazyArray{self.shape}[{k!r}]: only an integer index into the first '
                       f'axis is supported.')
    index = (slice(int(k) % self.shape[0], int(k) % self.shape[0] + 1),)
    return LazyArray(self.shape[1:], self.dtype, lambda: self.read(index)[0], self.source,
                     self.param)

  def __repr__(self) -> str:
    return f'LazyArray(shape={self.shape}, dtype={self.dtype}, source={self.source!r})'


def stack(leaves: Sequence[Any], source: str) -> Any:
  """`np.stack(leaves)` along a new first axis; lazy if any leaf is (nothing read now, and
  reading one entry reads only its leaf)."""
  if not any(isinstance(x, LazyArray) for x in leaves):
    return np.stack([np.asarray(x) for x in leaves])
  first = leaves[0]

  def read_block(index: Tuple[slice, ...]) -> np.ndarray:
    rows = range(*index[0].indices(len(leaves)))
    return np.stack([np.asarray(leaves[i])[index[1:]] for i in rows])

  return LazyArray((len(leaves),) + tuple(first.shape), first.dtype,
                   lambda: np.stack([np.asarray(x) for x in leaves]), source,
                   read_block=read_block)


def materialize(tree: Any) -> Any:
  """Reads every lazy leaf of `tree` into a numpy array (the whole tree is then in memory)."""
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, LazyArray) else x, tree)

