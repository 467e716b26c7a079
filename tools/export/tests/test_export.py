"""Exporter tests: manifest contents, symbolic shapes, value trees, the stage chain against its
references at every split point, and a clear error for every input it cannot take.

Run from tools/export (the exporter imports `tests.models:NAME` as a module path):

    ../../.venv/bin/python -m pytest -q tests

Each bundle is exported once per module (module-scoped fixtures) into pytest's temporary
directory; only tiny models and one small torchvision model are exported, so the suite runs
in well under a minute on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save
from torch import nn

import cleave_export
from cleave_export import ExportError, cli
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.compare import relative_error
from cleave_export.partition import parse_granularity
from cleave_export.sources import load_source
from cleave_export.specs import (
    Probe,
    Unrepresentable,
    affine_dim,
    bytes_per_sample,
    check_value,
    flatten_tensors,
    parse_affine,
    shape_at,
    symbolic_dim,
    tensor_leaves,
    torchscript_type,
    value_spec,
)
from cleave_export.zoo import DigitsCNN

EXPORT_ROOT = Path(__file__).resolve().parent.parent
"""tools/export: where `python -m cleave_export` runs so that `tests.models` imports."""

REL_TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Models defined here for failure paths (exported as `tests.test_export:NAME`). They live in
# this file rather than models.py, which the Makefile's test bundles depend on.


class _SmallBatchGate(nn.Module):
    """Refuses batches above 4. torch.fx cannot trace its `if`, so the exporter keeps it whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            raise RuntimeError("batch larger than 4")
        return x


class SmallBatchesOnly(nn.Module):
    """Works at the probe batch sizes (2 and 3) and at 1, fails at the validation batch 8."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.gate = _SmallBatchGate()

    def forward(self, x):
        return self.gate(self.fc(x))


class TraceDiffers(nn.Module):
    """Takes another branch while torch.fx traces it, so the traced graph is not the model."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc(x)
        if torch.fx._symbolic_trace.is_fx_tracing():
            return y
        return y * 2


class NumpyInForward(nn.Module):
    """Reads a value out of a tensor with .numpy() in its own forward: neither torch.fx nor
    torch.export can follow it."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y / float(y.abs().max().detach().numpy())


class _ScaleByNumpy(nn.Module):
    """The same in a submodule: kept whole, but TorchScript has no .numpy(), so its stage is
    traced, and the trace keeps the value as a constant."""

    def forward(self, y):
        return y / float(y.abs().max().detach().numpy())


class _HalveLarge(nn.Module):
    """Branches on a value read out with .item(): kept whole, and scriptable."""

    def forward(self, y):
        if y.abs().max().item() > 1.0:
            return y / 2
        return y


class DataInSubmodule(nn.Module):
    input_shape = (4,)

    def __init__(self, scale: nn.Module):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.scale(self.fc(x))


def small_batches_only():
    return SmallBatchesOnly()


def trace_differs():
    return TraceDiffers()


def numpy_in_forward():
    return NumpyInForward()


def numpy_in_submodule():
    return DataInSubmodule(_ScaleByNumpy())


def item_in_submodule():
    return DataInSubmodule(_HalveLarge())


# ---------------------------------------------------------------------------------------------
# Bundles, exported once per module.


@dataclass
class Bundle:
    source: str
    input_shape: tuple[int, ...] | None
    out: Path
    manifest: dict
    """manifest.json as read back from disk."""
    report_manifest: dict
    """The manifest export_bundle returned."""

    def stages(self) -> list:
        return [torch.jit.load(str(self.out / s["file"])).eval() for s in self.manifest["stages"]]


def _export(tmp_path_factory, name: str, source: str, **kw) -> Bundle:
    out = tmp_path_factory.mktemp(name) / name
    report = export_bundle(ExportOptions(source=source, out=out, **kw))
    manifest = json.loads((out / "manifest.json").read_text())
    return Bundle(source, kw.get("input_shape"), out, manifest, report.manifest)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return _export(tmp_path_factory, "digits", "cleave_export.zoo:digits_cnn", granularity="op", batch_max=16)


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    return _export(tmp_path_factory, "residual", "tests.models:tiny_residual", granularity="op")


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    return _export(tmp_path_factory, "transformer", "tests.models:tiny_transformer", granularity="op", batch_max=16)


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory):
    # The suite's one torchvision export: small input, default granularity (block).
    return _export(tmp_path_factory, "mobilenet", "torchvision:mobilenet_v3_small", input_shape=(3, 32, 32))


ALL_BUNDLES = ["digits", "residual", "transformer", "mobilenet"]


# ---------------------------------------------------------------------------------------------
# Helpers.


def run_stages(stages: list, values: list) -> list:
    with torch.no_grad():
        for stage in stages:
            values = list(stage(*values))
    return values


def assemble(tree: dict, by_name: dict):
    """The model's output structure rebuilt from the last cut's values (the manifest's `output`)."""
    if tree["type"] == "ref":
        return by_name[tree["name"]]
    if tree["type"] == "tuple":
        return tuple(assemble(t, by_name) for t in tree["items"])
    if tree["type"] == "list":
        return [assemble(t, by_name) for t in tree["items"]]
    assert tree["type"] == "dict", tree
    return {item["key"]: assemble(item["value"], by_name) for item in tree["items"]}


def assert_close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.abs().max().item()
    assert scale > 0, "a reference output of zeros would make the comparison vacuous"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= REL_TOL * scale, f"max abs error {err:.3e} > {REL_TOL} * {scale:.3e}"


def reference(bundle: Bundle, batch: int) -> tuple[list, list]:
    """(inputs, expected last-cut values) of a reference file, checked against the manifest."""
    m = bundle.manifest
    ref = load_file(str(bundle.out / f"reference_b{batch}.safetensors"))
    first, last = m["cuts"][0], m["cuts"][-1]
    assert sorted(ref) == sorted(
        [f"input.{t['name']}" for t in first["tensors"]] + [f"output.{t['name']}" for t in last["tensors"]]
    )
    for prefix, cut in (("input", first), ("output", last)):
        for t in cut["tensors"]:
            x = ref[f"{prefix}.{t['name']}"]
            assert cleave_export.specs.DTYPE_NAMES[x.dtype] == t["dtype"]
            assert list(x.shape) == shape_at(t["shape"], batch)
    inputs = [ref[f"input.{v['name']}"] for v in m["inputs"]]
    expected = [ref[f"output.{v['name']}"] for v in last["values"]]
    return inputs, expected


def parent_listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# ---------------------------------------------------------------------------------------------
# 1. Manifest structure.


@pytest.mark.parametrize("name", ALL_BUNDLES)
def test_manifest_structure_and_file_hashes(name, request):
    b: Bundle = request.getfixturevalue(name)
    m = b.manifest
    assert m == b.report_manifest
    assert m["format"] == "cleave-bundle"
    assert m["format_version"] == 1 == cleave_export.FORMAT_VERSION
    assert m["model"]["source"] == b.source and m["model"]["seed"] == 0
    assert m["exporter"]["version"] == cleave_export.__version__
    assert m["exporter"]["torch"] == torch.__version__
    assert m["exporter"]["tracer"] == "torch.fx"

    n = len(m["stages"])
    assert n >= 2
    stage_files = [f"stage_{i:03d}.pt" for i in range(n)]
    assert [s["index"] for s in m["stages"]] == list(range(n))
    assert [s["file"] for s in m["stages"]] == stage_files
    assert m["references"] == [
        {"batch_size": 1, "file": "reference_b1.safetensors"},
        {"batch_size": 3, "file": "reference_b3.safetensors"},
    ]
    ref_files = [r["file"] for r in m["references"]]
    # These models freeze: every stage has its inference version (tests/test_inference.py).
    inference_files = [f"stage_{i:03d}.infer.pt" for i in range(n)]
    assert [s["inference_file"] for s in m["stages"]] == inference_files

    # Every stage, inference and reference file is listed with the sha256 of the file on disk,
    # and nothing else is in the bundle directory but the manifest.
    assert sorted(m["files"]) == sorted(stage_files + inference_files + ref_files)
    assert sorted(p.name for p in b.out.iterdir()) == sorted(stage_files + inference_files + ref_files + ["manifest.json"])
    for file, digest in m["files"].items():
        assert re.fullmatch(r"[0-9a-f]{64}", digest)
        assert hashlib.sha256((b.out / file).read_bytes()).hexdigest() == digest, file

    # Cuts 0..N frame the N stages.
    cuts = m["cuts"]
    assert len(cuts) == n + 1
    assert [c["index"] for c in cuts] == list(range(n + 1))
    assert cuts[0]["name"] == "input"
    assert cuts[-1]["name"] == "output"
    assert [c["name"] for c in cuts[1:-1]] == [f"after {s['name']}" for s in m["stages"][:-1]]
    assert m["inputs"] == cuts[0]["values"]
    assert cuts[0]["values"] and cuts[-1]["values"]
    for c in cuts:
        names = [v["name"] for v in c["values"]]
        assert len(names) == len(set(names)), c["name"]
        assert c["tensors"] == [
            {"name": leaf, "dtype": spec["dtype"], "shape": spec["shape"]}
            for v in c["values"]
            for leaf, spec in tensor_leaves(v["name"], v["spec"])
        ]
        assert (c["bytes_per_sample"], c["bytes_fixed"], c["usable"]) == bytes_per_sample([v["spec"] for v in c["values"]])

    # The parameters are split between the stages, none lost or counted twice.
    assert sum(s["parameters"] for s in m["stages"]) == m["model"]["parameters"] > 0
    assert all(s["compiler"] == "script" for s in m["stages"])


@pytest.mark.parametrize("name", ALL_BUNDLES)
def test_stage_parameter_and_buffer_names(name, request):
    """Every stage names its parameters and buffers as the model's state_dict does; together the
    stages hold each of them once (no tied weights in these models), and every stage's
    `cleave_buffers` method returns its buffers under the manifest's names."""
    b: Bundle = request.getfixturevalue(name)
    m = b.manifest
    model = load_source(b.source, b.input_shape, 0).model
    params, buffers = [], []
    for s, stage in zip(m["stages"], b.stages()):
        assert [n for n, _ in stage.named_parameters()] == s["parameter_names"], s["name"]
        assert [n for n, _ in stage.named_buffers()] == s["buffer_names"], s["name"]
        assert [n for n, _ in stage.cleave_buffers()] == s["buffer_names"], s["name"]
        assert s["parameters"] == sum(model.get_parameter(n).numel() for n in s["parameter_names"])
        params += s["parameter_names"]
        buffers += s["buffer_names"]
    assert sorted(params) == sorted(n for n, _ in model.named_parameters())
    assert sorted(buffers) == sorted(n for n, _ in model.named_buffers())
    assert m["exporter"]["shared_parameters"] == []


def test_digits_manifest_details(digits):
    m = digits.manifest
    model = DigitsCNN()
    assert m["model"]["class"] == "DigitsCNN"
    assert m["model"]["parameters"] == sum(p.numel() for p in model.parameters()) == 38378
    assert m["model"]["preprocess"] is None
    assert m["batch"] == {"min": 1, "max": 16}
    assert m["exporter"]["granularity"] == "op"
    assert m["exporter"]["kept_whole"] == [] and m["exporter"]["merged_cuts"] == []
    # At op granularity every module of the two Sequentials is its own stage.
    names = [f"features.{i}" for i in range(7)] + [f"classifier.{i}" for i in range(5)]
    assert [s["name"] for s in m["stages"]] == names
    assert [s["modules"] for s in m["stages"]] == [[n] for n in names]
    params = {n: sum(p.numel() for p in model.get_submodule(n).parameters()) for n in names}
    assert [s["parameters"] for s in m["stages"]] == [params[n] for n in names]
    # FLOPs per sample (2 per multiply-add): convolutions at 8x8 and the two linear layers;
    # batch norm, activations, pooling and flatten count nothing.
    flops = {"features.0": 2 * 16 * 1 * 9 * 64, "features.3": 2 * 32 * 16 * 9 * 64,
             "classifier.1": 2 * 512 * 64, "classifier.4": 2 * 64 * 10}
    assert [s["flops_per_sample"] for s in m["stages"]] == [flops.get(n, 0) for n in names]
    # What each stage's training forward leaves for its backward, per sample (float32 unless
    # said; in training mode): a convolution or linear layer its input, batch norm its input and
    # the batch's mean and inverse deviation per channel (spread over the probe batch of 2), a
    # ReLU its output, max pooling its input and int64 indices, dropout its mask; flatten nothing.
    saved = {"features.0": 4 * 64, "features.1": 4 * 16 * 64 + 2 * 4 * 16 // 2, "features.2": 4 * 16 * 64,
             "features.3": 4 * 16 * 64, "features.4": 4 * 32 * 64 + 2 * 4 * 32 // 2, "features.5": 4 * 32 * 64,
             "features.6": 4 * 32 * 64 + 8 * 32 * 16, "classifier.1": 4 * 512, "classifier.2": 4 * 64,
             "classifier.3": 4 * 64, "classifier.4": 4 * 64}
    assert [s["training_saved_bytes_per_sample"] for s in m["stages"]] == [saved.get(n, 0) for n in names]


# ---------------------------------------------------------------------------------------------
# 2. Symbolic shapes.


def test_digits_symbolic_shapes(digits):
    m = digits.manifest
    assert m["inputs"] == [{"name": "x", "spec": {"type": "tensor", "dtype": "float32", "shape": ["B", 1, 8, 8]}}]
    assert m["cuts"][0]["bytes_per_sample"] == 1 * 8 * 8 * 4
    assert m["cuts"][0]["bytes_fixed"] == 0
    shapes = [[t["shape"] for t in c["tensors"]] for c in m["cuts"]]
    assert shapes == [
        [["B", 1, 8, 8]],
        [["B", 16, 8, 8]], [["B", 16, 8, 8]], [["B", 16, 8, 8]],
        [["B", 32, 8, 8]], [["B", 32, 8, 8]], [["B", 32, 8, 8]],
        [["B", 32, 4, 4]],
        [["B", 512]], [["B", 64]], [["B", 64]], [["B", 64]],
        [["B", 10]],
    ]
    for c, [shape] in zip(m["cuts"], shapes):
        assert c["tensors"][0]["dtype"] == "float32"
        assert c["bytes_per_sample"] == 4 * torch.Size(shape[1:]).numel()
        assert c["usable"] is True and "reason" not in c


def test_residual_cut_carries_the_residual_frontier(residual):
    m = residual.manifest
    assert m["inputs"] == [{"name": "x", "spec": {"type": "tensor", "dtype": "float32", "shape": ["B", 4, 6, 6]}}]
    frontier = [c for c in m["cuts"] if len(c["tensors"]) == 2]
    # Every cut inside the block, from after conv1 up to the add, carries x (the skip) and the branch.
    assert [c["name"] for c in frontier] == ["after conv1", "after bn", "after relu", "after conv2"]
    for c in frontier:
        assert c["tensors"][0] == {"name": "x", "dtype": "float32", "shape": ["B", 4, 6, 6]}
        assert c["tensors"][1]["name"] != "x"
        assert c["tensors"][1]["dtype"] == "float32" and c["tensors"][1]["shape"] == ["B", 4, 6, 6]
        assert c["bytes_per_sample"] == 2 * 4 * 6 * 6 * 4
    # Once the branch is added back, one tensor crosses again.
    after_add = m["cuts"][frontier[-1]["index"] + 1]
    assert [t["shape"] for t in after_add["tensors"]] == [["B", 4, 6, 6]]
    assert "x" not in [t["name"] for t in after_add["tensors"]]


def test_dynamic_batch_one_to_two_keeps_the_batch_symbolic(tmp_path):
    # The two probe batch sizes must differ whenever the range allows it (regression test:
    # with --dynamic-batch 1 2 both probes were 2, every dimension looked fixed, and the
    # validation at batch 1 failed).
    out = tmp_path / "digits12"
    m = export_bundle(ExportOptions("cleave_export.zoo:digits_cnn", out, batch_min=1, batch_max=2,
                                    reference_batches=(1, 2), granularity="top")).manifest
    assert m["inputs"][0]["spec"]["shape"] == ["B", 1, 8, 8]
    assert m["cuts"][-1]["tensors"][0]["shape"] == ["B", 10]
    assert [s["name"] for s in m["stages"]] == ["features", "classifier"]
    assert [r["batch_size"] for r in m["references"]] == [1, 2]


def test_fixed_batch_model_exports_with_one_batch_size(tmp_path):
    out = tmp_path / "fixed"
    m = export_bundle(ExportOptions("tests.models:batch_baked", out, batch_min=3, batch_max=3,
                                    reference_batches=(3,))).manifest
    assert m["batch"] == {"min": 3, "max": 3}
    assert m["inputs"][0]["spec"] == {"type": "tensor", "dtype": "float32", "shape": [3, 4]}
    # Nothing scales with the batch: every byte is fixed.
    assert (m["cuts"][0]["bytes_per_sample"], m["cuts"][0]["bytes_fixed"]) == (0, 3 * 4 * 4)
    assert m["references"] == [{"batch_size": 3, "file": "reference_b3.safetensors"}]
    # FLOPs are per sample, measured here at batch 3: the 4 -> 2 linear layer costs 2 * 4 * 2.
    assert [(s["name"], s["flops_per_sample"]) for s in m["stages"]] == [("fc", 2 * 4 * 2), ("reshape", 0)]
    # The linear layer keeps its input (4 floats a sample) for its backward; the weight it
    # also keeps is a parameter, held anyway, and not counted.
    assert [(s["name"], s["training_saved_bytes_per_sample"]) for s in m["stages"]] == [("fc", 4 * 4), ("reshape", 0)]


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_every_file_of_a_bundle_has_one_mode_and_its_directory_another(tmp_path, umask, file_mode, dir_mode):
    # The references (safetensors) were written 0600 and the directory (mkdtemp) 0700 while
    # stages and the manifest followed the umask: now all follow it.
    out = tmp_path / "parent" / "digits"
    previous = os.umask(umask)
    try:
        export_bundle(ExportOptions("cleave_export.zoo:digits_cnn", out, batch_min=1, batch_max=2,
                                    reference_batches=(1, 2), granularity="top"))
    finally:
        os.umask(previous)
    files = sorted(p.name for p in out.iterdir())
    # Every kind of file a bundle holds is here, so the modes below cover them all.
    assert {"manifest.json", "reference_b1.safetensors", "stage_000.pt", "stage_000.infer.pt"} <= set(files), files
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o7777) for p in [out, *out.rglob("*")]}
    assert modes == {"parent/digits": oct(dir_mode)} | {f"parent/digits/{f}": oct(file_mode) for f in files}


# ---------------------------------------------------------------------------------------------
# 4. Value trees: several inputs, plain values at cuts, modules kept whole, dict outputs.


def test_transformer_inputs_values_and_output_tree(transformer):
    b, m = transformer, transformer.manifest
    assert m["inputs"] == [
        {"name": "tokens", "spec": {"type": "tensor", "dtype": "int64", "shape": ["B", 12]}},
        {"name": "mask", "spec": {"type": "tensor", "dtype": "bool", "shape": ["B", 12]}},
    ]
    assert m["cuts"][0]["bytes_per_sample"] == 12 * 8 + 12 * 1

    # tokens.size(1) never crosses a cut: each stage that slices by it computes it again from
    # a tensor of its own input, so no peer sends a size a stage would slice or reshape by.
    assert not [c["index"] for c in m["cuts"] if any(v["spec"] == {"type": "int"} for v in c["values"])]
    slicing = [s for s in m["stages"] if s["index"] > 0 and "size" in (b.out / s["file"]).read_bytes().decode("latin-1")]
    assert slicing, "some later stage computes the size again"

    # The guard's data-dependent `if` cannot be traced: it is kept whole, as one stage.
    assert m["exporter"]["kept_whole"] == ["guard"]
    assert [s["modules"] for s in m["stages"] if "guard" in s["modules"]] == [["guard"]]

    # `x.dtype` cannot be a TorchScript stage input: its cut is merged away, and named.
    [reason] = m["exporter"]["merged_cuts"]
    match = re.fullmatch(r"after (\w+): value '(\w+)' is a dtype, which cannot cross a cut", reason)
    assert match and match[1] == match[2], reason
    dtype_value = match[1]
    assert dtype_value not in {v["name"] for c in m["cuts"] for v in c["values"]}
    assert [s["name"] for s in m["stages"] if s["name"].startswith(f"{dtype_value} .. ")] != []

    # The output is a dict, keys in the model's order, each naming a value of the last cut.
    assert m["output"] == {
        "type": "dict",
        "items": [
            {"key": "logits", "value": {"type": "ref", "name": "head"}},
            {"key": "hidden", "value": {"type": "ref", "name": "norm"}},
        ],
    }
    last = {v["name"]: v["spec"] for v in m["cuts"][-1]["values"]}
    assert last == {
        "norm": {"type": "tensor", "dtype": "float32", "shape": ["B", 12, 32]},
        "head": {"type": "tensor", "dtype": "float32", "shape": ["B", 5]},
    }
    assert m["model"]["class"] == "TinyTransformer"


def test_transformer_position_slice_is_fixed_bytes(transformer):
    # self.pos[:, :12] does not scale with the batch: it counts as fixed bytes, not per sample.
    cuts = [c for c in transformer.manifest["cuts"] if any(t["shape"] == [1, 12, 32] for t in c["tensors"])]
    assert len(cuts) == 1
    assert cuts[0]["bytes_fixed"] == 12 * 32 * 4


# ---------------------------------------------------------------------------------------------
# 5. The chain reproduces the references, at every split point.


@pytest.mark.parametrize("name", ALL_BUNDLES)
def test_chain_reproduces_reference_at_every_split(name, request):
    b: Bundle = request.getfixturevalue(name)
    m = b.manifest
    stages = b.stages()
    n = len(stages)
    for batch in (1, 3):
        inputs, expected = reference(b, batch)
        whole = run_stages(stages, inputs)
        assert len(whole) == len(expected)
        for got, want in zip(whole, expected):
            assert_close(got, want)
        for s in range(n + 1):
            boundary = run_stages(stages[:s], inputs)
            cut = m["cuts"][s]
            assert len(boundary) == len(cut["values"])
            for v, x in zip(cut["values"], boundary):
                check_value(v["spec"], x, batch, f"cut {s} value {v['name']}")
            got = run_stages(stages[s:], boundary)
            assert all(torch.equal(g, w) for g, w in zip(got, whole, strict=True)), f"split at cut {s} differs"


@pytest.mark.parametrize("name", ["digits", "transformer"])
def test_references_are_the_models_own_outputs(name, request):
    # Rebuild the model from SOURCE and seed: the reference output is what it computes.
    b: Bundle = request.getfixturevalue(name)
    model = load_source(b.source, b.input_shape, b.manifest["model"]["seed"]).model
    inputs, expected = reference(b, 3)
    with torch.no_grad():
        want = model(*inputs)
    by_name = {v["name"]: x for v, x in zip(b.manifest["cuts"][-1]["values"], expected)}
    got = assemble(b.manifest["output"], by_name)
    assert [k for k, _ in flatten_tensors("", got)] == [k for k, _ in flatten_tensors("", want)]
    for (_, g), (_, w) in zip(flatten_tensors("", got), flatten_tensors("", want)):
        assert_close(g, w)


def test_digits_every_split_as_two_halves_over_the_wire(digits):
    # As the host and the server would: load the two halves separately, send the boundary
    # as safetensors under its wire names, and compare the outputs bit for bit.
    m = digits.manifest
    n = len(m["stages"])
    inputs, expected = reference(digits, 3)
    outputs = []
    for s in range(n + 1):
        edge = [torch.jit.load(str(digits.out / st["file"])).eval() for st in m["stages"][:s]]
        server = [torch.jit.load(str(digits.out / st["file"])).eval() for st in m["stages"][s:]]
        boundary = run_stages(edge, list(inputs))
        cut = m["cuts"][s]
        wire = dict(leaf for v, x in zip(cut["values"], boundary) for leaf in flatten_tensors(v["name"], x))
        assert list(wire) == [t["name"] for t in cut["tensors"]]
        received = load(save({k: x.contiguous() for k, x in wire.items()}))
        got = run_stages(server, [received[v["name"]] for v in cut["values"]])
        assert len(got) == 1
        assert_close(got[0], expected[0])
        outputs.append(got[0])
    assert len(outputs) == n + 1 == 13
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_scripted_stages_keep_train_and_eval_behaviour(digits):
    m = digits.manifest
    by_name = {s["name"]: torch.jit.load(str(digits.out / s["file"])) for s in m["stages"]}
    torch.manual_seed(0)
    x = torch.randn(4, 16, 8, 8) * 3 + 1
    bn = by_name["features.1"]
    with torch.no_grad():
        eval_out = bn.eval()(x)[0]
        train_out = bn.train()(x)[0]
    # Train mode normalises with the batch's statistics: mean 0 per channel.
    assert torch.allclose(train_out.mean(dim=(0, 2, 3)), torch.zeros(16), atol=1e-5)
    assert not torch.allclose(eval_out, train_out)
    dropout = by_name["classifier.3"]
    h = torch.ones(8, 64)
    with torch.no_grad():
        assert torch.equal(dropout.eval()(h)[0], h)
        dropped = dropout.train()(h)[0]
    assert (dropped == 0).any() and set(dropped.unique().tolist()) <= {0.0, 1 / 0.8}


# ---------------------------------------------------------------------------------------------
# The one torchvision export.


def test_torchvision_mobilenet_at_block_granularity(mobilenet):
    m = mobilenet.manifest
    assert m["model"]["class"] == "MobileNetV3"
    assert m["model"]["parameters"] == 2542856
    assert m["inputs"] == [{"name": "x", "spec": {"type": "tensor", "dtype": "float32", "shape": ["B", 3, 32, 32]}}]
    assert m["cuts"][-1]["tensors"][0]["shape"] == ["B", 1000]
    assert m["exporter"]["granularity"] == "block"
    assert m["exporter"]["kept_whole"] == [] and m["exporter"]["merged_cuts"] == []
    names = [s["name"] for s in m["stages"]]
    assert names == [f"features.{i}" for i in range(13)] + ["avgpool", "flatten"] + [f"classifier.{i}" for i in range(4)]
    assert all(c["usable"] for c in m["cuts"])
    # --input-shape 3,32,32 is not the 224 crop of the weights' preset, so no preprocessing
    # is claimed for these inputs.
    assert m["model"]["preprocess"] is None


def test_torchvision_preset_gives_shape_and_preprocessing():
    src = load_source("torchvision:mobilenet_v3_small", None, 0)
    assert src.preprocess == {"resize": 256, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    assert src.make_inputs(2, None)[0].shape == (2, 3, 224, 224)
    assert not src.model.training
    # The same shape as the preset, given explicitly, keeps the preprocessing.
    assert load_source("torchvision:mobilenet_v3_small", (3, 224, 224), 0).preprocess == src.preprocess


# ---------------------------------------------------------------------------------------------
# 6. Errors name the problem, and leave nothing behind.


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (dict(source="torchvision:resnet9000"), "torchvision has no model 'resnet9000'; the nearest it has: resnet50, resnet101, "),
        (dict(source="torchvision:ResNet50"), "torchvision has no model 'ResNet50'; the nearest it has: resnet50, "),
        (dict(source="torchvision:no_such_net"),
         "torchvision has no model 'no_such_net'; no name it has is near (torchvision.models.list_models() lists its "),
        (dict(source="resnet18"),
         "SOURCE 'resnet18' is none of `torchvision:NAME`, `hf:CLASS`, `timm:NAME`, `ultralytics:CONFIG.yaml` and "
         "`package.module:callable`"),
        (dict(source="tests.models:not_a_module"), "tests.models:not_a_module returned a int, expected a torch.nn.Module"),
        (dict(source="tests.models:missing"), "module 'tests.models' has no attribute 'missing'"),
        (dict(source="no_such_pkg.mod:f"),
         "cannot import 'no_such_pkg.mod' (from SOURCE 'no_such_pkg.mod:f'): No module named 'no_such_pkg' (what to try: the "
         "module must be importable from the current directory or via PYTHONPATH: run from the directory that holds "
         "no_such_pkg.py or no_such_pkg/, or name that directory in PYTHONPATH: PYTHONPATH=path/to/dir before the command)"),
        (dict(source=":f"), "cannot import '' (from SOURCE ':f')"),
        (dict(source=".models:f"), "cannot import '.models' (from SOURCE '.models:f')"),
        (dict(source="tests.models:tiny_residual", granularity="fine"),
         "--granularity 'fine': expected top, block, layer, op or a positive depth"),
        (dict(source="tests.models:tiny_residual", granularity="0"), "--granularity '0'"),
        (dict(source="tests.models:tiny_residual", reference_batches=(1, 100)),
         "reference batch size 100 is outside --dynamic-batch 1 64"),
        (dict(source="tests.models:batch_baked", batch_min=3, batch_max=3),
         "reference batch size 1 is outside --dynamic-batch 3 3"),
        (dict(source="tests.models:tiny_residual", batch_min=5, batch_max=2), "--dynamic-batch 5 2: need 1 <= MIN <= MAX"),
        (dict(source="tests.models:tiny_residual", batch_min=0, batch_max=2), "--dynamic-batch 0 2: need 1 <= MIN <= MAX"),
        (dict(source="torch.nn:Identity"), "cannot tell the input shape of torch.nn:Identity: pass --input-shape"),
        pytest.param(
            dict(source="tests.models:traced_not_scripted", granularity="op"),
            "at batch 1, stage 0 ('_rows_unscriptable') fails: RuntimeError: shape '[2, -1]' is invalid for input of size 3 "
            "(stage 0 ('_rows_unscriptable') is traced, not scripted, so its shapes may be those of the example it was traced "
            "at; what to try: make it scriptable, --verbose shows why it is not)",
            marks=pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
        ),
    ],
)
def test_bad_inputs_name_the_problem(tmp_path, opts, message):
    out = tmp_path / "bundle"
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions(out=out, **opts))
    assert message in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_module_that_imports_a_missing_package_is_not_told_to_set_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "needs_a_package.py").write_text("import no_such_dependency_of_cleave\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions("needs_a_package:f", tmp_path / "b"))
    assert str(e.value) == (
        "cannot import 'needs_a_package' (from SOURCE 'needs_a_package:f'): No module named 'no_such_dependency_of_cleave'"
    )


def test_existing_output_is_refused_and_left_untouched(tmp_path):
    out = tmp_path / "bundle"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    (out / "sub" / "stage_000.pt").write_bytes(b"not a stage")
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions("tests.models:tiny_residual", out))
    assert str(e.value) == f"{out} already exists; pass --force to replace it"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["keep.txt", "sub", "sub/stage_000.pt"]
    assert (out / "keep.txt").read_text() == "mine"
    assert (out / "sub" / "stage_000.pt").read_bytes() == b"not a stage"
    assert parent_listing(out) == ["bundle"]


def test_batch_baked_model_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "baked"
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions("tests.models:batch_baked", out))
    message = str(e.value)
    # It takes batch 3 only; the exporter tries another batch size and names it.
    assert message.startswith("the model fails on its example inputs at batch 2: RuntimeError: shape '[3, 2]' is invalid")
    assert message.endswith("(a model that takes one batch size only is exported with --dynamic-batch N N)")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("tests.test_export:small_batches_only",
         "the model fails on its example inputs at batch 8: RuntimeError: batch larger than 4"),
        ("tests.test_export:trace_differs", "the trace of the model differs from the model at batch 1"),
    ],
)
def test_failed_validation_removes_its_temporary_directory(tmp_path, monkeypatch, source, message):
    # These models pass the probes and fail only in validation, after the temporary bundle
    # directory was made: it must be gone, and no bundle directory may appear.
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(Path(real_mkdtemp(*args, **kwargs)))
        return str(made[-1])

    monkeypatch.setattr(cleave_export.bundle.tempfile, "mkdtemp", mkdtemp)
    out = tmp_path / "nope"
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions(source, out))
    assert message in str(e.value)
    assert len(made) == 1 and made[0].parent == tmp_path and made[0].name.startswith(".nope.")
    assert not made[0].exists()
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_value_read_out_of_a_tensor_stays_data_dependent_only_in_a_scriptable_submodule(tmp_path):
    # In forward itself: neither tracer follows .numpy(); the hint says what a submodule must be.
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions("tests.test_export:numpy_in_forward", tmp_path / "a"))
    message = str(e.value)
    assert "torch.export cannot trace NumpyInForward: RuntimeError: .numpy() is not supported" in message
    assert message.endswith(
        "(what to try: move the code of forward that depends on the data into a submodule, which the exporter keeps whole "
        "and compiles with torch.jit.script: that code must be scriptable (tensor operations, .item(), .tolist() with a type "
        "annotation; not .numpy()), or its stage is traced with torch.jit.trace instead, which makes each value read out of "
        "a tensor (.numpy(), .item(), .tolist()) a constant, the one of the example inputs, and validation refuses the "
        "stage where that value changes with the inputs)"
    )
    # In a submodule: kept whole, not scriptable, traced; the constant fails validation, which says why.
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions("tests.test_export:numpy_in_submodule", tmp_path / "b", granularity="op"))
    message = str(e.value)
    assert message.startswith("at batch 1, stage 1 ('scale') computes 'scale' differently from the model; output relative error ")
    assert message.endswith(
        "(it is traced, not scripted (the warning above says why), so each value it reads out of a tensor "
        "(.numpy(), .item(), .tolist()) is a constant, the one of the example it was traced at; what to try: make it scriptable)"
    )
    assert list(tmp_path.iterdir()) == []
    # A scriptable submodule (.item()) is kept whole, scripted, and exports.
    m = export_bundle(ExportOptions("tests.test_export:item_in_submodule", tmp_path / "c", granularity="op")).manifest
    assert m["exporter"]["kept_whole"] == ["scale"]
    assert [(s["name"], s["compiler"]) for s in m["stages"]] == [("fc", "script"), ("scale", "script")]


def test_kept_whole_module_is_reported(tmp_path):
    # The gate of SmallBatchesOnly is kept whole when the batch range stays below its limit.
    out = tmp_path / "gated"
    m = export_bundle(ExportOptions("tests.test_export:small_batches_only", out, batch_max=4,
                                    granularity="op")).manifest
    assert m["exporter"]["kept_whole"] == ["gate"]
    assert [s["name"] for s in m["stages"]] == ["fc", "gate"]
    assert parent_listing(out) == ["gated"]


# ---------------------------------------------------------------------------------------------
# 7. --force, and the command line.


def test_force_replaces_an_existing_bundle(tmp_path, capsys):
    out = tmp_path / "bundle"
    capsys.readouterr()
    assert cli.main(["tests.models:tiny_residual", "--out", str(out), "-q"]) == 0
    assert capsys.readouterr().out == ""  # -q: errors only, no export lines
    first = json.loads((out / "manifest.json").read_text())
    assert first["model"]["source"] == "tests.models:tiny_residual"
    (out / "stray.txt").write_text("left from before")
    capsys.readouterr()

    assert cli.main(["cleave_export.zoo:digits_cnn", "--out", str(out), "--granularity", "top"]) == 2
    assert "already exists; pass --force to replace it" in capsys.readouterr().err
    assert (out / "stray.txt").exists()

    assert cli.main(["cleave_export.zoo:digits_cnn", "--out", str(out), "--granularity", "top", "--force"]) == 0
    stdout = capsys.readouterr().out
    assert f"exported cleave_export.zoo:digits_cnn to {out}: 2 stages, 3 cuts (3 usable), 38,378 parameters" in stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["source"] == "cleave_export.zoo:digits_cnn"
    assert [s["name"] for s in m["stages"]] == ["features", "classifier"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*m["files"], "manifest.json"])
    for file, digest in m["files"].items():
        assert hashlib.sha256((out / file).read_bytes()).hexdigest() == digest
    assert parent_listing(out) == ["bundle"]


def test_cli_bad_granularity_exits_2(tmp_path, capsys):
    out = tmp_path / "b"
    assert cli.main(["tests.models:tiny_residual", "--out", str(out), "--granularity", "fine"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "cleave_export: error: --granularity 'fine': expected top, block, layer, op or a positive depth\n"
    )
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_cli_parses_every_option():
    verbose, quiet, opts = cli.parse_args([
        "pkg.mod:make", "--out", "b", "--input-shape", "3x32x32", "--dynamic-batch", "2", "5",
        "--granularity", "layer", "--seed", "7", "--reference-batches", "2,4", "--force", "-q",
        "--dynamic-seq", "4", "32", "--hf-config", "num_hidden_layers=2,act=gelu,tie=false", "--verbose",
    ])
    assert verbose and quiet
    assert opts == ExportOptions(source="pkg.mod:make", out=Path("b"), input_shape=(3, 32, 32), batch_min=2,
                                 batch_max=5, granularity="layer", seed=7, reference_batches=(2, 4), force=True,
                                 seq=(4, 32), hf_config={"num_hidden_layers": 2, "act": "gelu", "tie": False})
    assert cli.parse_args(["s:f", "--out", "b"]) == (False, False, ExportOptions(source="s:f", out=Path("b")))
    # Two dimensions are taken with commas (a (C, L) input, say), not with `x`: see below.
    assert cli.parse_args(["s:f", "--out", "b", "--input-shape", "8,1"])[2].input_shape == (8, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input-shape", "3,a"], "'3,a' is not a shape like 3,224,224"),
        (["--input-shape", "3,0,4"], "'3,0,4': dimensions must be positive"),
        (["--input-shape", "8x1"],
         "argument --input-shape: '8x1': the input shape is C,H,W without the batch, e.g. 3,224,224 "
         "(if the input really has 2 dimensions, write 8,1)"),
        (["--input-shape", "224x224"], "'224x224': the input shape is C,H,W without the batch, e.g. 3,224,224"),
        (["--reference-batches", "1;3"], "'1;3' is not a list of batch sizes like 1,3"),
        (["--hf-config", "layers"], "--hf-config item 'layers' is not key=value"),
        (["--dynamic-seq", "4"], "--dynamic-seq: expected 2 arguments"),
    ],
)
def test_cli_rejects_malformed_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["s:f", "--out", "b", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_python_m_cleave_export_bad_source_exit_code_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "cleave_export", "resnet18", "--out", str(tmp_path / "b")],
        cwd=EXPORT_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr == (
        "cleave_export: error: SOURCE 'resnet18' is none of `torchvision:NAME`, `hf:CLASS`, `timm:NAME`, "
        "`ultralytics:CONFIG.yaml` and `package.module:callable`\n"
    )
    assert run.stdout == ""
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# 8. Specs and granularity, unit by unit.


BATCHES = [Probe(2), Probe(3)]
BATCHES_AND_SEQS = [Probe(2, 5), Probe(3, 5), Probe(2, 8)]


def test_symbolic_dim():
    assert symbolic_dim([64, 64], BATCHES) == 64  # fixed
    assert symbolic_dim([1, 1], BATCHES) == 1
    assert symbolic_dim([2, 3], BATCHES) == "B"
    assert symbolic_dim([1, 2], [Probe(1), Probe(2)]) == "B"
    assert symbolic_dim([4, 6], BATCHES) == "2*B"
    assert symbolic_dim([24, 36], BATCHES) == "12*B"
    assert symbolic_dim([5, 9], BATCHES) == "?"  # grows, but not in proportion to the batch
    assert symbolic_dim([3, 4], BATCHES) == "?"  # B + 1
    assert symbolic_dim([7, 5], BATCHES) == "?"
    assert symbolic_dim([3, 3], [Probe(3), Probe(3)]) == 3  # one batch size: everything is fixed
    # With a sequence: B and S told apart by the probe that changes each.
    assert symbolic_dim([2, 3, 2], BATCHES_AND_SEQS) == "B"
    assert symbolic_dim([5, 5, 8], BATCHES_AND_SEQS) == "S"
    assert symbolic_dim([15, 15, 24], BATCHES_AND_SEQS) == "3*S"
    assert symbolic_dim([64, 64, 64], BATCHES_AND_SEQS) == 64
    assert symbolic_dim([10, 15, 16], BATCHES_AND_SEQS) == "?"  # B * S
    assert symbolic_dim([6, 6, 9], BATCHES_AND_SEQS) == "?"  # S + 1 from two lengths: any two points lie on a line
    assert symbolic_dim([5, 5, 5], [Probe(2, 5), Probe(3, 5)]) == 5  # a fixed sequence length


THREE_SEQS = [*BATCHES_AND_SEQS, Probe(2, 7)]


def test_lines_in_the_sequence_length_need_three_lengths():
    assert symbolic_dim([6, 6, 9, 8], THREE_SEQS) == "S+1"
    assert symbolic_dim([4, 4, 7, 6], THREE_SEQS) == "S-1"
    assert symbolic_dim([120, 120, 180, 160], THREE_SEQS) == "20*S+20"  # a waveform's samples, S its frames
    assert symbolic_dim([15, 15, 24, 21], THREE_SEQS) == "3*S"
    assert symbolic_dim([6, 6, 9, 9], THREE_SEQS) == "?"  # off the line at the third length
    assert symbolic_dim([3, 4, 3, 3], THREE_SEQS) == "?"  # B + 1: a batch dimension is k*B or nothing
    assert symbolic_dim([10, 15, 16, 14], THREE_SEQS) == "?"  # B * S
    assert shape_at(["B", "20*S+20", "S-1", "2*S-3"], 2, 5) == [2, 120, 4, 7]
    assert parse_affine("320*S+80") == (320, "S", 80) and affine_dim(320, "S", 80) == "320*S+80"
    with pytest.raises(ValueError, match="is not an integer"):
        shape_at(["S+"], 1, 5)


def test_value_spec_of_nested_values():
    small = (torch.zeros(2, 5), {"n": 7, "none": None, "t": torch.ones(4, 3, dtype=torch.int64)}, [1.5, True], "s")
    large = (torch.zeros(3, 5), {"n": 9, "none": None, "t": torch.ones(6, 3, dtype=torch.int64)}, [2.5, False], "s")
    assert value_spec([small, large], BATCHES, "v") == {
        "type": "tuple",
        "items": [
            {"type": "tensor", "dtype": "float32", "shape": ["B", 5]},
            {"type": "dict", "items": [
                {"key": "n", "value": {"type": "int"}},
                {"key": "none", "value": {"type": "none"}},
                {"key": "t", "value": {"type": "tensor", "dtype": "int64", "shape": ["2*B", 3]}},
            ]},
            {"type": "list", "items": [{"type": "float"}, {"type": "bool"}]},
            {"type": "str"},
        ],
    }
    assert value_spec([None, None], BATCHES, "v") == {"type": "none"}
    assert value_spec([5, 5], BATCHES, "v") == {"type": "int"}
    assert value_spec([torch.Size([2, 4]), torch.Size([3, 4])], BATCHES, "v") == {"type": "list", "items": [{"type": "int"}] * 2}
    assert value_spec([torch.zeros(2, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)], BATCHES, "v") == {
        "type": "tensor", "dtype": "bool", "shape": ["B"]}
    seen = [torch.zeros(2, 5, 1, 5, 7), torch.zeros(3, 5, 1, 5, 7), torch.zeros(2, 8, 1, 8, 7)]
    assert value_spec(seen, BATCHES_AND_SEQS, "v") == {"type": "tensor", "dtype": "float32", "shape": ["B", "S", 1, "S", 7]}


@pytest.mark.parametrize(
    ("small", "large", "message"),
    [
        (torch.float32, torch.float32, "v is a dtype, which cannot cross a cut"),
        (torch.zeros(2, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64),
         "v is a tensor of unsupported dtype torch.complex64"),
        (torch.zeros(2), torch.zeros(3, 1), "v changes rank with the batch size or sequence length"),
        ((1, 2), (1, 2, 3), "v changes length with the batch size or sequence length"),
        ({1: torch.zeros(2)}, {1: torch.zeros(3)}, "v is a dict whose keys are not fixed strings"),
        ((torch.zeros(2), object()), (torch.zeros(3), object()), "v[1] is a object, which cannot cross a cut"),
    ],
)
def test_value_spec_refuses_what_cannot_cross_a_cut(small, large, message):
    with pytest.raises(Unrepresentable) as e:
        value_spec([small, large], BATCHES, "v")
    assert str(e.value) == message


def test_torchscript_type():
    T = torch.Tensor
    assert torchscript_type({"type": "tensor", "dtype": "float32", "shape": ["B"]}) is T
    assert torchscript_type({"type": "int"}) is int
    assert torchscript_type({"type": "float"}) is float
    assert torchscript_type({"type": "bool"}) is bool
    assert torchscript_type({"type": "str"}) is str
    assert torchscript_type({"type": "none"}) == typing.Optional[T]
    assert torchscript_type({"type": "tuple", "items": [{"type": "tensor"}, {"type": "int"}]}) == typing.Tuple[T, int]
    assert torchscript_type({"type": "tuple", "items": []}) == typing.Tuple[()]
    assert torchscript_type({"type": "list", "items": [{"type": "int"}] * 3}) == typing.List[int]
    assert torchscript_type({"type": "dict", "items": [{"key": "a", "value": {"type": "tensor"}},
                                                       {"key": "b", "value": {"type": "tensor"}}]}) == typing.Dict[str, T]
    nested = {"type": "tuple", "items": [{"type": "list", "items": [{"type": "tensor"}]}, {"type": "none"}]}
    assert torchscript_type(nested) == typing.Tuple[typing.List[T], typing.Optional[T]]
    for bad in ({"type": "list", "items": [{"type": "int"}, {"type": "tensor"}]}, {"type": "list", "items": []},
                {"type": "dict", "items": []}):
        with pytest.raises(Unrepresentable, match="mixed or unknown element types"):
            torchscript_type(bad)


def test_tensor_leaves_match_runtime_names_and_byte_counts():
    spec = {"type": "tuple", "items": [
        {"type": "tensor", "dtype": "float16", "shape": ["B", 3]},
        {"type": "dict", "items": [{"key": "k", "value": {"type": "tensor", "dtype": "int8", "shape": ["2*B", 5]}},
                                   {"key": "n", "value": {"type": "int"}}]},
        {"type": "tensor", "dtype": "float32", "shape": [7]},
    ]}
    value = (torch.zeros(4, 3, dtype=torch.float16), {"k": torch.zeros(8, 5, dtype=torch.int8), "n": 1}, torch.zeros(7))
    assert [n for n, _ in tensor_leaves("v", spec)] == [n for n, _ in flatten_tensors("v", value)] == ["v.0", "v.1.k", "v.2"]
    check_value(spec, value, 4, "v")
    # per sample: 3 float16 + 2 * 5 int8; fixed: 7 float32.
    assert bytes_per_sample([spec]) == (3 * 2 + 2 * 5, 7 * 4, True)
    assert bytes_per_sample([{"type": "tensor", "dtype": "float32", "shape": ["B", "?"]}])[2] is False
    assert shape_at(["B", "2*B", "?", 5], 4) == [4, 8, -1, 5]
    assert shape_at(["B", "S", "3*S", 5], 4, 7) == [4, 7, 21, 5]
    # Bytes linear in the batch at a sequence length: an attention mask grows as S * S.
    mask = {"type": "tensor", "dtype": "bool", "shape": ["B", 1, "S", "S"]}
    positions = {"type": "tensor", "dtype": "int64", "shape": [1, "S"]}
    assert bytes_per_sample([mask, positions], 16) == (16 * 16, 8 * 16, True)
    with pytest.raises(ValueError, match=r"v\[0\]: expected float16\[3, 3\], got float16\[4, 3\]"):
        check_value(spec, value, 3, "v")


def test_parse_granularity():
    assert [parse_granularity(g) for g in ("top", "block", "layer", "op", "1", "4")] == [1, 2, 3, None, 1, 4]
    for bad in ("fine", "0", "-1", "", "Op"):
        with pytest.raises(ExportError, match=re.escape(f"--granularity {bad!r}: expected top, block")):
            parse_granularity(bad)


def test_relative_error_is_infinite_where_values_go_non_finite_or_structure_differs():
    want = {"logits": torch.tensor([[1.0, -2.0], [4.0, float("-inf")]]), "ids": torch.tensor([1, 2])}
    close = {"logits": torch.tensor([[1.0, -2.0], [4.0 + 2**-18, float("-inf")]]), "ids": torch.tensor([1, 2])}
    assert relative_error(want, want) == 0.0
    assert relative_error(close, want) == 2**-20
    for bad in (
        {"logits": torch.tensor([[1.0, float("nan")], [4.0, float("-inf")]]), "ids": torch.tensor([1, 2])},
        {"logits": torch.tensor([[1.0, -2.0], [4.0, float("inf")]]), "ids": torch.tensor([1, 2])},
        {"logits": torch.tensor([[1.0, -2.0], [4.0, 0.0]]), "ids": torch.tensor([1, 2])},
        {"logits": want["logits"], "ids": torch.tensor([1, 3])},
        {"logits": want["logits"].double(), "ids": torch.tensor([1, 2])},
        {"logits": want["logits"]},
    ):
        assert relative_error(bad, want) == float("inf"), bad
    half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert relative_error(half, half) == 0.0


def test_cuts_holding_a_data_dependent_shape_are_unusable_with_the_reason(tmp_path):
    m = export_bundle(ExportOptions("tests.models:data_dependent_middle", tmp_path / "b", granularity="op")).manifest
    unusable = {c["name"]: c for c in m["cuts"] if not c["usable"]}
    # The positive activations (`?` values) live after the indexing until the sum reads them.
    assert sorted(unusable) == ["after fc2", "after getitem"]
    for c in unusable.values():
        assert ["?"] in [t["shape"] for t in c["tensors"]]
        assert c["reason"] == "a tensor here has a data-dependent shape, so a receiver cannot bound its size"
    assert all(c["usable"] and "reason" not in c for c in m["cuts"] if c["name"] not in unusable)
    # The Rust side reads the same: `host splits` shows both cuts unusable with the reason.
    host = EXPORT_ROOT.parent.parent / "target" / "release" / "host"
    if host.exists():
        table = subprocess.run([str(host), "splits", "--bundle", str(tmp_path / "b")], capture_output=True, text=True, check=True).stdout
        rows = [line for line in table.splitlines() if "no (1)" in line]
        assert [row.split()[1] for row in rows] == ["3", "4"], table
        reason = "a tensor here has a data-dependent shape, so a receiver cannot bound its size"
        assert table.count(reason) == 1 and f"\n(1) {reason}" in table, table
