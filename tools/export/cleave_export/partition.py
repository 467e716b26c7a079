"""Cut a traced graph into a chain of stages and work out what is live at every cut.

Nodes are grouped by module path truncated to the granularity's depth; each maximal run
of nodes with the same group is a candidate stage. The live set after a stage is every
value defined at or before it that a later node (or the output) still uses, so a cut
inside a residual block carries both the main path and the skip tensor. A candidate cut
whose live values cannot be TorchScript stage inputs is merged away, with the reason kept.
Parameters and buffers read with `get_attr` never cross a cut: each stage that needs one
gets its own reference. Sizes never cross a cut either: an integer computed from tensor
sizes (the batch, the sequence length, a product of them for a reshape) is computed again
in each stage that needs it, from a tensor of the stage's input with the same size at every
probe, so a peer never sends a number the stage would reshape by.

At the named granularities a group descends through module lists (and through a module that
only holds one, like a transformer's encoder), so `block` cuts between transformer layers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from cleave_export import ExportError, huggingface
from cleave_export.specs import Probe, Unrepresentable, line_through, torchscript_type, value_spec
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
    sizes: "_SizeArithmetic | None" = None
    """The integers computed from sizes, which each stage computes again."""
    refused: dict[str, str] = field(default_factory=dict)
    """The cuts it was told not to make (`partition`'s `refused`)."""


def _group_key(node: fx.Node, depth: int | None, keys: dict[fx.Node, str], values: dict, blocks: "_Blocks") -> str:
    path = node.meta.get(MODULE_PATH, "")
    # Unpacking a call's tuple, dict or output object (a named tuple, a transformers
    # ModelOutput: `out.logits`) belongs to the call that produced it, so the container
    # never has to cross a cut.
    if node.op == "call_function" and node.target in (operator.getitem, getattr):
        src = node.args[0]
        if isinstance(src, fx.Node) and src in keys and _is_container(values.get(src.name)):
            return keys[src]
    if node.op == "call_module":
        # A module call is named by the module it stands for (an exported graph's dropout
        # module by the module it was recorded in), truncated to the granularity's depth.
        parts = (path or str(node.target)).split(".")
        return ".".join(parts if depth is None else blocks.prefix(parts, depth))
    if depth is None:
        return f"{path}:{node.name}" if path else node.name
    parts = path.split(".") if path else []
    if len(parts) >= depth:
        return ".".join(blocks.prefix(parts, depth))
    # The model's own operations are cut between one another; a module's, run together.
    return f"{path}:ops" if path else node.name


def _is_container(value) -> bool:
    """A tuple, list or dict (named tuples, ModelOutputs and OrderedDicts among them), or an
    object holding tensors in its attributes."""
    if isinstance(value, (tuple, list, dict)):
        return True
    attributes = getattr(value, "__dict__", None) or {}
    return not isinstance(value, torch.Tensor) and any(isinstance(v, torch.Tensor) for v in attributes.values())


class _Blocks:
    """Where a module path is cut at a depth: deeper through module lists, so that the layers
    of a stack (`transformer.h.0`, `bert.encoder.layer.0`) are groups of their own, and
    counted from a transformers model inside the user's (`inner.transformer.h.0` is cut as
    `transformer.h.0` would be)."""

    def __init__(self, model: nn.Module | None, descend: bool):
        self.model = model if descend else None
        self.wrapping: dict[str, int] = {}

    def prefix(self, parts: list[str], depth: int) -> list[str]:
        n = depth + self._wrapping(parts)
        while self.model is not None and n < len(parts) and self._holds_a_list(parts[:n]):
            n += 1
        return parts[:n]

    def _wrapping(self, parts: list[str]) -> int:
        """How many leading parts of `parts` lead to a transformers model inside the model (0: none)."""
        if self.model is None or huggingface.is_transformers_model(self.model):
            return 0
        for k in range(1, len(parts)):
            key = ".".join(parts[:k])
            if key not in self.wrapping:
                try:
                    self.wrapping[key] = k if huggingface.is_transformers_model(self.model.get_submodule(key)) else 0
                except AttributeError:
                    self.wrapping[key] = 0
            if self.wrapping[key]:
                return k
        return 0

    def _holds_a_list(self, parts: list[str]) -> bool:
        try:
            module = self.model.get_submodule(".".join(parts))
        except AttributeError:
            return False
        lists = (nn.ModuleList, nn.ModuleDict)
        children = list(module.children())
        return isinstance(module, lists) or (len(children) == 1 and isinstance(children[0], lists))


def partition(
    gm: fx.GraphModule,
    depth: int | None,
    recorded: list[dict[str, object]],
    probes: list[Probe],
    model: nn.Module | None = None,
    descend: bool = False,
    refused: dict[str, str] | None = None,
) -> Partition:
    """Split `gm` into stages; `recorded[i]` is every node's value at `probes[i]`. `model` (the
    traced model, with its module types) and `descend` make groups descend through module lists.
    `refused` names cuts not to make, by the node before them, with the reason (a stage found
    unable to take what crosses there)."""
    refused = refused or {}
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
    if not compute:
        raise ExportError("the traced model has no operations to split")

    keys: dict[fx.Node, str] = {}
    groups: list[list[fx.Node]] = []
    blocks = _Blocks(model, descend)
    for n in compute:
        keys[n] = _group_key(n, depth, keys, recorded[0], blocks)
        if groups and keys[groups[-1][-1]] == keys[n]:
            groups[-1].append(n)
        else:
            groups.append([n])

    sizes = _SizeArithmetic(compute, recorded)
    position = {n: i for i, n in enumerate(compute)}
    for i, p in enumerate(placeholders):
        position[p] = -1
    end = len(compute)

    def last_use(n: fx.Node) -> int:
        return max((end if u is output else position.get(u, -1) for u in n.users), default=-1)

    last = {n: last_use(n) for n in placeholders + compute}

    def live_after(pos: int) -> list[fx.Node]:
        return [n for n in placeholders + compute if position[n] <= pos < last[n] and n not in sizes]

    def spec_of(n: fx.Node) -> dict:
        return value_spec([r[n.name] for r in recorded], probes, f"value {n.name!r}")

    # Keep a candidate cut only if every live value there can be a TorchScript stage input
    # and every size used after it can be computed again from its tensors.
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
        if all(n in sizes for n in group):
            continue  # sizes alone: every stage computes them again anyway
        if group[-1].name in refused:
            merged.append(f"after {keys[group[0]]}: {refused[group[-1].name]}")
            continue
        pos = position[group[-1]]
        values = live_after(pos)
        try:
            specs = [spec_of(v) for v in values]
            for s in specs:
                torchscript_type(s)
            sizes.check_available_after(pos, position, last, values)
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
            path = n.meta.get(MODULE_PATH) or (str(n.target) if n.op == "call_module" else "")
            if path and path not in seen:
                seen.append(path)
        stage.modules = seen
    return Partition(stages, cuts, _output_tree(output.args[0]), merged, sizes, dict(refused))


_SIZE_OPS = {torch.ops.aten.size, torch.ops.aten.sym_size, torch.ops.aten.sym_numel, torch.ops.aten.numel}
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.neg}


class _SizeArithmetic:
    """The integers a graph computes from tensor sizes, which stages compute again rather than
    carry across a cut: a tensor's size, or arithmetic on such integers and constants."""

    def __init__(self, compute: list[fx.Node], recorded: list[dict[str, object]]):
        self.recorded = recorded
        self.nodes: set[fx.Node] = set()
        for n in compute:
            if all(type(r[n.name]) is int for r in recorded) and (self.is_size(n) or self.is_arithmetic(n)):
                self.nodes.add(n)

    def __contains__(self, n: fx.Node) -> bool:
        return n in self.nodes

    def is_size(self, n: fx.Node) -> bool:
        if n.op == "call_method" and n.target in ("size", "numel"):
            return True
        return n.op == "call_function" and n.target in _SIZE_OPS

    def is_arithmetic(self, n: fx.Node) -> bool:
        if n.op != "call_function" or n.target not in _ARITHMETIC or n.kwargs:
            return False
        return all(a in self.nodes if isinstance(a, fx.Node) else type(a) is int for a in n.args)

    def values(self, n: fx.Node) -> list[int]:
        return [r[n.name] for r in self.recorded]

    def matching_dim(self, n: fx.Node, tensors: list[fx.Node]) -> tuple[fx.Node, int, int, int] | None:
        """(t, d, k, c): a tensor among `tensors` and a dimension of it whose size times k plus c
        is `n` at every probe; k = 1 and c = 0 unless the dimension takes three sizes or more
        there (a waveform's samples, `k*S+c`, from its frames, `S`)."""
        want = self.values(n)
        for t in tensors:
            if not all(isinstance(r.get(t.name), torch.Tensor) for r in self.recorded):
                continue
            for d in range(self.recorded[0][t.name].dim()):
                have = [r[t.name].shape[d] for r in self.recorded]
                if have == want:
                    return t, d, 1, 0
                line = line_through(want, have) if len(set(have)) >= 3 else None
                if line is not None:
                    return t, d, *line
        return None

    def computable(self, n: fx.Node, available: list[fx.Node]) -> bool:
        """Whether `n` can be computed from the tensors in `available` (and constants)."""
        if n in available:
            return True
        if self.is_arithmetic(n):
            return all(self.computable(a, available) for a in n.args if isinstance(a, fx.Node))
        return self.matching_dim(n, available) is not None

    def check_available_after(self, pos: int, position: dict, last: dict, live: list[fx.Node]) -> None:
        """Raise Unrepresentable unless every size defined up to `pos` and used after it can be
        computed again from the tensors live there."""
        for n in self.nodes:
            if position[n] <= pos < last[n] and not self.computable(n, live):
                raise Unrepresentable(f"the size {n.name!r} (values {self.values(n)}) is no dimension of a tensor live here")


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


def stage_module(gm: fx.GraphModule, part: Partition, index: int) -> fx.GraphModule:
    """A GraphModule running stage `index`: positional inputs are its input cut's values, in
    order, and it returns a tuple of its output cut's values, in order."""
    stage, inputs, outputs = part.stages[index], part.cuts[index], part.cuts[index + 1]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, spec in zip(inputs.values, inputs.specs):
        env[node] = graph.placeholder(node.name, type_expr=torchscript_type(spec))

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op == "get_attr":
                env[n] = graph.node_copy(n)
            elif part.sizes is not None and n in part.sizes:
                env[n] = recompute_size(n)
            else:
                raise ExportError(f"stage {stage.name!r} needs {n.name!r}, which is not live at its input cut")
        return env[n]

    def recompute_size(n: fx.Node) -> fx.Node:
        # Arithmetic from its operands (sizes themselves); a size from its tensor when the stage
        # has it, else from a tensor it has with the same size at every probe.
        if part.sizes.is_arithmetic(n) or all(a in env for a in n.args if isinstance(a, fx.Node)):
            return graph.node_copy(n, lookup)
        match = part.sizes.matching_dim(n, list(env))
        if match is None:
            raise ExportError(f"stage {stage.name!r} needs the size {n.name!r}, which no tensor of its input has")
        t, d, k, c = match
        size = graph.call_method("size", (env[t], d))
        size = graph.call_function(operator.mul, (size, k)) if k != 1 else size
        return graph.call_function(operator.add, (size, c)) if c else size

    for n in stage.nodes:
        env[n] = graph.node_copy(n, lookup)
    graph.output(tuple(lookup(v) for v in outputs.values))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=f"Stage{index}")
