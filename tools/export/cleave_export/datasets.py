"""Small datasets that ship with the tools (no downloads): a fixed train/test split of
scikit-learn's 8x8 digits, for training the zoo's `DigitsCNN` and for feeding the host real
inputs whose predictions can be scored.

    python -m cleave_export.datasets digits --out bundles/digits-test.safetensors [--part test] [--report]
    python -m cleave_export.datasets digits --out bundles/digits-train.safetensors --part train
    python -m cleave_export.datasets digits --out bundles/fed/digits-train-1.safetensors --part train --shard 1/4

writes one split as a safetensors file (`--part test`, the default: the 359 held-out rows;
`--part train`: the 1,438 training rows): tensor `x` ([N, 1, 8, 8] float32, the input name of
bundles exported from `cleave_export.zoo:digits_cnn` and `digits_cnn_trained`) and tensor
`label` ([N] int64). The host reads the tensors named like the bundle's inputs and ignores the
others; split training reads both. `--shard I/N` writes shard I (from 0) of N: rows I, I + N,
I + 2N, ... of the split, an edge's own data when several edges train together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The data itself lives in `cleave_export.digits` (the zoo trains on it too); its public names
# are re-exported here, where they have always been importable from.
from cleave_export.digits import (
    DIGITS_INPUT_NAME,
    DIGITS_TEST_FRACTION,
    digits_arrays,
    digits_split,
    digits_split_indices,
)

__all__ = [
    "DIGITS_INPUT_NAME",
    "DIGITS_PARTS",
    "DIGITS_TEST_FRACTION",
    "accuracy",
    "digits_arrays",
    "digits_split",
    "digits_split_indices",
    "main",
    "write_digits",
    "write_digits_test",
]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of rows whose arg-max prediction is the label (the model is put in eval mode)."""
    model.eval()
    return (model(x).argmax(dim=1) == y).double().mean().item()


DIGITS_PARTS = ("train", "test")
"""The splits `write_digits` can write."""


def write_digits(out: Path, part: str = "test", seed: int = 0, shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes one split of `digits_split(seed)` to `out` (tensors `x` float32 [N, 1, 8, 8] and
    `label` int64 [N]); `part` is "train" (1,438 rows) or "test" (359 rows); `shard` (I, N) keeps
    rows I, I + N, ... of it. Returns the tensors."""
    from safetensors.torch import save_file

    if part not in DIGITS_PARTS:
        raise ValueError(f"part {part!r}: expected one of {', '.join(DIGITS_PARTS)}")
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: expected I/N with 0 <= I < N")
    x_train, y_train, x_test, y_test = digits_split(seed)
    x, y = (x_train, y_train) if part == "train" else (x_test, y_test)
    x, y = x[index::count].contiguous(), y[index::count].contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({DIGITS_INPUT_NAME: x, "label": y}, str(out))
    return x, y


def write_digits_test(out: Path, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the test split to `out` (tensors `x` and `label`); returns them."""
    return write_digits(out, "test", seed)


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, like 1/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= I < N")
    return index, count


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
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                   help="write shard I (from 0) of N: rows I, I + N, ... of the split (default: all of it)")
    p.add_argument("--report", action="store_true",
                   help="also train cleave_export.zoo:digits_cnn_trained and print its test accuracy")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    x, y = write_digits(a.out, a.part, a.seed, a.shard)
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
