"""ViT image pipelines: TFDS datasets by name, and offline scikit-learn digits.

Batches are `{'image': [batch, size, size, 3] float32 in [-1, 1], 'label': [batch] int32}`
(big_vision's value range). Training crops and flips at random; evaluation resizes the shorter
side to `image_size / eval_crop_fraction` and takes the central crop. Grayscale becomes 3 equal
channels.

Datasets: `DIGITS` ('sklearn_digits', the offline default: 1797 8x8 grayscale digits that ship
with scikit-learn, split into 1500 'train' / 297 'validation' by a fixed permutation) or any TFDS
name with `image`/`label` features ('imagenet2012', 'cifar10', 'cifar100', ...), read from
`tfds_data_dir` and prepared beforehand (`tfds build NAME --data_dir=DIR`).

Randomness is stateless: an example's crop and flip come from (epoch seed, its position in the
epoch), so an epoch is a pure function of its seed and resuming mid-epoch skips examples before
they are decoded.
"""

import dataclasses
import functools
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from upcycle.data import host_only

DIGITS = 'sklearn_digits'
DIGITS_SPLITS = ('train', 'validation')
_DIGITS_VALIDATION_SIZE = 297
_DIGITS_SPLIT_SEED = 0  # Fixed: the split never depends on the training seed.


@functools.lru_cache(maxsize=None)
def digits_split(split: str) -> Tuple[np.ndarray, np.ndarray]:
  """(images `[n, 8, 8, 1]` uint8 in [0, 255], labels `[n]` int32) of scikit-learn's digits."""
  if split not in DIGITS_SPLITS:
    raise ValueError(f'{DIGITS} has splits {DIGITS_SPLITS}; got split {split!r}.')
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(digits.target))
  index = np.sort(order[:_DIGITS_VALIDATION_SIZE] if split == 'validation'
                  else order[_DIGITS_VALIDATION_SIZE:])
  images = np.round(digits.images[index] * (255.0 / 16.0)).astype(np.uint8)[..., None]
  return images, digits.target[index].astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ImagePipeline:
  """One split of an image classification dataset, preprocessed for ViT.

  Attributes:
    dataset: `DIGITS` or a TFDS name, e.g. 'imagenet2012', 'cifar10'.
    split: a split of it ('train', 'validation'; TFDS slices like 'train[:99%]' work).
    image_size: side of the square output images.
    train: random crop and flip (training) or central crop (evaluation).
    random_flip: flip left-right at random when training.
    inception_crop: when training, crop a random box of 5%-100% of the area and aspect in
      [3/4, 4/3] (big_vision's ImageNet recipe) instead of resizing to 9/8 of image_size and
      cropping at random.
    eval_crop_fraction: evaluation crops this fraction of the resized image (ImageNet: 224/256).
    shuffle: shuffle examples (default: when training).
    shuffle_buffer_size: tf.data shuffle buffer (digits are always shuffled in full).
    tfds_data_dir: TFDS data directory (None: TFDS_DATA_DIR, else TFDS's default).
  """
  dataset: str = DIGITS
  split: str = 'train'
  image_size: int = 32
  train: bool = True
  random_flip: bool = True
  inception_crop: bool = False
  eval_crop_fraction: float = 1.0
  shuffle: Optional[bool] = None
  shuffle_buffer_size: int = 10_000
  tfds_data_dir: Optional[str] = None

  def describe(self) -> Dict[str, Any]:
    """JSON-serializable identity; a resumed iterator must see the same one."""
    return {'kind': 'image', **dataclasses.asdict(self)}

  def batch_spec(self, batch_size: int) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """{feature: (shape, dtype)} of a batch of `batch_size` (nothing is read)."""
    size = self.image_size
    return {'image': ((batch_size, size, size, 3), np.dtype(np.float32)),
            'label': ((batch_size,), np.dtype(np.int32))}

  @property
  def _shuffle(self) -> bool:
    return self.train if self.shuffle is None else self.shuffle

  def batches(self, *, seed: int, batch_size: int, shard_index: int, num_shards: int,
              drop_remainder: bool, skip_batches: int) -> tf.data.Dataset:
    """One epoch of this host's shard, as batches, starting after `skip_batches` of them.

    Hosts get disjoint shards of equal size (up to num_shards - 1 examples are dropped).
    """
    host_only.hide_accelerators()
    if self.dataset == DIGITS:
      ds = _digits_shard(self.split, shard_index, num_shards)
    else:
      ds = _tfds_shard(self.dataset, self.split, self.tfds_data_dir, shard_index, num_shards,
                       shuffle_files=self._shuffle, seed=seed)
    if self._shuffle:
      ds = ds.shuffle(self.shuffle_buffer_size, seed=seed, reshuffle_each_iteration=False)
    ds = ds.enumerate().skip(skip_batches * batch_size)
    ds = ds.map(functools.partial(self._preprocess, seed=seed),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=drop_remainder)

  def _preprocess(self, position, example, *, seed):
    """Example (image encoded or `[h, w, c]` uint8) -> {'image': `[s, s, 3]` float32, 'label'}."""
    image = example['image']
    if image.dtype == tf.string:
      image = tf.io.decode_image(image, channels=3, expand_animations=False)
    elif image.shape[-1] == 1:
      image = tf.image.grayscale_to_rgb(image)
    image = tf.cast(image, tf.float32)
    size = self.image_size
    if self.train:
      crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(
          tf.stack([tf.cast(seed, tf.int64), position]), 2))
      if self.inception_crop:
        image = _inception_crop(image, size, crop_seed)
      else:
        padded = size + max(1, size // 8)
        image = tf.image.resize(image, [padded, padded], antialias=True)
        image = tf.image.stateless_random_crop(image, [size, size, 3], seed=crop_seed)
      if self.random_flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=flip_seed)
    else:
      image = _resize_small_central_crop(image, size, self.eval_crop_fraction)
    image = tf.clip_by_value(image * (2.0 / 255.0) - 1.0, -1.0, 1.0)
    return {'image': image, 'label': tf.cast(example['label'], tf.int32)}


def _digits_shard(split: str, shard_index: int, num_shards: int) -> tf.data.Dataset:
  images, labels = digits_split(split)
  n = len(labels) - len(labels) % num_shards
  images, labels = images[shard_index:n:num_shards], labels[shard_index:n:num_shards]
  return tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels})


def _tfds_shard(name: str, split: str, data_dir: Optional[str], shard_index: int,
                num_shards: int, *, shuffle_files: bool, seed: int) -> tf.data.Dataset:
  """This host's equal, disjoint slice of a TFDS split, images left encoded (decoded later)."""
  # TFDS reads TFDS_DATA_DIR once, at import; --tfds_data_dir sets it later (gin_utils).
  builder = tfds.builder(name, data_dir=data_dir or os.environ.get('TFDS_DATA_DIR'))
  if num_shards > 1:
    split = tfds.even_splits(split, n=num_shards, drop_remainder=True)[shard_index]
  try:
    ds = builder.as_dataset(
        split=split, shuffle_files=shuffle_files,
        read_config=tfds.ReadConfig(shuffle_seed=seed, skip_prefetch=True),
        decoders={'image': tfds.decode.SkipDecoding()})
  except (AssertionError, tfds.core.DatasetNotFoundError) as e:  # TFDS: "could not find data".
    raise ValueError(
        f"TFDS dataset {name!r} is not prepared in data_dir={builder.data_dir!r}. Run "
        f"`tfds build {name} --data_dir=DIR` (ImageNet needs the manual download) and set "
        f"ImagePipeline.tfds_data_dir=DIR, or use dataset={DIGITS!r} offline.") from e
  return ds.map(lambda x: {'image': x['image'], 'label': x['label']})


def _inception_crop(image: tf.Tensor, size: int, seed: tf.Tensor) -> tf.Tensor:
  """Random box of 5%-100% of the area, aspect ratio in [3/4, 4/3], resized to `[size, size]`."""
  begin, box, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.shape(image), tf.zeros([0, 0, 4], tf.float32), seed=seed, min_object_covered=0.0,
      aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.05, 1.0),
      use_image_if_no_bounding_boxes=True)
  crop = tf.slice(image, begin, box)
  crop.set_shape([None, None, 3])
  return tf.image.resize(crop, [size, size], antialias=True)


def _resize_small_central_crop(image: tf.Tensor, size: int, fraction: float) -> tf.Tensor:
  """Resizes the shorter side to round(size / fraction), then takes the central `[size, size]`."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f'ImagePipeline.eval_crop_fraction={fraction} must be in (0, 1].')
  small = round(size / fraction)
  hw = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = small / tf.reduce_min(hw)
  new_hw = tf.maximum(tf.cast(tf.round(hw * scale), tf.int32), size)
  image = tf.image.resize(image, new_hw, antialias=True)
  top, left = (new_hw[0] - size) // 2, (new_hw[1] - size) // 2
  return tf.image.crop_to_bounding_box(image, top, left, size, size)
