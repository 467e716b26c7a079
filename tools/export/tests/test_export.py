"""Exporter tests: manifest contents, symbolic shapes, value trees, the chain against its
references, and a clear error for every input it cannot take. Run from tools/export."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cleave_export import ExportError
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.specs import symbolic_dim, torchscript_type, value_spec

HERE = Path(__file__).resolve().parent.parent


def export(tmp_path_factory, source, name, **kw):
    out = tmp_path_factory.mktemp("bundles") / name
    report = export_bundle(ExportOptions(source=source, out=out, **kw))
    return out, report.manifest


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return export(tmp_path_factory, "cleave_export.zoo:digits_cnn", "digits", granularity="op", batch_max=16, reference_batches=(1, 3))


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    return export(tmp_path_factory, "tests.models:tiny_residual", "residual", granularity="op")


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    return export(tmp_path_factory, "tests.models:tiny_transformer", "transformer", granularity="op", batch_max=16)


def test_manifest_lists_every_file_with_its_hash(digits):
    out, m = digits
    assert (m["format"], m["format_version"]) == ("cleave-bundle", 1)
    on_disk = sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    assert sorted(m["files"]) == on_disk
    for name, digest in m["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert [s["file"] for s in m["stages"]] == [f"stage_{i:03d}.pt" for i in range(len(m["stages"]))]


def test_cuts_frame_the_stages(digits):
    _, m = digits
    assert len(m["cuts"]) == len(m["stages"]) + 1
    assert [c["index"] for c in m["cuts"]] == list(range(len(m["cuts"])))
    assert m["cuts"][0]["name"] == "input" and m["cuts"][-1]["name"] == "output"
    assert m["inputs"] == m["cuts"][0]["values"]
    assert sum(s["parameters"] for s in m["stages"]) == m["model"]["parameters"] == 38378


def test_symbolic_shapes_and_bytes(digits):
    _, m = digits
    assert m["inputs"] == [{"name": "x", "spec": {"type": "tensor", "dtype": "float32", "shape": ["B", 1, 8, 8]}}]
    assert m["cuts"][0]["bytes_per_sample"] == 8 * 8 * 4
    assert m["cuts"][-1]["tensors"] == [{"name": m["cuts"][-1]["values"][0]["name"], "dtype": "float32", "shape": ["B", 10]}]
    assert all(c["usable"] for c in m["cuts"])


def test_residual_cut_carries_both_paths(residual):
    _, m = residual
    frontiers = [c for c in m["cuts"] if len(c["tensors"]) == 2]
    assert frontiers, "a cut inside the residual block must carry x and the branch"
    for c in frontiers:
        assert "x" in [t["name"] for t in c["tensors"]]
        assert all(t["shape"] == ["B", 4, 6, 6] for t in c["tensors"])


def test_transformer_value_tree(transformer):
    _, m = transformer
    assert [(i["name"], i["spec"]) for i in m["inputs"]] == [
        ("tokens", {"type": "tensor", "dtype": "int64", "shape": ["B", 12]}),
        ("mask", {"type": "tensor", "dtype": "bool", "shape": ["B", 12]}),
    ]
    assert any(v["spec"] == {"type": "int"} for c in m["cuts"] for v in c["values"])
    assert m["exporter"]["kept_whole"] == ["guard"]
    assert any("is a dtype" in reason for reason in m["exporter"]["merged_cuts"])
    assert m["output"]["type"] == "dict"
    assert [item["key"] for item in m["output"]["items"]] == ["logits", "hidden"]


def run_chain(out, m, values, start, end):
    for i in range(start, end):
        values = list(torch.jit.load(str(out / m["stages"][i]["file"]))(*values))
    return values


@pytest.mark.parametrize("bundle", ["digits", "transformer"])
def test_every_split_reproduces_the_reference(bundle, request):
    out, m = request.getfixturevalue(bundle)
    ref = load_file(str(out / "reference_b3.safetensors"))
    inputs = [ref[f"input.{v['name']}"] for v in m["inputs"]]
    want = [ref[f"output.{v['name']}"] for v in m["cuts"][-1]["values"]]
    n = len(m["stages"])
    first = None
    with torch.no_grad():
        for s in range(n + 1):
            got = run_chain(out, m, run_chain(out, m, list(inputs), 0, s), s, n)
            for g, w in zip(got, want, strict=True):
                assert (g - w).abs().max() <= 1e-5 * w.abs().max()
            if first is None:
                first = got
            assert all(torch.equal(a, b) for a, b in zip(got, first)), f"split {s} differs from split 0"


def test_force_replaces_and_refusal_keeps_the_old_bundle(tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists; pass --force"):
        export_bundle(ExportOptions(source="tests.models:tiny_residual", out=out))
    assert (out / "keep.txt").read_text() == "mine"
    export_bundle(ExportOptions(source="tests.models:tiny_residual", out=out, force=True))
    assert (out / "manifest.json").is_file() and not (out / "keep.txt").exists()


def test_batch_baked_model_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "baked"
    with pytest.raises(ExportError, match="the model fails on its example inputs at batch size 2: RuntimeError"):
        export_bundle(ExportOptions(source="tests.models:batch_baked", out=out, batch_max=4))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (dict(source="torchvision:no_such_net"), "torchvision has no model 'no_such_net'"),
        (dict(source="resnet18"), "neither `torchvision:NAME` nor `package.module:callable`"),
        (dict(source="tests.models:not_a_module"), "returned a int, expected a torch.nn.Module"),
        (dict(source="tests.models:missing"), "has no attribute 'missing'"),
        (dict(source="no_such_pkg.mod:f"), "cannot import 'no_such_pkg.mod'"),
        (dict(source="tests.models:tiny_residual", granularity="fine"), "expected top, block, layer, op"),
        (dict(source="tests.models:tiny_residual", reference_batches=(100,)), "reference batch size 100 is outside"),
        (dict(source="tests.models:tiny_residual", batch_min=5, batch_max=2), "need 1 <= MIN <= MAX"),
    ],
)
def test_bad_inputs_name_the_problem(tmp_path, opts, message):
    with pytest.raises(ExportError) as e:
        export_bundle(ExportOptions(out=tmp_path / "b", **opts))
    assert message in str(e.value)
    assert not (tmp_path / "b").exists()


def test_cli_reports_errors_with_exit_code_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "cleave_export", "torchvision:no_such_net", "--out", str(tmp_path / "b")],
        cwd=HERE, capture_output=True, text=True,
    )
    assert run.returncode == 2
    assert "cleave_export: error: torchvision has no model 'no_such_net'" in run.stderr


def test_symbolic_dims():
    assert symbolic_dim(64, 64, 2, 3) == 64
    assert symbolic_dim(2, 3, 2, 3) == "B"
    assert symbolic_dim(8, 12, 2, 3) == "4*B"
    assert symbolic_dim(5, 9, 2, 3) == "?"


def test_value_specs_of_nested_values():
    small = (torch.zeros(2, 5), {"n": 7, "none": None}, [1.5])
    large = (torch.zeros(3, 5), {"n": 9, "none": None}, [2.5])
    assert value_spec(small, large, 2, 3, "v") == {
        "type": "tuple",
        "items": [
            {"type": "tensor", "dtype": "float32", "shape": ["B", 5]},
            {"type": "dict", "items": [{"key": "n", "value": {"type": "int"}}, {"key": "none", "value": {"type": "none"}}]},
            {"type": "list", "items": [{"type": "float"}]},
        ],
    }
    assert str(torchscript_type({"type": "list", "items": [{"type": "int"}] * 2})) == "typing.List[int]"
    assert str(torchscript_type({"type": "tuple", "items": [{"type": "tensor"}, {"type": "int"}]})) == "typing.Tuple[torch.Tensor, int]"


def test_fixed_batch_model_exports_with_one_batch_size(tmp_path):
    out, m = tmp_path / "fixed", None
    m = export_bundle(ExportOptions(source="tests.models:batch_baked", out=out, batch_min=3, batch_max=3, reference_batches=(3,))).manifest
    assert m["batch"] == {"min": 3, "max": 3}
    assert m["inputs"][0]["spec"]["shape"] == [3, 4]


def test_missing_parent_directories_are_created(tmp_path):
    out = tmp_path / "new" / "dir" / "residual"
    export_bundle(ExportOptions(source="tests.models:tiny_residual", out=out))
    assert (out / "manifest.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["residual"]
