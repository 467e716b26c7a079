"""Value specs: what crosses a cut, with symbolic shapes, as written into the manifest.

A spec is a JSON tree: `{"type": "tensor", "dtype": "float32", "shape": ["B", 64, 56, 56]}`
for a tensor, `{"type": "int"}` (also float, bool, str, none) for plain values, and
`{"type": "tuple" | "list", "items": [...]}` or `{"type": "dict", "items": [{"key", "value"}]}`
for containers. A dimension is an integer, `"B"` (the batch size), `"k*B"`, or `"?"` when it
depends on the data.
"""

from __future__ import annotations

import math
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


def symbolic_dim(small: int, large: int, b_small: int, b_large: int) -> int | str:
    """A dimension seen at two batch sizes, as an integer, "B", "k*B" or "?"."""
    if small == large:
        return small
    if small % b_small == 0 and small // b_small * b_large == large:
        k = small // b_small
        return "B" if k == 1 else f"{k}*B"
    return "?"


def value_spec(small, large, b_small: int, b_large: int, where: str) -> dict:
    """The spec of a value recorded at two batch sizes (the same value twice when batch is fixed)."""
    if isinstance(small, torch.Tensor):
        if small.dtype not in DTYPE_NAMES:
            raise Unrepresentable(f"{where} is a tensor of unsupported dtype {small.dtype}")
        if small.dim() != large.dim():
            raise Unrepresentable(f"{where} changes rank with the batch size")
        shape = [symbolic_dim(a, b, b_small, b_large) for a, b in zip(small.shape, large.shape)]
        return {"type": "tensor", "dtype": DTYPE_NAMES[small.dtype], "shape": shape}
    if small is None:
        return {"type": "none"}
    for py, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(small) is py:
            return {"type": name}
    if isinstance(small, (tuple, list)):
        if len(small) != len(large):
            raise Unrepresentable(f"{where} changes length with the batch size")
        kind = "tuple" if isinstance(small, tuple) and not isinstance(small, torch.Size) else "list"
        items = [value_spec(a, b, b_small, b_large, f"{where}[{i}]") for i, (a, b) in enumerate(zip(small, large))]
        return {"type": kind, "items": items}
    if isinstance(small, dict):
        if not all(isinstance(k, str) for k in small) or small.keys() != large.keys():
            raise Unrepresentable(f"{where} is a dict whose keys are not fixed strings")
        items = [{"key": k, "value": value_spec(small[k], large[k], b_small, b_large, f"{where}[{k!r}]")} for k in small]
        return {"type": "dict", "items": items}
    raise Unrepresentable(f"{where} is a {type(small).__name__}, which cannot cross a cut")


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


def bytes_per_sample(specs: list[dict]) -> tuple[int, int, bool]:
    """(bytes per sample, fixed bytes per request, whether every size is known) for tensor leaves."""
    per_sample, fixed, known = 0, 0, True
    for spec in specs:
        for _, leaf in tensor_leaves("", spec):
            size = element_size(leaf["dtype"])
            scale = 0
            for d in leaf["shape"]:
                if d == "?":
                    known = False
                elif isinstance(d, str):
                    scale += int(d.split("*")[0]) if "*" in d else 1
                else:
                    size *= d
            if scale:
                per_sample += size * scale
            else:
                fixed += size
    return per_sample, fixed, known


def shape_at(spec_shape: list, batch: int) -> list[int]:
    """A symbolic shape made concrete at a batch size ("?" stays unknown as -1)."""
    out = []
    for d in spec_shape:
        if d == "B":
            out.append(batch)
        elif isinstance(d, str) and d.endswith("*B"):
            out.append(int(d[:-2]) * batch)
        elif d == "?":
            out.append(-1)
        else:
            out.append(d)
    return out


def check_value(spec: dict, value, batch: int, where: str) -> None:
    """Raise ValueError if `value` does not match `spec` at `batch`."""
    kind = spec["type"]
    if kind == "tensor":
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
        want = shape_at(spec["shape"], batch)
        got = list(value.shape)
        if DTYPE_NAMES.get(value.dtype) != spec["dtype"] or len(got) != len(want) or any(
            w not in (-1, g) for w, g in zip(want, got)
        ):
            raise ValueError(f"{where}: expected {spec['dtype']}{want}, got {DTYPE_NAMES.get(value.dtype)}{got}")
    elif kind in ("tuple", "list"):
        if not isinstance(value, (tuple, list)) or len(value) != len(spec["items"]):
            raise ValueError(f"{where}: expected a {kind} of {len(spec['items'])} items")
        for i, (s, v) in enumerate(zip(spec["items"], value)):
            check_value(s, v, batch, f"{where}[{i}]")
    elif kind == "dict":
        for item in spec["items"]:
            check_value(item["value"], value[item["key"]], batch, f"{where}[{item['key']!r}]")


def prod(xs) -> int:
    return math.prod(xs)
