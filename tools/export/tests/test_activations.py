"""`python -m cleave_export.activations`: the tensors at chosen cuts of a bundle, named
`cut{c}/{tensor name}`, equal to running the stages by hand, and reproducible."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cleave_export.activations import ActivationError, cut_activations, main, random_inputs
from cleave_export.bundle import ExportOptions, export_bundle


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    out = tmp_path_factory.mktemp("residual") / "residual"
    export_bundle(ExportOptions(source="tests.models:tiny_residual", out=out, granularity="op"))
    return out


def test_every_tensor_of_each_cut_matches_the_chain(residual, tmp_path):
    manifest = json.loads((residual / "manifest.json").read_text())
    # A cut inside the residual block carries two tensors (x and the branch).
    two = next(c["index"] for c in manifest["cuts"] if len(c["tensors"]) == 2)
    last = len(manifest["cuts"]) - 1
    out = tmp_path / "act.safetensors"
    assert main([str(residual), "--cuts", f"{last},{two}", "--batch", "3", "--out", str(out)]) == 0
    got = load_file(str(out))
    names = [f"cut{c}/{t['name']}" for c in (two, last) for t in manifest["cuts"][c]["tensors"]]
    assert sorted(got) == sorted(names)
    values = random_inputs(manifest, 3, seed=0)
    with torch.no_grad():
        for c in range(1, last + 1):
            stage = torch.jit.load(str(residual / manifest["stages"][c - 1]["file"])).eval()
            values = list(stage(*values))
            if c == last:
                (name,) = [n for n in names if n.startswith(f"cut{last}/")]
                assert torch.equal(got[name], values[0])
    assert got[names[0]].shape[0] == 3
    again = cut_activations(residual, [two, last], 3)
    assert sorted(again) == sorted(got) and all(torch.equal(got[k], again[k]) for k in got)


def test_bad_cuts_and_batches_are_refused(residual):
    with pytest.raises(ActivationError, match="cut 99 does not exist"):
        cut_activations(residual, [99], 2)
    with pytest.raises(ActivationError, match="outside the bundle's batch range"):
        cut_activations(residual, [1], 10_000)
