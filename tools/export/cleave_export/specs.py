"""Value specs: what crosses a cut, with symbolic shapes, as written into the manifest.

A spec is a JSON tree: `{"type": "tensor", "dtype": "float32", "shape": ["B", 64, 56, 56]}`
for a tensor, `{"type": "int"}` (also float, bool, str, none) for plain values, and
`{"type": "tuple" | "list", "items": [...]}` or `{"type": "dict", "items": [{"key", "value"}]}`
for containers. A dimension is an integer, `"B"` (the batch size), `"k*B"`, `"S"` (the
sequence length, in bundles exported with `--dynamic-seq`), `"k*S"`, `"k*S+c"` or `"k*S-c"`
(a waveform's samples, say, when S counts its frames: `320*S+80`), or `"?"` when it depends on
the data (or on the batch and the sequence together).

Symbols are found by running the model at several *probes*: a base point, one with another
batch size and, with a dynamic sequence, two with other sequence lengths. A dimension that
follows one of them in proportion is that symbol; one that follows the sequence length along a
line that misses zero (`S-1`) is `k*S+c`, where three lengths show it is no coincidence.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


class Unrepresentable(Exception):
    """A value whose type cannot cross a cut (it cannot be a stage input in TorchScript)."""


@dataclass(frozen=True)
class Probe:
    """A point the model is run at to tell symbolic dimensions from fixed ones."""

    batch: int
    seq: int | None = None
    """The sequence length, in bundles with a dynamic sequence."""

    def unit(self, symbol: str) -> int | None:
        return self.batch if symbol == "B" else self.seq


def symbolic_dim(sizes: list[int], probes: list[Probe]) -> int | str:
    """A dimension seen at every probe, as an integer, "B", "k*B", "S", "k*S", "k*S+c" or "?"."""
    if all(s == sizes[0] for s in sizes):
        return sizes[0]
    for symbol in ("B", "S"):
        line = line_through(sizes, [p.unit(symbol) for p in probes])
        if line is None:
            continue
        k, c = line
        if c == 0 or (symbol == "S" and len({p.seq for p in probes}) >= 3):
            return affine_dim(k, symbol, c)
    return "?"


def line_through(sizes: list[int], units: list[int | None]) -> tuple[int, int] | None:
    """(k, c) with k > 0 and every size k * its unit + c, if there are such integers (two
    distinct units or more; any two points lie on a line, so callers ask for more where c may be
    other than 0)."""
    if None in units or len(set(units)) < 2:
        return None
    (u0, s0), (u1, s1) = sorted(set(zip(units, sizes)))[:2]
    if u0 == u1:
        return None  # one unit, two sizes: the dimension follows something else
    k, rest = divmod(s1 - s0, u1 - u0)
    c = s0 - k * u0
    if rest or k <= 0 or any(k * u + c != s for u, s in zip(units, sizes)):
        return None
    return k, c


def affine_dim(k: int, symbol: str, c: int = 0) -> str:
    """`k*symbol+c` as the manifest writes it: "S", "2*S", "S-1", "320*S+80"."""
    text = symbol if k == 1 else f"{k}*{symbol}"
    return text if c == 0 else f"{text}{c:+d}"


def value_spec(seen: list, probes: list[Probe], where: str) -> dict:
    """The spec of a value recorded at every probe (`seen[i]` at `probes[i]`)."""
    first = seen[0]
    if isinstance(first, torch.Tensor):
        if first.dtype not in DTYPE_NAMES:
            raise Unrepresentable(f"{where} is a tensor of unsupported dtype {first.dtype}")
        if any(v.dim() != first.dim() for v in seen):
            raise Unrepresentable(f"{where} changes rank with the batch size or sequence length")
        shape = [symbolic_dim([v.shape[d] for v in seen], probes) for d in range(first.dim())]
        return {"type": "tensor", "dtype": DTYPE_NAMES[first.dtype], "shape": shape}
    if first is None:
        return {"type": "none"}
    for py, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(first) is py:
            return {"type": name}
    if isinstance(first, (tuple, list)):
        if any(len(v) != len(first) for v in seen):
            raise Unrepresentable(f"{where} changes length with the batch size or sequence length")
        kind = "tuple" if isinstance(first, tuple) and not isinstance(first, torch.Size) else "list"
        items = [value_spec([v[i] for v in seen], probes, f"{where}[{i}]") for i in range(len(first))]
        return {"type": kind, "items": items}
    if isinstance(first, dict):
        if not all(isinstance(k, str) for k in first) or any(v.keys() != first.keys() for v in seen):
            raise Unrepresentable(f"{where} is a dict whose keys are not fixed strings")
        items = [{"key": k, "value": value_spec([v[k] for v in seen], probes, f"{where}[{k!r}]")} for k in first]
        return {"type": "dict", "items": items}
    raise Unrepresentable(f"{where} is a {type(first).__name__}, which cannot cross a cut")


def torchscript_type(spec: dict):
    """The TorchScript annotation for a stage input with this spec."""
    kind = spec["type"]
    simple = {"tensor": torch.Tensor, "int": int, "float": float, "bool": bool, "str": str, "none": Optional[torch.Tensor]}
    if kind in simple:
        return simple[kind]
    items = [torchscript_type(i["value"] if kind == "dict" else i) for i in spec["items"]]
    if kind == "tuple":
        return Tuple[tuple(items)] if items else Tuple[()]
    if not items or any(t != items[0] for t in items):
        raise Unrepresentable(f"a {kind} of mixed or unknown element types cannot be a TorchScript input")
    return List[items[0]] if kind == "list" else Dict[str, items[0]]


def tensor_leaves(name: str, spec: dict) -> list[tuple[str, dict]]:
    """The tensors inside a value, named `name`, `name.0`, `name.key` ... (the wire names)."""
    kind = spec["type"]
    if kind == "tensor":
        return [(name, spec)]
    if kind in ("tuple", "list"):
        return [leaf for i, item in enumerate(spec["items"]) for leaf in tensor_leaves(f"{name}.{i}", item)]
    if kind == "dict":
        return [leaf for item in spec["items"] for leaf in tensor_leaves(f"{name}.{item['key']}", item["value"])]
    return []


def flatten_tensors(name: str, value) -> list[tuple[str, torch.Tensor]]:
    """The tensors inside a runtime value, with the same names as `tensor_leaves`."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in flatten_tensors(f"{name}.{i}", v)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in flatten_tensors(f"{name}.{k}", v)]
    return []


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=_DTYPES_BY_NAME[dtype]).element_size()


_DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def bytes_per_sample(specs: list[dict], seq: int | None = None) -> tuple[int, int, bool]:
    """(bytes per sample, fixed bytes per request, whether every size is known) for tensor
    leaves, at sequence length `seq` (in bundles with a dynamic sequence)."""
    per_sample, fixed, known = 0, 0, True
    for spec in specs:
        for _, leaf in tensor_leaves("", spec):
            if "?" in leaf["shape"]:
                known = False
                continue
            # A tensor's bytes are linear in the batch: its size at batch 1 minus that at batch 0.
            at_one = element_size(leaf["dtype"]) * prod(shape_at(leaf["shape"], 1, seq))
            at_zero = element_size(leaf["dtype"]) * prod(shape_at(leaf["shape"], 0, seq))
            per_sample += at_one - at_zero
            fixed += at_zero
    return per_sample, fixed, known


def dim_at(d, batch: int, seq: int | None = None) -> int:
    """A symbolic dimension made concrete ("?" stays unknown as -1)."""
    if isinstance(d, int):
        return d
    if d == "?":
        return -1
    k, symbol, c = parse_affine(d)
    unit = batch if symbol == "B" else seq
    if unit is None:
        raise ValueError(f"dimension {d!r} needs a sequence length")
    return k * unit + c


_AFFINE = re.compile(r"(?:(\d+)\*)?([BS])(?:([+-]\d+))?")


def parse_affine(d: str) -> tuple[int, str, int]:
    """(k, symbol, c) of a symbolic dimension `k*symbol+c` ("S-1": (1, "S", -1))."""
    m = _AFFINE.fullmatch(d)
    if m is None:
        raise ValueError(f"dimension {d!r} is not an integer, k*B, k*S+c or ?")
    return int(m[1] or 1), m[2], int(m[3] or 0)


def shape_at(spec_shape: list, batch: int, seq: int | None = None) -> list[int]:
    """A symbolic shape made concrete at a batch size and sequence length ("?" stays -1)."""
    return [dim_at(d, batch, seq) for d in spec_shape]


def check_value(spec: dict, value, batch: int, where: str, seq: int | None = None) -> None:
    """Raise ValueError if `value` does not match `spec` at `batch` (and `seq`)."""
    kind = spec["type"]
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
        want = shape_at(spec["shape"], batch, seq)
        got = list(value.shape)
        if DTYPE_NAMES.get(value.dtype) != spec["dtype"] or len(got) != len(want) or any(
            w not in (-1, g) for w, g in zip(want, got)
        ):
            raise ValueError(f"{where}: expected {spec['dtype']}{want}, got {DTYPE_NAMES.get(value.dtype)}{got}")
    elif kind in ("tuple", "list"):
        if not isinstance(value, (tuple, list)) or len(value) != len(spec["items"]):
            raise ValueError(f"{where}: expected a {kind} of {len(spec['items'])} items")
        for i, (s, v) in enumerate(zip(spec["items"], value)):
            check_value(s, v, batch, f"{where}[{i}]", seq)
    elif kind == "dict":
        for item in spec["items"]:
            check_value(item["value"], value[item["key"]], batch, f"{where}[{item['key']!r}]", seq)


def prod(xs) -> int:
    return math.prod(xs)
