"""scikit-learn's 8x8 digits (bundled with scikit-learn; nothing is downloaded) and their fixed,
stratified train/test split: the data the zoo's `digits_cnn_trained` trains on and `datasets`
writes for the host. Both import it from here, so neither imports the other for it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

DIGITS_TEST_FRACTION = 0.2
"""Share of each class held out for testing."""

DIGITS_INPUT_NAME = "x"
"""The input name of the digits bundles (DigitsCNN.forward's parameter)."""


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn; nothing is downloaded

    d = load_digits()
    images = np.asarray(d.images, dtype=np.float32) / np.float32(16.0)
    images.setflags(write=False)
    labels = np.asarray(d.target, dtype=np.int64)
    labels.setflags(write=False)
    return images, labels


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 sklearn digits: images float32 [N, 1, 8, 8] in [0, 1] (pixel / 16), labels int64 [N].
    Fresh tensors on every call (sklearn's files are read once per process)."""
    images, labels = _load_digits()
    return torch.tensor(images).unsqueeze(1).contiguous(), torch.tensor(labels)


def digits_split_indices(seed: int = 0, test_fraction: float = DIGITS_TEST_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) row indices into `digits_arrays()`: stratified (each class split alike),
    shuffled with numpy's legacy seeded generator, whose stream numpy keeps stable across versions."""
    _, labels = _load_digits()
    rng = np.random.RandomState(seed)
    train, test = [], []
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        rows = rows[rng.permutation(len(rows))]
        n_test = int(round(len(rows) * test_fraction))
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    train, test = np.concatenate(train), np.concatenate(test)
    # Mix the classes (the per-class blocks above are in label order).
    return train[rng.permutation(len(train))], test[rng.permutation(len(test))]


def digits_split(
    seed: int = 0, test_fraction: float = DIGITS_TEST_FRACTION
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test) of sklearn digits: a fixed, stratified split
    (80/20 per class by default: 1,438 train and 359 test rows)."""
    x, y = digits_arrays()
    train, test = digits_split_indices(seed, test_fraction)
    train, test = torch.from_numpy(train), torch.from_numpy(test)
    return x[train].contiguous(), y[train].contiguous(), x[test].contiguous(), y[test].contiguous()
