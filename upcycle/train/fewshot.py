"""Few-shot linear evaluation: closed-form ridge regression on frozen pre-logit features.

As in big_vision / vmoe: per class take `shots` training images, regress one-hot targets
in {-1, 1} on centered features with an L2 penalty, classify test images by the argmax.
"""

from typing import Tuple

import numpy as np


def select_shots(labels: np.ndarray, shots: int, num_classes: int, seed: int = 0) -> np.ndarray:
  """Indices of the first `shots` examples of every class after a seeded shuffle."""
  order = np.random.default_rng(seed).permutation(len(labels))
  picked = []
  for c in range(num_classes):
    of_class = order[labels[order] == c][:shots]
    if len(of_class) < shots:
      raise ValueError(f'Few-shot evaluation asked for {shots} shots of class {c}; the '
                       f'training features hold only {len(of_class)}.')
    picked.append(of_class)
  return np.concatenate(picked)


def ridge_fit(features: np.ndarray, labels: np.ndarray, num_classes: int,
              l2_reg: float) -> Tuple[np.ndarray, np.ndarray]:
  """-> (weights `[d, classes]`, bias `[classes]`) minimizing ||XW + b - Y||^2 + l2 ||W||^2."""
  x = features.astype(np.float64)
  mean = x.mean(axis=0, keepdims=True)
  x = x - mean
  y = 2.0 * np.eye(num_classes)[labels] - 1.0
  y_mean = y.mean(axis=0)
  gram = x.T @ x + l2_reg * np.eye(x.shape[1])
  w = np.linalg.solve(gram, x.T @ (y - y_mean))
  return w, y_mean - (mean @ w)[0]


def fewshot_accuracy(train_features: np.ndarray, train_labels: np.ndarray,
                     test_features: np.ndarray, test_labels: np.ndarray, *, shots: int,
                     num_classes: int, l2_reg: float = 2.0 ** 10, seed: int = 0) -> float:
  """Accuracy of the ridge classifier fit on `shots` examples per class."""
  index = select_shots(train_labels, shots, num_classes, seed)
  w, b = ridge_fit(train_features[index], train_labels[index], num_classes, l2_reg)
  predictions = np.argmax(test_features.astype(np.float64) @ w + b, axis=-1)
  return float(np.mean(predictions == test_labels))
