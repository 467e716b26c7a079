"""Cut a traced graph into a chain of stages and work out what is live at every cut.

Nodes are grouped by module path truncated to the granularity's depth; each maximal run
of nodes with the same group is a candidate stage. The live set after a stage is every
value defined at or before it that a later node (or the output) still uses, so a cut
inside a residual block carries both the main path and the skip tensor. A candidate cut
whose live values cannot be TorchScript stage inputs is merged away, with the reason kept.
Parameters and buffers read with `get_attr` never cross a cut: each stage that needs one
gets its own reference.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from cleave_export import ExportError
from cleave_export.specs import Unrepresentable, torchscript_type, value_spec
from cleave_export.tracing import MODULE_PATH

GRANULARITY_DEPTH = {"top": 1, "block": 2, "layer": 3, "op": None}


def parse_granularity(text: str) -> int | None:
    """`top`, `block`, `layer`, `op`, or a module depth (1, 2, ...); None means every operation."""
    if text in GRANULARITY_DEPTH:
        return GRANULARITY_DEPTH[text]
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ExportError(f"--granularity {text!r}: expected top, block, layer, op or a positive depth")


@dataclass
class Stage:
    """A run of graph nodes executed together; it maps the live set of one cut to the next."""

    name: str
    nodes: list[fx.Node]
    modules: list[str] = field(default_factory=list)


@dataclass
class Cut:
    """A point between two stages and the values live there."""

    name: str
    values: list[fx.Node]
    specs: list[dict]


@dataclass
class Partition:
    """The stage chain: `cuts[i]` feeds `stages[i]`, which produces `cuts[i + 1]`."""

    stages: list[Stage]
    cuts: list[Cut]
    output_tree: dict
    merged: list[str]
    """Candidate cuts that were merged away, each with its reason."""


def _group_key(node: fx.Node, depth: int | None, keys: dict[fx.Node, str], values: dict) -> str:
    path = node.meta.get(MODULE_PATH, "")
    # Unpacking a call's tuple (or dict) result belongs to the call that produced it.
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and src in keys and isinstance(values.get(src.name), (tuple, list, dict)):
            return keys[src]
    if node.op == "call_module":
        # A module call is named by the module itself, truncated to the granularity's depth.
        parts = str(node.target).split(".")
        return ".".join(parts if depth is None else parts[:depth])
    if depth is None:
        return f"{path}:{node.name}" if path else node.name
    parts = path.split(".") if path else []
    if len(parts) >= depth:
        return ".".join(parts[:depth])
    return f"{path}:{node.name}" if path else node.name


def partition(
    gm: fx.GraphModule,
    depth: int | None,
    small: dict[str, object],
    large: dict[str, object],
    b_small: int,
    b_large: int,
) -> Partition:
    """Split `gm` into stages; `small`/`large` are every node's values at two batch sizes."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
    if not compute:
        raise ExportError("the traced model has no operations to split")

    keys: dict[fx.Node, str] = {}
    groups: list[list[fx.Node]] = []
    for n in compute:
        keys[n] = _group_key(n, depth, keys, small)
        if groups and keys[groups[-1][-1]] == keys[n]:
            groups[-1].append(n)
        else:
            groups.append([n])

    position = {n: i for i, n in enumerate(compute)}
    for i, p in enumerate(placeholders):
        position[p] = -1
    end = len(compute)

    def last_use(n: fx.Node) -> int:
        return max((end if u is output else position.get(u, -1) for u in n.users), default=-1)

    last = {n: last_use(n) for n in placeholders + compute}

    def live_after(pos: int) -> list[fx.Node]:
        return [n for n in placeholders + compute if position[n] <= pos < last[n]]

    def spec_of(n: fx.Node) -> dict:
        return value_spec(small[n.name], large[n.name], b_small, b_large, f"value {n.name!r}")

    # Keep a candidate cut only if every live value there can be a TorchScript stage input.
    stages: list[Stage] = []
    cuts = [Cut("input", placeholders, [spec_of(p) for p in placeholders])]
    merged: list[str] = []
    pending_nodes: list[fx.Node] = []
    pending_keys: list[str] = []
    for gi, group in enumerate(groups):
        pending_nodes.extend(group)
        pending_keys.append(keys[group[0]])
        if gi == len(groups) - 1:
            break
        values = live_after(position[group[-1]])
        try:
            specs = [spec_of(v) for v in values]
            for s in specs:
                torchscript_type(s)
        except Unrepresentable as e:
            merged.append(f"after {keys[group[0]]}: {e}")
            continue
        name = _stage_name(pending_keys)
        stages.append(Stage(name, pending_nodes))
        cuts.append(Cut(f"after {name}", values, specs))
        pending_nodes, pending_keys = [], []
    stages.append(Stage(_stage_name(pending_keys), pending_nodes))
    final_values = [n for n in placeholders + compute if last[n] == end]
    cuts.append(Cut("output", final_values, [spec_of(v) for v in final_values]))

    for stage in stages:
        seen: list[str] = []
        for n in stage.nodes:
            path = str(n.target) if n.op == "call_module" else n.meta.get(MODULE_PATH, "")
            if path and path not in seen:
                seen.append(path)
        stage.modules = seen
    return Partition(stages, cuts, _output_tree(output.args[0]), merged)


def _stage_name(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else f"{keys[0]} .. {keys[-1]}"


def _output_tree(arg) -> dict:
    """The model's output structure, with `ref` leaves naming values of the final cut."""
    if isinstance(arg, fx.Node):
        return {"type": "ref", "name": arg.name}
    if isinstance(arg, (tuple, list)):
        return {"type": "tuple" if isinstance(arg, tuple) else "list", "items": [_output_tree(a) for a in arg]}
    if isinstance(arg, dict):
        return {"type": "dict", "items": [{"key": str(k), "value": _output_tree(v)} for k, v in arg.items()]}
    raise ExportError(f"the model's output contains a constant {arg!r}; outputs must be computed tensors")


def stage_module(gm: fx.GraphModule, stage: Stage, inputs: Cut, outputs: Cut, index: int) -> fx.GraphModule:
    """A GraphModule running `stage`: positional inputs are the input cut's values, in order,
    and it returns a tuple of the output cut's values, in order."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, spec in zip(inputs.values, inputs.specs):
        env[node] = graph.placeholder(node.name, type_expr=torchscript_type(spec))

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise ExportError(f"stage {stage.name!r} needs {n.name!r}, which is not live at its input cut")
            env[n] = graph.node_copy(n)
        return env[n]

    for n in stage.nodes:
        env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(lookup(v) for v in outputs.values))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=f"Stage{index}")
