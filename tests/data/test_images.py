"""Image pipelines: digits values against scikit-learn, augmentation, TFDS path on mock data."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn import datasets

from upcycle.data import images
from upcycle.data import iterator


def _epoch(pipeline, batch_size=300, **kwargs):
  it = iterator.DataIterator(pipeline, batch_size=batch_size, seed=kwargs.pop('seed', 0),
                             num_epochs=1, drop_remainder=False, **kwargs)
  batches = list(it)
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_digits_split():
  train_x, train_y = images.digits_split('train')
  val_x, val_y = images.digits_split('validation')
  assert train_x.shape == (1500, 8, 8, 1) and val_x.shape == (297, 8, 8, 1)
  assert train_x.dtype == np.uint8 and train_y.dtype == np.int32
  assert set(np.unique(val_y)) == set(range(10))
  rows = lambda x: {r.tobytes() for r in x}
  assert not rows(train_x) & rows(val_x)
  digits = datasets.load_digits()
  assert rows(train_x) | rows(val_x) == rows(
      np.round(digits.images * 255 / 16).astype(np.uint8)[..., None])


def test_digits_eval_values_match_sklearn():
  out = _epoch(images.ImagePipeline(split='validation', image_size=8, train=False))
  x, y = images.digits_split('validation')
  assert out['image'].shape == (297, 8, 8, 3) and out['image'].dtype == np.float32
  assert out['label'].dtype == np.int32
  np.testing.assert_array_equal(out['label'], y)  # Unshuffled, in split order.
  expected = x[..., 0].astype(np.float32) / 255 * 2 - 1
  for c in range(3):  # Grayscale -> three equal channels, [0, 16] -> [-1, 1].
    np.testing.assert_allclose(out['image'][..., c], expected, atol=1e-6)


def test_digits_train_augmentation():
  pipeline = images.ImagePipeline(split='train', image_size=16, train=True)
  a, b = _epoch(pipeline, seed=1), _epoch(pipeline, seed=1)
  c = _epoch(pipeline, seed=2)
  assert a['image'].shape == (1500, 16, 16, 3)
  assert a['image'].min() >= -1 and a['image'].max() <= 1 and a['image'].min() == -1
  np.testing.assert_array_equal(a['image'], b['image'])
  assert not np.array_equal(a['label'], c['label'])  # Seeded shuffle.
  np.testing.assert_array_equal(np.sort(a['label']), np.sort(images.digits_split('train')[1]))
  # Crops and flips: the same digit under another seed looks different.
  plain = _epoch(images.ImagePipeline(split='train', image_size=16, train=True, shuffle=False,
                                      random_flip=False), seed=1)
  plain2 = _epoch(images.ImagePipeline(split='train', image_size=16, train=True, shuffle=False,
                                       random_flip=False), seed=2)
  assert np.mean(np.abs(plain['image'] - plain2['image']).max(axis=(1, 2, 3)) > 0.1) > 0.5


def test_inception_crop_and_eval_crop_fraction():
  train = _epoch(images.ImagePipeline(split='validation', image_size=12, inception_crop=True))
  assert train['image'].shape == (297, 12, 12, 3)
  assert np.all(np.abs(train['image']) <= 1)
  evaluation = _epoch(images.ImagePipeline(
      split='validation', image_size=6, train=False, eval_crop_fraction=0.75))
  assert evaluation['image'].shape == (297, 6, 6, 3)  # 8 -> resize 8 -> central 6x6.
  x = images.digits_split('validation')[0][..., 0].astype(np.float32) / 255 * 2 - 1
  np.testing.assert_allclose(evaluation['image'][..., 0], x[:, 1:7, 1:7], atol=1e-6)


def test_tfds_pipeline_on_mock_data(tmp_path):
  pipeline = images.ImagePipeline(dataset='cifar10', split='train', image_size=16,
                                  tfds_data_dir=str(tmp_path))
  with pytest.raises(ValueError, match='tfds build cifar10'):
    next(iterator.DataIterator(pipeline, batch_size=4, seed=0))
  with tfds.testing.mock_data(num_examples=24):
    batch = next(iterator.DataIterator(pipeline, batch_size=4, seed=0, shard_index=1,
                                       num_shards=2))
    evaluation = _epoch(images.ImagePipeline(
        dataset='cifar10', split='test', image_size=16, train=False, eval_crop_fraction=0.875,
        tfds_data_dir=str(tmp_path)), batch_size=5)
  assert batch['image'].shape == (4, 16, 16, 3) and batch['image'].dtype == np.float32
  assert batch['label'].shape == (4,) and batch['label'].dtype == np.int32
  assert np.all(np.abs(batch['image']) <= 1)
  assert evaluation['image'].shape == (24, 16, 16, 3)
