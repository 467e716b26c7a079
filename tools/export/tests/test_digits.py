"""The sklearn digits split and the trained digits CNN (`cleave_export.zoo:digits_cnn_trained`).

    ../../.venv/bin/python -m pytest -q tests -k digits

The CNN is trained twice in this module (once by a module-scoped fixture, once more to check
that training is reproducible), a few seconds each on one core.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cleave_export import datasets
from cleave_export.datasets import DIGITS_INPUT_NAME, accuracy, digits_split, digits_split_indices
from cleave_export.sources import forward_parameters
from cleave_export.zoo import DigitsCNN, digits_cnn_trained

MIN_TEST_ACCURACY = 0.97


@pytest.fixture(scope="module")
def split():
    return digits_split()


@pytest.fixture(scope="module")
def trained():
    return digits_cnn_trained()


def test_digits_split_shapes_dtypes_and_range(split):
    x_train, y_train, x_test, y_test = split
    assert x_train.dtype == x_test.dtype == torch.float32
    assert y_train.dtype == y_test.dtype == torch.int64
    assert x_train.shape == (len(y_train), 1, 8, 8) and x_test.shape == (len(y_test), 1, 8, 8)
    assert len(y_train) + len(y_test) == 1797
    assert (len(y_train), len(y_test)) == (1438, 359)
    for x in (x_train, x_test):
        assert x.min().item() == 0.0 and x.max().item() == 1.0  # pixels 0..16 divided by 16
    assert x_train.is_contiguous() and x_test.is_contiguous()


def test_digits_split_is_deterministic_disjoint_and_stratified(split):
    train, test = digits_split_indices()
    again_train, again_test = digits_split_indices()
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert set(train).isdisjoint(test)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))
    for a, b in zip(split, digits_split()):
        assert torch.equal(a, b)
    # Every class is held out at the same rate (within one image of 20%).
    _, y_train, _, y_test = split
    counts_train, counts_test = torch.bincount(y_train, minlength=10), torch.bincount(y_test, minlength=10)
    assert ((counts_test.double() - 0.2 * (counts_train + counts_test)).abs() <= 1).all()
    # Classes are mixed, not in label order.
    assert not torch.equal(y_test, y_test.sort().values)
    # Another seed is another split.
    other_train, other_test = digits_split_indices(seed=1)
    assert not np.array_equal(np.sort(test), np.sort(other_test))


def test_digits_input_name_matches_the_model():
    # The exporter names a bundle's inputs after forward()'s parameters; the test file must match.
    assert [p.name for p in forward_parameters(DigitsCNN())] == [DIGITS_INPUT_NAME]
    assert DigitsCNN.input_shape == (1, 8, 8)


def test_digits_cnn_trained_reaches_the_accuracy_floor(trained, split):
    _, _, x_test, y_test = split
    assert not trained.training
    acc = accuracy(trained, x_test, y_test)
    assert acc >= MIN_TEST_ACCURACY, f"test accuracy {acc:.4f}"


def test_digits_cnn_trained_is_bit_identical_and_leaves_global_state_alone(trained):
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    again = digits_cnn_trained()
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    assert torch.equal(torch.get_rng_state(), rng)
    a, b = trained.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_digits_shards_partition_the_train_split(tmp_path, split):
    x_train, y_train, _, _ = split
    shards = []
    for i in range(4):
        out = tmp_path / f"shard-{i}.safetensors"
        assert datasets.main(["digits", "--part", "train", "--shard", f"{i}/4", "--out", str(out)]) == 0
        shards.append(load_file(str(out)))
    assert sum(len(s["label"]) for s in shards) == len(y_train)
    assert torch.equal(shards[1][DIGITS_INPUT_NAME], x_train[1::4]) and torch.equal(shards[3]["label"], y_train[3::4])
    with pytest.raises(SystemExit):
        datasets.main(["digits", "--shard", "4/4", "--out", str(tmp_path / "bad.safetensors")])


def test_digits_cli_writes_the_test_split(tmp_path, split, capsys):
    out = tmp_path / "sub" / "digits-test.safetensors"
    assert datasets.main(["digits", "--out", str(out)]) == 0
    got = load_file(str(out))
    assert sorted(got) == sorted([DIGITS_INPUT_NAME, "label"])
    _, _, x_test, y_test = split
    assert torch.equal(got[DIGITS_INPUT_NAME], x_test) and torch.equal(got["label"], y_test)
    assert "x [359, 1, 8, 8] float32, label [359] int64" in capsys.readouterr().out
