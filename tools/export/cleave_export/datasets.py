"""Small datasets that ship with the tools (no downloads): a fixed train/test split of
scikit-learn's 8x8 digits, for training the zoo's `DigitsCNN` and for feeding the host real
inputs whose predictions can be scored.

    python -m cleave_export.datasets digits --out bundles/digits-test.safetensors [--part test] [--report]
    python -m cleave_export.datasets digits --out bundles/digits-train.safetensors --part train

writes one split as a safetensors file (`--part test`, the default: the 359 held-out rows;
`--part train`: the 1,438 training rows): tensor `x` ([N, 1, 8, 8] float32, the input name of
bundles exported from `cleave_export.zoo:digits_cnn` and `digits_cnn_trained`) and tensor
`label` ([N] int64). The host reads the tensors named like the bundle's inputs and ignores the
others; split training reads both.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

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


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of rows whose arg-max prediction is the label (the model is put in eval mode)."""
    model.eval()
    return (model(x).argmax(dim=1) == y).double().mean().item()


DIGITS_PARTS = ("train", "test")
"""The splits `write_digits` can write."""


def write_digits(out: Path, part: str = "test", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes one split of `digits_split(seed)` to `out` (tensors `x` float32 [N, 1, 8, 8] and
    `label` int64 [N]); `part` is "train" (1,438 rows) or "test" (359 rows). Returns the tensors."""
    from safetensors.torch import save_file

    if part not in DIGITS_PARTS:
        raise ValueError(f"part {part!r}: expected one of {', '.join(DIGITS_PARTS)}")
    x_train, y_train, x_test, y_test = digits_split(seed)
    x, y = (x_train, y_train) if part == "train" else (x_test, y_test)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({DIGITS_INPUT_NAME: x, "label": y}, str(out))
    return x, y


def write_digits_test(out: Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the test split to `out` (tensors `x` and `label`); returns them."""
    return write_digits(out, "test", seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cleave_export.datasets",
        description="Write a dataset split as a safetensors file the cleave host can read as input.",
    )
    p.add_argument("dataset", choices=["digits"], help="digits: sklearn's 8x8 digits, split 80/20 per class")
    p.add_argument("--out", required=True, type=Path, help="safetensors file to write")
    p.add_argument("--part", choices=DIGITS_PARTS, default="test",
                   help="which split to write: test (held out, 359 rows; the default) or train (1,438 rows)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.add_argument("--report", action="store_true",
                   help="also train cleave_export.zoo:digits_cnn_trained and print its test accuracy")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    x, y = write_digits(a.out, a.part, a.seed)
    print(f"wrote {a.out} ({a.part} split): {DIGITS_INPUT_NAME} {list(x.shape)} float32, label {list(y.shape)} int64")
    if a.report:
        import time

        from cleave_export.zoo import digits_cnn_trained

        _, _, x_test, y_test = digits_split(a.seed)
        start = time.perf_counter()
        model = digits_cnn_trained(split_seed=a.seed)
        took = time.perf_counter() - start
        print(
            f"digits_cnn_trained: test accuracy {accuracy(model, x_test, y_test):.4f} ({len(y_test)} images), "
            f"trained in {took:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
