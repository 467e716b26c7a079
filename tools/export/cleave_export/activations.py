"""Real boundary tensors from an exported bundle, for benchmarking the payload codec:

    python -m cleave_export.activations BUNDLE_DIR --cuts 4,8,12 --batch 8 --out FILE.safetensors

loads the bundle's TorchScript stages, runs a seeded random batch through stages [0, c) for
each requested cut c, and writes every tensor live at those cuts into one safetensors file,
named `cut{c}/{tensor name}` (the tensor names of the manifest's `cuts[c].tensors`).

Inputs are standard normal, which is what the image preprocessing of torchvision models
(mean/std normalisation) makes of natural images to first order; no image files are needed.
Activations after a ReLU keep their exact zeros: that is what a boundary really carries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cleave_export.specs import flatten_tensors


class ActivationError(Exception):
    """The bundle or the request cannot give activations; the message says why."""


def _dim(d, batch: int, where: str) -> int:
    if isinstance(d, int):
        return d
    if d == "B":
        return batch
    if isinstance(d, str) and d.endswith("*B") and d[:-2].isdigit():
        return int(d[:-2]) * batch
    raise ActivationError(f"{where}: dimension {d!r} has no size at batch {batch}")


def random_inputs(manifest: dict, batch: int, seed: int) -> list[torch.Tensor]:
    """One standard-normal tensor per model input, at `batch` (float inputs only)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for entry in manifest["inputs"]:
        spec, name = entry["spec"], entry["name"]
        if spec.get("type") != "tensor" or not spec["dtype"].startswith("float"):
            raise ActivationError(f"input {name!r} is not a float tensor ({spec}); only float inputs can be drawn at random here")
        shape = [_dim(d, batch, f"input {name!r}") for d in spec["shape"]]
        inputs.append(torch.randn(shape, generator=gen, dtype=getattr(torch, spec["dtype"])))
    return inputs


def cut_activations(bundle: Path, cuts: list[int], batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor at each of `cuts`, named `cut{c}/{tensor name}`."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    n_cuts = len(manifest["cuts"])
    for c in cuts:
        if not 0 <= c < n_cuts:
            raise ActivationError(f"cut {c} does not exist: {bundle} has cuts 0..{n_cuts - 1}")
    lo, hi = manifest["batch"]["min"], manifest["batch"]["max"]
    if not lo <= batch <= hi:
        raise ActivationError(f"batch {batch} is outside the bundle's batch range {lo}..{hi}")
    values: list = random_inputs(manifest, batch, seed)
    wanted, out = set(cuts), {}
    with torch.no_grad():
        for c in range(max(cuts) + 1):
            if c > 0:
                stage = torch.jit.load(str(bundle / manifest["stages"][c - 1]["file"])).eval()
                values = list(stage(*values))
            if c not in wanted:
                continue
            cut = manifest["cuts"][c]
            tensors = [leaf for v, x in zip(cut["values"], values) for leaf in flatten_tensors(v["name"], x)]
            names = [t["name"] for t in cut["tensors"]]
            if [n for n, _ in tensors] != names:
                raise ActivationError(f"cut {c}: the stages gave tensors {[n for n, _ in tensors]}, the manifest names {names}")
            out.update({f"cut{c}/{n}": t.detach().contiguous().clone() for n, t in tensors})
    return out


def _describe(name: str, t: torch.Tensor) -> str:
    zeros = (t == 0).double().mean().item() if t.is_floating_point() else float("nan")
    return f"  {name}: {t.dtype} {list(t.shape)}, {t.numel() * t.element_size():,} bytes, {zeros:.1%} exact zeros"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cleave_export.activations",
        description="Write the tensors at some cuts of a bundle, for a seeded random input batch, as one safetensors file.",
    )
    p.add_argument("bundle", type=Path, help="an exported bundle directory (manifest.json, stage_NNN.pt)")
    p.add_argument("--cuts", required=True, help="comma-separated cut indices, e.g. 4,8,12")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--out", required=True, type=Path, help="safetensors file to write")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from safetensors.torch import save_file

    try:
        cuts = sorted({int(c) for c in a.cuts.split(",") if c.strip()})
    except ValueError:
        p.error(f"--cuts {a.cuts!r}: expected comma-separated integers")
    if not cuts:
        p.error("--cuts names no cut")
    try:
        tensors = cut_activations(a.bundle, cuts, a.batch, a.seed)
    except (ActivationError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(a.out)
    print(f"wrote {a.out}: cuts {','.join(map(str, cuts))} at batch {a.batch} (seed {a.seed})")
    for name, t in tensors.items():
        print(_describe(name, t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
