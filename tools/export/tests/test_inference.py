"""Inference stages (`stage_NNN.infer.pt`): written, hashed and named in the manifest; frozen,
`forward` only and loadable anywhere; their chain within 1e-5 of the references at every split
point; and the fallbacks: a stage whose folding is too far off, a stage that cannot take
channels_last activations, freezing that fails. Also `python -m cleave_export.eager_timing`.

    ../../.venv/bin/python -m pytest -q tests/test_inference.py
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cleave_export import eager_timing
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.compare import TOLERANCE, relative_error
from cleave_export.inference import inference_file, machine_specific

REL_TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Models for the fallbacks (exported as `tests.test_inference:NAME`).


class FoldLosesPrecision(nn.Module):
    """A convolution whose outputs sit near 1e4 and a batch norm that subtracts 1e4 and scales by
    about 100: computed as written, the subtraction keeps the float32 rounding of 1e4 (about
    1e-3, times 100); folded into the convolution it does not happen at all. Folding is more
    exact here, but it is not what the model computes, so the folded stage is refused."""

    input_shape = (2, 5, 5)

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.head = nn.Linear(4 * 5 * 5, 3)
        with torch.no_grad():
            self.block[0].bias.fill_(1e4)
            self.block[1].running_mean.fill_(1e4)
            self.block[1].running_var.fill_(1e-4)

    def forward(self, x):
        return self.head(torch.flatten(self.block(x), 1))


class ViewAfterConv(nn.Module):
    """`view` merges the channel and spatial dimensions, which a channels_last tensor cannot
    do without a copy: the stage holding it fails on what a channels_last convolution returns."""

    input_shape = (2, 5, 5)

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.shape[0], -1))


def fold_loses_precision():
    return FoldLosesPrecision()


def view_after_conv():
    return ViewAfterConv()


# ---------------------------------------------------------------------------------------------
# Bundles.


@dataclass
class Bundle:
    out: Path
    manifest: dict

    def load(self, files: list[str], **kw) -> list:
        return [torch.jit.load(str(self.out / f), **kw).eval() for f in files]

    def inference_stages(self, **kw) -> list:
        return self.load([s.get("inference_file", s["file"]) for s in self.manifest["stages"]], **kw)

    def reference(self, batch: int) -> tuple[list, list]:
        ref = load_file(str(self.out / f"reference_b{batch}.safetensors"))
        inputs = [ref[f"input.{v['name']}"] for v in self.manifest["inputs"]]
        return inputs, [ref[f"output.{v['name']}"] for v in self.manifest["cuts"][-1]["values"]]


def export(out: Path, source: str, **kw) -> Bundle:
    export_bundle(ExportOptions(source=source, out=out, **kw))
    return Bundle(out, json.loads((out / "manifest.json").read_text()))


@pytest.fixture(scope="module")
def resnet18(tmp_path_factory):
    # The suite's one resnet: every layer a stage, so that convolutions, batch norms, ReLUs and
    # the residual adds each sit in stages of their own.
    out = tmp_path_factory.mktemp("resnet18") / "resnet18"
    return export(out, "torchvision:resnet18", granularity="layer", input_shape=(3, 64, 64))


@pytest.fixture(scope="module")
def digits_top(tmp_path_factory):
    # Top granularity: each convolution shares its stage with its batch norm, which folds into it.
    out = tmp_path_factory.mktemp("digits_top") / "digits_top"
    return export(out, "cleave_export.zoo:digits_cnn", granularity="top", batch_max=16)


def run(stages: list, values: list) -> list:
    with torch.no_grad():
        for stage in stages:
            values = list(stage(*values))
    return values


def assert_within_tolerance(got: list, want: list):
    err = relative_error(got, want)
    assert err <= REL_TOL == TOLERANCE, f"relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------
# Files and manifest.


def test_every_stage_has_a_hashed_inference_file(resnet18):
    m = resnet18.manifest
    n = len(m["stages"])
    assert [s["inference_file"] for s in m["stages"]] == [f"stage_{i:03d}.infer.pt" for i in range(n)]
    assert [inference_file(i) for i in range(n)] == [s["inference_file"] for s in m["stages"]]
    for s in m["stages"]:
        digest = hashlib.sha256((resnet18.out / s["inference_file"]).read_bytes()).hexdigest()
        assert m["files"][s["inference_file"]] == digest
    # Stages holding convolution weights store them channels_last; the others have nothing to store so.
    conv_weights = ("conv1.weight", "conv2.weight", "downsample.0.weight")
    convs = [s["name"] for s in m["stages"] if any(name.endswith(conv_weights) for name in s["parameter_names"])]
    assert len(convs) == 20
    for s in m["stages"]:
        assert s["inference_passes"] == ["freeze", "fold", *(["channels_last"] if s["name"] in convs else [])], s["name"]
    assert m["format_version"] == 1


def test_inference_files_hold_forward_only_with_weights_inlined_and_nothing_machine_specific(resnet18):
    for s, stage in zip(resnet18.manifest["stages"], resnet18.inference_stages()):
        assert list(stage.named_parameters()) == [] and list(stage.named_buffers()) == []
        assert stage._c._method_names() == ["forward"], s["name"]
        assert machine_specific(stage.graph) is None


def test_folded_batch_norm_leaves_no_batch_norm_and_no_dropout(digits_top):
    m = digits_top.manifest
    assert [s["name"] for s in m["stages"]] == ["features", "classifier"]
    features, classifier = digits_top.load([s["inference_file"] for s in m["stages"]])
    assert "batch_norm" not in str(features.graph) and "conv2d" in str(features.graph)
    assert "dropout" not in str(classifier.graph)
    for batch in (1, 3):
        inputs, expected = digits_top.reference(batch)
        assert_within_tolerance(run([features, classifier], inputs), expected)


# ---------------------------------------------------------------------------------------------
# The chain of inference stages against the references.


def test_inference_chain_reproduces_the_references_at_every_split(resnet18):
    m = resnet18.manifest
    stages = resnet18.inference_stages()
    n = len(stages)
    for batch in (1, 3):
        inputs, expected = resnet18.reference(batch)
        assert_within_tolerance(run(stages, inputs), expected)
    # At every cut as the edge and the server run it: the edge's chain, then contiguous tensors
    # on the wire, then the server's chain.
    inputs, expected = resnet18.reference(1)
    channels_last_cuts = 0
    for s in range(n + 1):
        boundary = run(stages[:s], inputs)
        assert len(boundary) == len(m["cuts"][s]["values"])
        channels_last_cuts += any(not x.is_contiguous() for x in boundary)
        assert_within_tolerance(run(stages[s:], [x.contiguous() for x in boundary]), expected)
    # Activations stay channels_last from the first convolution to the pooling.
    assert channels_last_cuts >= n - 5


def test_inference_chain_is_faithful_at_the_exports_other_batch_sizes(resnet18):
    # Validation also ran at batch 8 (no reference file there): the model itself is the reference.
    from cleave_export.sources import load_source

    src = load_source("torchvision:resnet18", (3, 64, 64), 0)
    inputs = src.example_inputs(0, 8)
    with torch.no_grad():
        want = src(inputs)
    assert_within_tolerance(run(resnet18.inference_stages(), list(inputs))[0], want)


# ---------------------------------------------------------------------------------------------
# Fallbacks.


def test_a_stage_whose_folding_is_off_is_frozen_without_folding(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        b = export(tmp_path / "b", "tests.test_inference:fold_loses_precision", granularity="top")
    assert [(s["name"], s["inference_passes"]) for s in b.manifest["stages"]] == [
        ("block", ["freeze"]),
        ("flatten", ["freeze", "fold"]),
        ("head", ["freeze", "fold"]),
    ]
    assert caplog.records == []  # a stage that gets an inference file is no warning
    for batch in (1, 3):
        inputs, expected = b.reference(batch)
        assert_within_tolerance(run(b.inference_stages(), inputs), expected)


def test_a_stage_that_cannot_take_channels_last_makes_the_chain_contiguous(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        b = export(tmp_path / "b", "tests.test_inference:view_after_conv", granularity="op")
    stages = b.manifest["stages"]
    assert all(s["inference_passes"] == ["freeze", "fold"] for s in stages), stages
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without channels_last weights" in w and "cannot take what the inference stages before it produce" in w for w in warnings)
    inputs, expected = b.reference(3)
    assert_within_tolerance(run(b.inference_stages(), inputs), expected)


def test_freezing_that_fails_leaves_the_stage_files_alone(tmp_path, caplog, monkeypatch):
    def no_freezing(*_args, **_kwargs):
        raise RuntimeError("freezing is not available here")

    monkeypatch.setattr(torch.jit, "freeze", no_freezing)
    with caplog.at_level(logging.WARNING):
        b = export(tmp_path / "b", "tests.models:tiny_residual", granularity="top")
    m = b.manifest
    assert all("inference_file" not in s and "inference_passes" not in s for s in m["stages"])
    assert not list(b.out.glob("*.infer.pt"))
    assert sorted(m["files"]) == sorted([s["file"] for s in m["stages"]] + [r["file"] for r in m["references"]])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(m["stages"])
    assert all("gets no inference file" in w and "freezing fails: RuntimeError: freezing is not available here" in w for w in warnings)


# ---------------------------------------------------------------------------------------------
# python -m cleave_export.eager_timing


@pytest.fixture
def threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


LINE = r"{name} batch {batch}: median \d+\.\d{{3}} ms over 3 runs \(threads 1{tail}\)"


def test_eager_timing_prints_one_line_per_batch(capsys, threads_restored):
    assert eager_timing.main(["tests.models:tiny_residual", "--batches", "1,4", "--runs", "3", "--warmup", "1", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, batch in zip(lines, (1, 4)):
        assert re.fullmatch(LINE.format(name="eager", batch=batch, tail=""), line), line


def test_eager_timing_times_a_bundles_chains_beside_eager(resnet18, capsys, threads_restored):
    argv = ["torchvision:resnet18", "--input-shape", "3,64,64", "--batches", "2", "--runs", "3", "--threads", "1"]
    assert eager_timing.main([*argv, "--bundle", str(resnet18.out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ratio = r"; \d+\.\d{3}x eager"
    assert [bool(re.fullmatch(LINE.format(name=name, batch=2, tail=tail), line)) for name, tail, line in zip(
        ["eager", "stages", "inference stages"], ["", ratio, ratio], lines, strict=True
    )] == [True, True, True], lines
    # Another input shape than the bundle's, or another model, is named.
    assert eager_timing.main(["torchvision:resnet18", "--input-shape", "3,32,32", "--runs", "1", "--bundle", str(resnet18.out)]) == 2
    assert "another --input-shape" in capsys.readouterr().err
    assert eager_timing.main(["torchvision:resnet34", "--runs", "1", "--bundle", str(resnet18.out)]) == 2
    assert "was exported from torchvision:resnet18 with seed 0, not torchvision:resnet34" in capsys.readouterr().err


def test_eager_timing_times_the_edges_part_at_each_cut_beside_eager_running_the_same_layers(resnet18, capsys, threads_restored):
    manifest = json.loads((resnet18.out / "manifest.json").read_text())
    cuts = [2, 7, len(manifest["stages"])]
    argv = ["torchvision:resnet18", "--input-shape", "3,64,64", "--batches", "1,2", "--runs", "3", "--threads", "1"]
    assert eager_timing.main([*argv, "--bundle", str(resnet18.out), "--cuts", ",".join(map(str, cuts))]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [
        LINE.format(name=name, batch=f"{batch} cut {cut} \\({re.escape(manifest['cuts'][cut]['name'])}\\)", tail=tail)
        for batch in (1, 2)
        for cut in cuts
        for name, tail in (("eager", ""), ("inference stages", r"; \d+\.\d{3}x eager"))
    ]
    assert len(lines) == len(expected) + 1, lines
    for pattern, line in zip(expected, lines):
        assert re.fullmatch(pattern, line), (pattern, line)
    ratios = [float(re.search(r"; (\d+\.\d{3})x eager", line)[1]) for line in lines[:-1] if "x eager" in line]
    worst = max(ratios)
    assert re.fullmatch(rf"worst inference stages / eager: {worst:.3f}x \(batch [12], cut \d+\)", lines[-1]), lines[-1]
    # Cuts with no stage before them, or --cuts without a bundle, are refused.
    assert eager_timing.main([*argv, "--bundle", str(resnet18.out), "--cuts", "0,3"]) == 2
    assert "cuts [0] are outside 1.." in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eager_timing.main([*argv, "--cuts", "3"])
    assert "--cuts needs --bundle" in capsys.readouterr().err
