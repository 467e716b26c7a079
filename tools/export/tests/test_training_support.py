"""What split training needs from a bundle: every stage's `cleave_buffers` method (buffers as
(name, tensor) pairs that alias the stage's own, since libtorch's C++ API lists parameters but
not buffers), the parameter and buffer names of every stage in the manifest, tied weights held
by more than one stage (`exporter.shared_parameters`), and the digits train split.

    ../../.venv/bin/python -m pytest -q tests/test_training_support.py

Only tiny models are exported (a few seconds in all).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cleave_export import datasets
from cleave_export.bundle import BUFFERS_METHOD, ExportOptions, export_bundle
from cleave_export.datasets import DIGITS_INPUT_NAME, digits_split, digits_split_indices, write_digits
from cleave_export.partition import partition, stage_module
from cleave_export.sources import load_source
from cleave_export.specs import Probe
from cleave_export.tracing import record_values, trace
from tests.models import BnDropoutResidual

# ---------------------------------------------------------------------------------------------
# Models exported as `tests.test_training_support:NAME`.


def bn_residual_warmed():
    """BnDropoutResidual whose batch-norm statistics are not the initial zeros and ones, so that
    comparing them with a stage's buffers means something."""
    model = BnDropoutResidual().train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 4, 6, 6) * 2 + 0.5)
    return model


class TiedLM(nn.Module):
    """A language-model shape with its output head tied to the embedding: at op granularity the
    embedding (stage 0) and the head (stage 3) hold one Parameter."""

    vocab, seq, dim = 20, 5, 8

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, self.dim)
        self.body = nn.Linear(self.dim, self.dim)
        self.head = nn.Linear(self.dim, self.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(tokens))))

    def example_inputs(self, batch: int):
        return (torch.randint(0, self.vocab, (batch, self.seq)),)


class TiedInOneStage(nn.Module):
    """TiedLM inside one top-level module: at `top` granularity both uses fall in one stage."""

    def __init__(self):
        super().__init__()
        self.lm = TiedLM()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens) * 2

    def example_inputs(self, batch: int):
        return self.lm.example_inputs(batch)


def tied_lm():
    return TiedLM()


def tied_in_one_stage():
    return TiedInOneStage()


# ---------------------------------------------------------------------------------------------
# Bundles, exported once per module.


@dataclass
class Bundle:
    source: str
    out: Path
    manifest: dict

    def stage(self, i: int):
        return torch.jit.load(str(self.out / self.manifest["stages"][i]["file"]))

    def stage_named(self, name: str):
        (i,) = [s["index"] for s in self.manifest["stages"] if s["name"] == name]
        return self.stage(i)

    def model(self) -> nn.Module:
        """The exported model, rebuilt exactly as the exporter built it (same seed)."""
        return load_source(self.source, None, self.manifest["model"]["seed"]).model


def _export(tmp_path_factory, name: str, source: str, **kw) -> Bundle:
    out = tmp_path_factory.mktemp(name) / name
    export_bundle(ExportOptions(source=source, out=out, **kw))
    return Bundle(source, out, json.loads((out / "manifest.json").read_text()))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return _export(tmp_path_factory, "digits", "cleave_export.zoo:digits_cnn", granularity="op", batch_max=16)


@pytest.fixture(scope="module")
def bn_residual(tmp_path_factory):
    return _export(
        tmp_path_factory, "bn_residual", "tests.models:bn_dropout_residual",
        granularity="op", batch_max=64, reference_batches=(1, 3, 8),
    )


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    return _export(tmp_path_factory, "warmed", "tests.test_training_support:bn_residual_warmed", granularity="op")


@pytest.fixture(scope="module")
def warmed_traced(tmp_path_factory):
    """The warmed model with every stage traced: torch.jit.script refuses everything."""

    def refuse(*args, **kwargs):
        raise RuntimeError("scripting disabled by the test")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.jit, "script", refuse)
        return _export(
            tmp_path_factory, "warmed_traced", "tests.test_training_support:bn_residual_warmed", granularity="op"
        )


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _export(tmp_path_factory, "tied", "tests.test_training_support:tied_lm", granularity="op")


@pytest.fixture(scope="module")
def tied_one_stage(tmp_path_factory):
    return _export(tmp_path_factory, "tied_one", "tests.test_training_support:tied_in_one_stage", granularity="top")


def _buffers(stage) -> list[tuple[str, torch.Tensor]]:
    return list(getattr(stage, BUFFERS_METHOD)())


# ---------------------------------------------------------------------------------------------
# cleave_buffers.


@pytest.mark.parametrize("name", ["digits", "bn_residual", "warmed", "warmed_traced", "tied"])
def test_every_stage_lists_its_buffers_in_manifest_order(name, request):
    bundle = request.getfixturevalue(name)
    for s in bundle.manifest["stages"]:
        stage = bundle.stage(s["index"])
        got = _buffers(stage)
        assert [n for n, _ in got] == s["buffer_names"], s["name"]
        own = dict(stage.named_buffers())
        for n, t in got:
            assert t.data_ptr() == own[n].data_ptr(), (s["name"], n)


@pytest.mark.parametrize("name", ["warmed", "warmed_traced"])
def test_cleave_buffers_values_are_the_models_buffers(name, request):
    bundle = request.getfixturevalue(name)
    want = dict(bundle.model().named_buffers())
    assert float(want["bn.running_var"].sub(1).abs().max()) > 0.01, "the warm-up should move the statistics"
    seen = []
    for s in bundle.manifest["stages"]:
        for n, t in _buffers(bundle.stage(s["index"])):
            assert torch.equal(t, want[n]), n
            seen.append(n)
    assert seen == list(want)
    assert {s["compiler"] for s in bundle.manifest["stages"]} == {"trace" if "traced" in name else "script"}


def test_scripted_stage_buffers_share_storage_with_the_stage(warmed):
    stage = warmed.stage_named("bn")
    (mean_name, mean), (var_name, var), (count_name, count) = _buffers(stage)
    assert (mean_name, var_name, count_name) == ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
    before_mean, before_count = mean.clone(), int(count)
    # A train-mode forward updates the running statistics in place: the tensors returned
    # before it see the update, so they are the stage's buffers, not copies.
    stage.train()
    with torch.no_grad():
        stage(torch.randn(6, 4, 6, 6), torch.randn(6, 4, 6, 6) * 3 + 2)
    assert not torch.allclose(mean, before_mean)
    assert int(count) == before_count + 1
    # And writing into them writes the stage's buffers (how a trainer restores statistics).
    var.copy_(torch.full_like(var, 4.0))
    mean.zero_()
    stage.eval()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        _, y = stage(torch.zeros(2, 4, 6, 6), x)
    bn = stage.bn
    want = x / torch.sqrt(torch.tensor(4.0) + bn.eps) * bn.weight[None, :, None, None] + bn.bias[None, :, None, None]
    assert torch.allclose(y, want, atol=1e-6)


def test_traced_stage_buffers_share_storage_with_the_stage(warmed_traced):
    stage = warmed_traced.stage_named("bn")
    (_, mean), (_, var), _ = _buffers(stage)
    var.fill_(4.0)
    mean.zero_()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        _, y = stage(torch.zeros(2, 4, 6, 6), x)
    w, b = dict(stage.named_parameters())["bn.weight"], dict(stage.named_parameters())["bn.bias"]
    assert torch.allclose(y, x / torch.sqrt(torch.tensor(4.0 + 1e-5)) * w[None, :, None, None] + b[None, :, None, None],
                          atol=1e-6)


def test_stage_without_buffers_returns_an_empty_list(digits):
    first = digits.manifest["stages"][0]
    assert first["buffer_names"] == [] and _buffers(digits.stage(0)) == []


# ---------------------------------------------------------------------------------------------
# Parameter and buffer names in the manifest.


def test_digits_names_are_the_models_state_dict_keys(digits):
    model = digits.model()
    names = [n for s in digits.manifest["stages"] for n in s["parameter_names"] + s["buffer_names"]]
    assert names == list(model.state_dict())
    for s in digits.manifest["stages"]:
        stage = digits.stage(s["index"])
        assert [n for n, _ in stage.named_parameters()] == s["parameter_names"]
        assert s["parameters"] == sum(model.get_parameter(n).numel() for n in s["parameter_names"])
    by_name = {s["name"]: s for s in digits.manifest["stages"]}
    assert by_name["features.1"]["parameter_names"] == ["features.1.weight", "features.1.bias"]
    assert by_name["features.1"]["buffer_names"] == [
        "features.1.running_mean", "features.1.running_var", "features.1.num_batches_tracked",
    ]
    assert by_name["classifier.3"]["parameter_names"] == by_name["classifier.3"]["buffer_names"] == []


def test_bn_dropout_residual_bundle(bn_residual):
    m = bn_residual.manifest
    assert m["batch"] == {"min": 1, "max": 64}
    assert [r["batch_size"] for r in m["references"]] == [1, 3, 8]
    assert all(s["compiler"] == "script" for s in m["stages"])
    cuts = [[v["name"] for v in c["values"]] for c in m["cuts"]]
    # Inside the residual block every cut carries the skip input and the branch.
    assert cuts[1:6] == [["x", "conv1"], ["x", "bn"], ["x", "relu"], ["x", "drop1"], ["x", "conv2"]]
    assert cuts[-1] == ["head"] and m["cuts"][-1]["tensors"][0]["shape"] == ["B", 3]
    assert m["inputs"][0]["spec"]["shape"] == ["B", 4, 6, 6] and m["inputs"][0]["spec"]["dtype"] == "float32"
    names = [n for s in m["stages"] for n in s["parameter_names"] + s["buffer_names"]]
    assert names == list(BnDropoutResidual().state_dict())
    assert m["exporter"]["shared_parameters"] == []
    drop1 = bn_residual.stage_named("drop1")
    x, h = torch.ones(2, 4, 6, 6), torch.ones(64, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(drop1.eval()(x, h)[1], h)
        dropped = drop1.train()(x, h)[1]
        assert torch.equal(drop1(x, h)[0], x)  # the skip passes through untouched
    assert (dropped == 0).any() and set(dropped.unique().tolist()) <= {0.0, torch.tensor(1 / 0.7).item()}


# ---------------------------------------------------------------------------------------------
# Tied weights.


def test_stage_modules_hold_the_models_own_parameters():
    """Identity is how shared parameters are found: the stage graph modules must hold the very
    Parameter objects of the model, not copies."""
    model = TiedLM().eval()
    gm, _ = trace(model, 1)
    recorded = [record_values(gm, model.example_inputs(b)) for b in (2, 3)]
    part = partition(gm, None, recorded, [Probe(2), Probe(3)])
    sgms = [stage_module(gm, part, i) for i in range(len(part.stages))]
    held = [(n, p) for sgm in sgms for n, p in sgm.named_parameters()]
    assert [n for n, _ in held] == ["embed.weight", "body.weight", "body.bias", "head.weight"]
    for n, p in held:
        assert p is model.get_parameter(n)
    assert held[0][1] is held[3][1]


def test_tied_weight_across_stages_is_listed(tied):
    m = tied.manifest
    assert [s["name"] for s in m["stages"]] == ["embed", "body", "relu", "head"]
    assert [s["parameter_names"] for s in m["stages"]] == [["embed.weight"], ["body.weight", "body.bias"], [], ["head.weight"]]
    assert m["exporter"]["shared_parameters"] == [
        {"names": ["embed.weight", "head.weight"], "stages": [0, 3], "aliases": ["embed.weight", "head.weight"]}
    ]
    # Each stage file holds its own copy, equal at export time.
    embed, head = tied.stage(0), tied.stage(3)
    assert torch.equal(dict(embed.named_parameters())["embed.weight"], dict(head.named_parameters())["head.weight"])


def test_tie_inside_one_stage_is_not_listed_and_stays_aliased(tied_one_stage):
    m = tied_one_stage.manifest
    assert [s["name"] for s in m["stages"]] == ["lm", "mul"]
    assert m["exporter"]["shared_parameters"] == []
    # named_parameters() lists the tied tensor once, under its first name ...
    assert m["stages"][0]["parameter_names"] == ["lm.embed.weight", "lm.body.weight", "lm.body.bias"]
    # ... and the saved stage keeps both names on one tensor.
    stage = tied_one_stage.stage(0)
    assert stage.lm.embed.weight.data_ptr() == stage.lm.head.weight.data_ptr()


@pytest.mark.parametrize("name", ["digits", "bn_residual", "warmed"])
def test_untied_models_share_nothing(name, request):
    assert request.getfixturevalue(name).manifest["exporter"]["shared_parameters"] == []


# ---------------------------------------------------------------------------------------------
# Digits train and test parts.


def test_digits_parts_have_the_split_sizes_and_are_disjoint():
    train, test = digits_split_indices()
    assert (len(train), len(test)) == (1438, 359)
    assert not set(train.tolist()) & set(test.tolist())
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))


@pytest.mark.parametrize("part,rows", [("train", 1438), ("test", 359)])
def test_digits_cli_writes_either_part(tmp_path, part, rows, capsys):
    out = tmp_path / f"digits-{part}.safetensors"
    assert datasets.main(["digits", "--part", part, "--out", str(out)]) == 0
    got = load_file(str(out))
    assert sorted(got) == sorted([DIGITS_INPUT_NAME, "label"])
    x, y = got[DIGITS_INPUT_NAME], got["label"]
    assert x.dtype == torch.float32 and x.shape == (rows, 1, 8, 8)
    assert y.dtype == torch.int64 and y.shape == (rows,)
    x_train, y_train, x_test, y_test = digits_split()
    want_x, want_y = (x_train, y_train) if part == "train" else (x_test, y_test)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert f"({part} split): x [{rows}, 1, 8, 8] float32, label [{rows}] int64" in capsys.readouterr().out


def test_digits_default_part_is_test_and_bad_part_is_refused(tmp_path, capsys):
    default, test = tmp_path / "default.safetensors", tmp_path / "test.safetensors"
    assert datasets.main(["digits", "--out", str(default)]) == 0
    write_digits(test, "test")
    assert default.read_bytes() == test.read_bytes()
    with pytest.raises(SystemExit) as e:
        datasets.main(["digits", "--part", "valid", "--out", str(tmp_path / "x.safetensors")])
    assert e.value.code == 2
    assert "invalid choice: 'valid'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="part 'valid'"):
        write_digits(tmp_path / "y.safetensors", "valid")
