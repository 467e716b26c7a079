"""Trace a model into an operation graph whose nodes know the module they came from.

We trace with torch.fx rather than torch.export: fx keeps `nn.Module` calls as graph nodes
(leaves), so each stage can be compiled with `torch.jit.script` and keeps its modules'
train/eval behaviour (batch norm statistics, dropout), which split training needs; an
ATen-level export graph has the mode baked in and its parameters lifted out of the modules.

Modules whose Python code fx cannot trace (data-dependent control flow, for instance) are
made leaves automatically: the trace is retried with the failing module kept whole, so the
model still splits everywhere around it.

A model's attribute whose name `fx.GraphModule` uses itself (a submodule called `meta`,
`graph` or `code`) is renamed in the graph (`cleave_meta`); nodes keep the original module
path, and the manifest lists each rename.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none

from cleave_export import ExportError, first_line
from cleave_export.sources import forward_parameters

log = logging.getLogger(__name__)

MODULE_PATH = "module_path"
"""Key in `node.meta`: dotted path of the innermost module the node was created in ('' = root)."""

RENAMED = "cleave_renamed"
"""Key in a traced `GraphModule.meta`: {original attribute name: its name in the graph}."""

GRAPH_MODULE_NAMES = frozenset(dir(fx.GraphModule(nn.Module(), fx.Graph()))) - frozenset(dir(nn.Module()))
"""Attributes a GraphModule has and a plain Module does not (`meta`, `graph`, `code`, ...):
a model attribute of one of these names cannot be copied onto the graph module as it is."""


@functools.cache
def _reads_training_flag(cls: type) -> bool:
    # A module that branches on `self.training` would have that branch frozen by tracing
    # through it, so it is kept whole (a leaf) to keep its train/eval behaviour.
    try:
        return "self.training" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


class ModulePathTracer(fx.Tracer):
    """An fx tracer that records module paths and can be told to keep given modules whole."""

    def __init__(self, forced_leaves: set[str]):
        super().__init__()
        self.forced_leaves = forced_leaves
        self.path_stack: list[str] = []
        self.failed_module: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.forced_leaves:
            return True
        if qualname and _reads_training_flag(type(m)):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        self.path_stack.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost module that failed is the one to keep whole on the next try.
            if self.failed_module is None:
                self.failed_module = path
            raise
        finally:
            self.path_stack.pop()

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        node.meta[MODULE_PATH] = self.path_stack[-1] if self.path_stack else ""
        return node


def trace(model: nn.Module, num_inputs: int) -> tuple[fx.GraphModule, list[str]]:
    """Trace `model` taking its first `num_inputs` forward arguments as inputs.

    Returns the graph module and the modules that had to be kept whole, in the order found.
    """
    params = forward_parameters(model)
    concrete = {}
    for p in params[num_inputs:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise ExportError(
                f"forward argument {p.name!r} has no default and no example input was given for it"
            )
        concrete[p.name] = p.default
    forced: list[str] = []
    while True:
        tracer = ModulePathTracer(set(forced))
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:
            failed = tracer.failed_module
            if not failed or failed in forced:
                where = f"module {failed!r}" if failed else f"{type(model).__name__}.forward itself"
                raise TraceError(
                    f"torch.fx cannot trace {where}: {type(e).__name__}: {first_line(e)}", at_root=not failed
                ) from e
            log.info("keeping %s (%s) whole: %s", failed, type(model.get_submodule(failed)).__name__, first_line(e))
            forced.append(failed)
            continue
        _drop_guards_on_fixed_arguments(graph, num_inputs)
        return graph_module(tracer.root, graph, type(model).__name__), forced


def _drop_guards_on_fixed_arguments(graph: fx.Graph, num_inputs: int) -> None:
    """Removes the checks torch.fx adds that a forward argument fixed at its default (every
    one after the first `num_inputs`) still has it (`_assert_is_none(attn_mask)`,
    `torch._assert(is_causal == False)`), and those arguments where nothing else reads them:
    the stages get no such argument, and a check of nothing would be a stage of its own."""
    placeholders = set([n for n in graph.nodes if n.op == "placeholder"][num_inputs:])
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_assert_is_none, torch._assert):
            continue
        checked = node.args[0]
        reads = {checked} | (set(checked.all_input_nodes) if isinstance(checked, fx.Node) else set())
        if reads & placeholders:
            graph.erase_node(node)
            if isinstance(checked, fx.Node) and checked.op != "placeholder" and not checked.users:
                graph.erase_node(checked)
    for placeholder in placeholders:
        if not placeholder.users:
            graph.erase_node(placeholder)


def graph_module(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """`fx.GraphModule(root, graph)`, with the root's attributes whose names the graph module
    uses itself renamed (listed in `gm.meta[RENAMED]`)."""
    renamed = _renames(root, graph)
    if not renamed:
        gm = fx.GraphModule(root, graph, class_name=class_name)
        gm.meta[RENAMED] = {}
        return gm
    attributes = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            first, _, rest = node.target.partition(".")
            value = functools.reduce(getattr, node.target.split("."), root)
            if first in renamed:
                node.target = renamed[first] + ("." + rest if rest else "")
            attributes[node.target] = value
    gm = fx.GraphModule(attributes, graph, class_name=class_name)
    gm.train(root.training)
    gm.meta[RENAMED] = renamed
    for original, new in renamed.items():
        log.info("%s.%s is called %s in the graph (fx.GraphModule has an attribute %r)", class_name, original, new, original)
    return gm


def _renames(root: nn.Module, graph: fx.Graph) -> dict[str, str]:
    """{name: new name} for the root attributes the graph uses whose names clash with the graph module's."""
    used = {str(n.target).partition(".")[0] for n in graph.nodes if n.op in ("call_module", "get_attr")}
    renamed = {}
    for name in sorted(used & GRAPH_MODULE_NAMES):
        new = f"cleave_{name}"
        while hasattr(root, new) or new in used or new in renamed.values():
            new = f"_{new}"
        renamed[name] = new
    return renamed


class TraceError(ExportError):
    """torch.fx could not trace the model; `at_root` when the model's own forward failed (no
    module to keep whole), where torch.export may still succeed."""

    def __init__(self, message: str, at_root: bool):
        super().__init__(message)
        self.at_root = at_root




class ValueRecorder(fx.Interpreter):
    """Runs a traced graph and keeps the value every node produced."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node):
        try:
            result = super().run_node(n)
        except Exception as e:
            raise ExportError(
                f"running the traced graph failed at node {n.name!r} ({n.op} {n.target}) "
                f"in module {n.meta.get(MODULE_PATH) or '<root>'!r}: {first_line(e)}"
            ) from e
        self.values[n.name] = result
        return result


@torch.no_grad()
def record_values(gm: fx.GraphModule, inputs: tuple) -> dict[str, object]:
    """Every node's value when `gm` runs on `inputs`."""
    recorder = ValueRecorder(gm)
    recorder.run(*inputs)
    return recorder.values
