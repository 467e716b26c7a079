"""Trace with torch.export where torch.fx cannot (Hugging Face transformers, models whose own
forward fx cannot follow), into the same kind of graph the rest of the exporter cuts.

torch.export runs the model's Python (so `**kwargs`, config branches and mask helpers are fine)
and records ATen operations with symbolic batch and sequence sizes. Its graph is made ready
for cutting and for `torch.jit.script`:

- each node's module path comes from the `nn_module_stack` torch.export records;
- operator overloads become their overload packets (`aten.linear` rather than
  `aten.linear.default`), which TorchScript resolves by schema; `sym_size` becomes `aten.size`;
- runtime shape assertions and the guard function are dropped (the exporter validates the
  stages at several batch sizes and sequence lengths instead);
- the model is exported in training mode, so its dropouts are recorded, and each becomes a
  module that drops out only in training mode, keeping split training's train/eval behaviour.
  A model with batch-norm statistics is exported in eval mode: torch.export would write their
  updates as graph outputs, which a stage cannot carry.
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from cleave_export import ExportError, first_line
from cleave_export.sources import ModelSource
from cleave_export.specs import Probe, dim_at, symbolic_dim
from cleave_export.tracing import GRAPH_MODULE_NAMES, MODULE_PATH, graph_module

log = logging.getLogger(__name__)

_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}
"""Runtime checks torch.export inserts; a stage needs none of them."""


_SEEDED_BUT_DETERMINISTIC_HERE = {torch.ops.aten.scaled_dot_product_attention.default}
"""Operations tagged as drawing random numbers that draw none as recorded: attention without
dropout (with dropout it became a `TrainingAttention`)."""


class TrainingDropout(nn.Module):
    """`aten.dropout(x, p, train)` recorded in training mode, dropping out only when training."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)


class TrainingAttention(nn.Module):
    """Scaled dot-product attention recorded with attention dropout, dropping out only when training."""

    def __init__(self, dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool):
        super().__init__()
        self.dropout_p = dropout_p
        self.is_causal = is_causal
        self.scale = scale
        self.enable_gqa = enable_gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa
        )


def trace_with_export(src: ModelSource, probes: list[tuple], points: list[Probe], ranges: dict[str, tuple[int, int]]) -> fx.GraphModule:
    """The model's graph from torch.export. `probes` are example inputs at `points`, the base
    point and the points that change the batch (`ranges["B"]`) or the sequence length
    (`ranges["S"]`); an input dimension that changes between them is exported as symbolic, within
    its symbol's range where it follows one (`specs.symbolic_dim`)."""
    model = src.model
    dynamic = _dynamic_shapes(probes, points, ranges)
    has_running_stats = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    names = src.input_names
    # torch.export prints whole graphs when it fails; they go to the log (--verbose shows the
    # traceback), the one-line error to the user.
    chatter = io.StringIO()
    try:
        model.train(not has_running_stats)
        with torch.no_grad(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter), _torch_logs_quiet():
            if names is None:
                ep = torch.export.export(model, probes[0], kwargs=dict(src.fixed_kwargs), dynamic_shapes=tuple(dynamic), strict=False)
            else:
                kwargs = dict(zip(names, probes[0])) | src.fixed_kwargs
                shapes = dict(zip(names, dynamic)) | {k: None for k in src.fixed_kwargs}
                ep = torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as e:
        log.debug("%s", chatter.getvalue())
        raise ExportError(f"torch.export cannot trace {type(model).__name__}: {type(e).__name__}: {first_line(e)}") from e
    finally:
        model.eval()
    output = src(probes[0])
    try:
        module = ep.module()
    except Exception as e:  # torch rebuilds the model's attributes on a graph module of its own
        clashing = [name for name, _ in model.named_children() if name in GRAPH_MODULE_NAMES]
        hint = f"rename the submodule {clashing[0]!r}, a name torch.fx's graph module uses itself" if clashing else "run with --verbose"
        raise ExportError(f"torch.export cannot rebuild {type(model).__name__} as a module: {first_line(e)}; what to try: {hint}") from e
    return _stage_ready(module, output, len(probes[0]))


@contextlib.contextmanager
def _torch_logs_quiet():
    """torch's own loggers (warnings about symbolic shapes) quiet below errors for a while."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dynamic_shapes(probes: list[tuple], points: list[Probe], ranges: dict[str, tuple[int, int]]) -> list[dict]:
    """Per input, its dimensions that change between the probes: within the range of the symbol
    a dimension follows (`320*S+80` from 320 * S's least plus 80 to ...), unbounded otherwise."""
    (b_lo, b_hi), (s_lo, s_hi) = (ranges.get(s, (None, None)) for s in ("B", "S"))
    shapes = []
    for i, x in enumerate(probes[0]):
        dims = {}
        for d in range(x.dim()):
            symbolic = symbolic_dim([p[i].shape[d] for p in probes], points)
            if isinstance(symbolic, int):
                continue
            if symbolic == "?":
                dims[d] = torch.export.Dim.DYNAMIC
            else:
                dims[d] = torch.export.Dim.DYNAMIC(min=dim_at(symbolic, b_lo, s_lo), max=dim_at(symbolic, b_hi, s_hi))
        shapes.append(dims)
    return shapes


def _stage_ready(gm: fx.GraphModule, output, num_inputs: int) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # The inputs come first; fixed keyword arguments (use_cache=False, ...) follow, unused.
    for n in placeholders[num_inputs:]:
        if n.users and any(u.op != "call_module" or u.target != "_guards_fn" for u in n.users):
            raise ExportError(f"the exported graph reads the fixed argument {n.name!r} as an input")
    extra_modules = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n in placeholders[num_inputs:]:
            continue
        if n.op == "call_module" and n.target == "_guards_fn":
            continue
        if n.op == "call_function" and n.target in _DROPPED:
            continue
        if n.op == "output":
            leaves = [env[x] for x in pytree.tree_leaves(n.args[0])]
            graph.output(_structure(output, iter(leaves)))
            continue
        new = graph.node_copy(n, lambda x: env[x])
        new.meta[MODULE_PATH] = _module_path(n)
        if new.op == "call_function" and isinstance(new.target, torch._ops.OpOverload):
            replaced = _training_module(new, n)
            if replaced is not None:
                name = f"cleave_train_mode_{extra_modules}"
                extra_modules += 1
                gm.add_submodule(name, replaced[0])
                with graph.inserting_after(new):
                    mod = graph.call_module(name, replaced[1])
                mod.meta[MODULE_PATH] = new.meta[MODULE_PATH]
                graph.erase_node(new)
                new = mod
            elif torch.Tag.nondeterministic_seeded in new.target.tags and new.target not in _SEEDED_BUT_DETERMINISTIC_HERE:
                raise _random_outside_dropout(new)
            elif new.target is torch.ops.aten.sym_size.int:
                new.target = torch.ops.aten.size
            else:
                new.target = new.target.overloadpacket
        env[n] = new
    out = graph_module(gm, graph, type(gm).__name__)
    out.graph.eliminate_dead_code()
    out.graph.lint()
    out.recompile()
    return out.eval()


def _training_module(node: fx.Node, recorded: fx.Node) -> tuple[nn.Module, tuple] | None:
    """The mode-following module (and its arguments) replacing a dropout recorded in training
    mode; `node` is the copy of `recorded`, the node in the exported graph."""
    if node.target is torch.ops.aten.dropout.default:
        x, p, _train = node.args
        return TrainingDropout(float(p)), (x,)
    if node.target is torch.ops.aten.dropout_.default and len(recorded.args[0].users) == 1:
        # In place (`nn.Dropout(inplace=True)`) on a value nothing else reads: the same as out of place.
        x, p, _train = node.args
        return TrainingDropout(float(p)), (x,)
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        names = ["attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
        extra = defaults | dict(zip(names, node.args[3:])) | dict(node.kwargs)
        if not extra["dropout_p"]:
            return None
        module = TrainingAttention(float(extra["dropout_p"]), bool(extra["is_causal"]), extra["scale"], bool(extra["enable_gqa"]))
        return module, (*node.args[:3], extra["attn_mask"])
    return None


def _random_outside_dropout(node: fx.Node) -> ExportError:
    """A random draw recorded in training mode that is not a dropout: stochastic depth (drop
    path), most likely. A stage would draw it in eval mode too; it is refused, not kept."""
    where = node.meta[MODULE_PATH] or "the model's own forward"
    return ExportError(
        f"{where} draws random numbers in training mode ({node.target.overloadpacket.__name__}) other than dropout, "
        "stochastic depth (drop path) probably, which a stage would draw in eval mode too "
        "(what to try: set its rate to 0, for a transformers model --hf-config drop_path_rate=0.0)"
    )


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path.startswith("_empty_nn_module_stack") else path


def _structure(value, leaves):
    """The model's output structure (a ModelOutput becomes a dict) with graph nodes as leaves,
    in pytree order (the order of the exported graph's outputs)."""
    if isinstance(value, torch.Tensor):
        return next(leaves)
    if isinstance(value, dict):
        return {str(k): _structure(v, leaves) for k, v in value.items() if v is not None}
    if isinstance(value, (tuple, list)):
        return type(value)(_structure(v, leaves) for v in value) if not hasattr(value, "_fields") else tuple(
            _structure(v, leaves) for v in value
        )
    raise ExportError(f"the model's output contains a {type(value).__name__}; outputs must be tensors or containers of them")
