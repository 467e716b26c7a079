"""Compile, validate and write a bundle.

Layout of a bundle directory:

    manifest.json              format version, model, inputs/output, cuts, stages, file hashes
    stage_000.pt ...           one TorchScript module per stage: `forward`, and `cleave_buffers`
                               (its buffers as (name, tensor) pairs, for callers without a buffers API)
    stage_000.infer.pt ...     its frozen inference version, `forward` only (inference.py), for
                               every stage where one validates (the manifest's `inference_file`)
    reference_b1.safetensors   reference inputs (`input.NAME`) and outputs (`output.NAME`);
                               with a dynamic sequence one per batch and sequence length,
                               `reference_b1_s8.safetensors`

The bundle is written to a temporary directory next to the target and renamed into place
only once every stage has been validated, so a failed export never leaves half a bundle.
Every file of a bundle has one mode and its directory another, those a new file and a new
directory get under the umask (0644 and 0755 under the usual 022): see `_set_modes`.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.fx as fx
from safetensors.torch import save_file
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

import cleave_export
from cleave_export import ExportError, first_line, huggingface
from cleave_export.compare import TOLERANCE, relative_error
from cleave_export.exported import trace_with_export
from cleave_export.generation import check_generation, write_generation
from cleave_export.inference import InferenceStages, write_inference_stages
from cleave_export.partition import GRANULARITY_DEPTH, Partition, parse_granularity, partition, stage_module
from cleave_export.sources import ModelSource, load_source
from cleave_export.specs import Probe, bytes_per_sample, check_value, flatten_tensors, tensor_leaves
from cleave_export.tracing import MODULE_PATH, RENAMED, TraceError, record_values, trace

log = logging.getLogger(__name__)


@dataclass
class ExportOptions:
    """Everything `python -m cleave_export` was asked to do."""

    source: str
    out: Path
    input_shape: tuple[int, ...] | None = None
    batch_min: int = 1
    batch_max: int = 64
    granularity: str = "block"
    seed: int = 0
    reference_batches: tuple[int, ...] = (1, 3)
    force: bool = False
    seq: tuple[int, int] | None = None
    """`--dynamic-seq MIN MAX`: the sequence lengths the bundle takes (a text model's default
    when None)."""
    hf_config: dict = field(default_factory=dict)
    """`--hf-config`: config fields of an `hf:CLASS` model."""
    generation: bool = False
    """`--generation`: also the stages for split generation, which take a key/value cache
    (`generation.py`)."""


@dataclass
class ExportReport:
    """What was exported and how long each phase took."""

    manifest: dict
    timings: dict[str, float] = field(default_factory=dict)
    validated_batches: list[int] = field(default_factory=list)
    validated_seqs: list[int] = field(default_factory=list)
    inference: InferenceStages | None = None
    """The inference files written, and how close their chain comes to the references."""


def export_bundle(opts: ExportOptions) -> ExportReport:
    """Export `opts.source` into the bundle directory `opts.out`."""
    started = time.perf_counter()
    timings: dict[str, float] = {}
    depth = parse_granularity(opts.granularity)
    if not 1 <= opts.batch_min <= opts.batch_max:
        raise ExportError(f"--dynamic-batch {opts.batch_min} {opts.batch_max}: need 1 <= MIN <= MAX")
    for b in opts.reference_batches:
        if not opts.batch_min <= b <= opts.batch_max:
            raise ExportError(f"reference batch size {b} is outside --dynamic-batch {opts.batch_min} {opts.batch_max}")
    if opts.out.exists() and not opts.force:
        raise ExportError(f"{opts.out} already exists; pass --force to replace it")

    src = load_source(opts.source, opts.input_shape, opts.seed, opts.hf_config)
    if opts.generation:
        check_generation(src.model)
    seq_range = opts.seq or src.sequence
    if seq_range is not None and not 1 <= seq_range[0] <= seq_range[1]:
        raise ExportError(f"--dynamic-seq {seq_range[0]} {seq_range[1]}: need 1 <= MIN <= MAX")
    traced = trace_stages(src, opts.seed, depth, opts.granularity in GRANULARITY_DEPTH, (opts.batch_min, opts.batch_max), seq_range)
    part = traced.part
    timings["trace"] = time.perf_counter() - started

    # The temporary directory sits beside the target so that the final rename stays on one filesystem.
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{opts.out.name}.", dir=opts.out.parent))
    try:
        t = time.perf_counter()
        traced, stage_gms, compilers = _compile_stages(traced, tmp)
        part = traced.part
        loaded = [torch.jit.load(str(tmp / _stage_file(i))).eval() for i in range(len(stage_gms))]
        timings["compile"] = time.perf_counter() - t

        t = time.perf_counter()
        batches = sorted({opts.batch_min, min(3, opts.batch_max), min(8, opts.batch_max), *opts.reference_batches})
        batches = [b for b in batches if opts.batch_min <= b <= opts.batch_max]
        seqs = [None] if seq_range is None else sorted({min(max(seq_range[0], 8), seq_range[1]), seq_range[1]})
        references, validation = {}, []
        for b in batches:
            for seq in seqs:
                inputs = src.example_inputs(opts.seed, b, seq)
                expected = _validate(src, traced.gm, loaded, part, compilers, inputs, Probe(b, seq))
                validation.append((_where(Probe(b, seq)), inputs))
                if b in opts.reference_batches:
                    references[(b, seq)] = (inputs, expected)
        timings["validate"] = time.perf_counter() - t

        t = time.perf_counter()
        stage_files = [tmp / _stage_file(i) for i in range(len(stage_gms))]
        inference = write_inference_stages(stage_files, loaded, [s.name for s in part.stages], validation)
        timings["inference"] = time.perf_counter() - t

        t = time.perf_counter()
        flops = _stage_flops(stage_gms, traced.probe_inputs[0], traced.probes[0].batch)
        # At the longest sequence, as the cuts' bytes are: a trainer multiplies by the batch only.
        batch = traced.probes[0].batch
        saved = _stage_saved_bytes(stage_gms, src.example_inputs(opts.seed, batch, seq_range and seq_range[1]), batch)
        ref_entries = []
        for (b, seq), (inputs, expected) in sorted(references.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            name = f"reference_b{b}.safetensors" if seq is None else f"reference_b{b}_s{seq}.safetensors"
            tensors = {}
            for value, x in zip(part.cuts[0].values, inputs):
                tensors.update({f"input.{k}": v for k, v in flatten_tensors(value.name, x)})
            for value, x in zip(part.cuts[-1].values, expected):
                tensors.update({f"output.{k}": v for k, v in flatten_tensors(value.name, x)})
            save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp / name))
            ref_entries.append({"batch_size": b, "file": name} | ({} if seq is None else {"seq_len": seq}))
        generation_started = time.perf_counter()
        generation = write_generation(src.model, tmp, opts.seed) if opts.generation else None
        if generation:
            timings["generation"] = time.perf_counter() - generation_started
        manifest = _manifest(opts, src, traced, stage_gms, compilers, inference, (flops, saved), seq_range, ref_entries, tmp)
        manifest |= {"generation": generation} if generation else {}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        _set_modes(tmp)
        if opts.out.exists():
            shutil.rmtree(opts.out)
        tmp.rename(opts.out)
        timings["write"] = time.perf_counter() - t
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    timings["total"] = time.perf_counter() - started
    return ExportReport(manifest, timings, batches, [q for q in seqs if q is not None], inference)


@dataclass
class Traced:
    """A model traced and cut into stages, before they are compiled."""

    gm: fx.GraphModule
    part: Partition
    probes: list[Probe]
    probe_inputs: list[tuple]
    recorded: list[dict]
    """Every node's value at each probe."""
    kept_whole: list[str]
    tracer: str
    cutting: dict
    """How it was cut (`partition`'s depth, descend and model), to cut it again."""

    def without_cut_after(self, node: str, reason: str) -> Traced:
        """The same trace cut again without the cut after `node`, for `reason` (recorded)."""
        refused = self.part.refused | {node: reason}
        return replace(self, part=partition(self.gm, recorded=self.recorded, probes=self.probes, refused=refused, **self.cutting))

    def eager_stages(self) -> list[fx.GraphModule]:
        """The stages as GraphModules, which run the model's own modules and functions eagerly."""
        return [stage_module(self.gm, self.part, i) for i in range(len(self.part.stages))]


def trace_stages(
    src: ModelSource, seed: int, depth: int | None, descend: bool, batch_range: tuple[int, int], seq_range: tuple[int, int] | None
) -> Traced:
    """Traces `src` and cuts it into stages `depth` deep (None: every operation), as an export does."""
    # Probes tell the symbolic dimensions: another batch size shows B, another length S.
    probes, ranges = _probes(*batch_range, seq_range)
    probe_inputs = [src.example_inputs(seed, p.batch, p.seq) for p in probes]
    # Fail early, with the model's own error, on inputs or batch sizes it does not take.
    for p, inputs in zip(probes, probe_inputs):
        _call_model(src, inputs, p)
    gm, kept_whole, tracer = _trace(src, probe_inputs, probes, ranges)
    recorded = [record_values(gm, inputs) for inputs in probe_inputs]
    cutting = {"depth": depth, "model": src.model, "descend": descend}
    part = partition(gm, recorded=recorded, probes=probes, **cutting)
    return Traced(gm, part, probes, probe_inputs, recorded, kept_whole, tracer, cutting)


def _set_modes(root: Path) -> None:
    """Gives every file under `root` the mode `open` gives a new file (0666 less the umask)
    and every directory, `root` included, the mode `mkdir` gives one (0777 less the umask).

    Left alone, the bundle directory keeps `mkdtemp`'s 0700 and the references
    safetensors' 0600, while the stages and the manifest follow the umask. Nothing in a
    bundle is more private than its stages, which hold the weights, and a server running as
    another user must read all of it; a user who wants bundles private sets the umask."""
    # Python cannot read the umask without setting it; the exporter creates no file meanwhile.
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _probes(batch_min: int, batch_max: int, seq_range: tuple[int, int] | None) -> tuple[list[Probe], dict]:
    """The probes (a base point, then one with another batch size, then two with other
    sequence lengths, each where the range allows) and the ranges of the symbols they show."""
    b0 = min(max(batch_min, 2), batch_max)
    if b0 == batch_max > batch_min:
        b0 -= 1  # --dynamic-batch 1 2: probe at 1 and 2, or every dimension would look fixed
    s0 = None if seq_range is None else min(max(seq_range[0], 5), seq_range[1])
    probes, ranges = [Probe(b0, s0)], {}
    if b0 < batch_max:
        probes.append(Probe(b0 + 1, s0))
        ranges["B"] = (batch_min, batch_max)
    if seq_range is not None and seq_range[0] < seq_range[1]:
        # Lengths other than the batch sizes, so that a size equal to both cannot be mistaken.
        lengths = [s for s in (s0 + 3, s0 + 2, s0 + 1, s0 - 1, s0 - 2) if seq_range[0] <= s <= seq_range[1]]
        others = [s for s in lengths if s not in (b0, b0 + 1)] or lengths
        probes.extend(Probe(b0, s) for s in others[:2])
        ranges["S"] = seq_range
    return probes, ranges


DATA_DEPENDENT_HINT = (
    "what to try: move the code of forward that depends on the data into a submodule, which the exporter keeps whole "
    "and compiles with torch.jit.script: that code must be scriptable (tensor operations, .item(), .tolist() with a type "
    "annotation; not .numpy()), or its stage is traced with torch.jit.trace instead, which makes each value read out of "
    "a tensor (.numpy(), .item(), .tolist()) a constant, the one of the example inputs, and validation refuses the "
    "stage where that value changes with the inputs"
)
"""The end of the error for a forward that neither torch.fx nor torch.export can trace. A
submodule torch.fx cannot trace is kept whole (one graph node); its stage is then scripted, and
traced only where scripting fails (`_compile`), and a trace keeps Python values as constants."""


def _trace(src: ModelSource, probe_inputs: list[tuple], probes: list[Probe], ranges: dict) -> tuple:
    """(graph, modules kept whole, tracer name): torch.fx first (it keeps modules whole where it
    cannot see inside them), torch.export where fx cannot trace the model's own forward."""
    if src.tracer == "export":
        return trace_with_export(src, probe_inputs, probes, ranges), [], "torch.export"
    try:
        gm, kept_whole = trace(src.model, len(probe_inputs[0]))
        wrapped = [
            n.meta[MODULE_PATH] or n.target for n in gm.graph.nodes
            if n.op == "call_module" and huggingface.is_transformers_model(gm.get_submodule(n.target))
        ]
        if not wrapped:
            return gm, kept_whole, "torch.fx"
        # A transformers model inside the user's: fx keeps it whole (one stage); torch.export
        # follows it, layer by layer, where it can.
        log.info("%s holds a transformers model (%s); tracing with torch.export", type(src.model).__name__, ", ".join(wrapped))
        try:
            return trace_with_export(src, probe_inputs, probes, ranges), [], "torch.export"
        except ExportError as e:
            log.warning("%s; keeping %s whole as torch.fx traced it", e, ", ".join(wrapped))
            return gm, kept_whole, "torch.fx"
    except TraceError as fx_error:
        if not fx_error.at_root:
            raise
        log.info("torch.fx cannot trace %s.forward; trying torch.export", type(src.model).__name__)
        try:
            return trace_with_export(src, probe_inputs, probes, ranges), [], "torch.export"
        except ExportError as e:
            raise ExportError(f"{fx_error}; and {e} ({DATA_DEPENDENT_HINT})") from e


def _stage_file(i: int) -> str:
    return f"stage_{i:03d}.pt"


BUFFERS_METHOD = "cleave_buffers"
"""TorchScript method every stage carries: `cleave_buffers(self) -> List[Tuple[str, Tensor]]`."""


def _buffers_method_source(sgm: fx.GraphModule) -> str:
    """TorchScript source of `cleave_buffers`: the stage's buffers (batch-norm running statistics,
    ...) as (name, tensor) pairs in `named_buffers()` order, names as in the model's state_dict.

    libtorch's C++ API (and tch's `CModule`) lists a module's parameters but not its buffers;
    this method gives a Rust caller the buffer tensors themselves (they alias the module's
    attributes, so reading them sees the current statistics and `copy_` into them writes them).
    """
    lines = [
        f"def {BUFFERS_METHOD}(self) -> List[Tuple[str, Tensor]]:",
        "    out: List[Tuple[str, Tensor]] = []",
    ]
    for name, _ in sgm.named_buffers():
        expr = "self"
        for part in name.split("."):
            expr = f"getattr({expr}, {json.dumps(part)})"
        lines.append(f"    out.append(({json.dumps(name)}, {expr}))")
    lines.append("    return out")
    return "\n".join(lines) + "\n"


def _compile_stages(traced: Traced, tmp: Path) -> tuple[Traced, list[fx.GraphModule], list[str]]:
    """Every stage compiled into `tmp` (`_compile`); a stage that cannot take the containers
    crossing the cut before it is joined to the stage before, the cut's reason recorded."""
    while True:
        stage_gms = traced.eager_stages()
        try:
            compilers = [_compile(sgm, traced.part, i, tmp / _stage_file(i), traced.recorded[0]) for i, sgm in enumerate(stage_gms)]
            return traced, stage_gms, compilers
        except _CannotTakeContainers as e:
            log.info("moving the cut after %s: %s", e.after, e.reason)
            traced = traced.without_cut_after(e.after, e.reason)


class _CannotTakeContainers(Exception):
    """Stage after node `after` can neither be scripted nor traced with the containers it takes."""

    def __init__(self, after: str, reason: str):
        super().__init__(reason)
        self.after = after
        self.reason = reason


def _compile(sgm: fx.GraphModule, part: Partition, i: int, path: Path, probe: dict) -> str:
    """Save stage `i` as TorchScript: scripted (keeps train/eval behaviour) or, failing that, traced.
    Either way the saved module also gets the `cleave_buffers` method."""
    buffers_src = _buffers_method_source(sgm)
    try:
        scripted = torch.jit.script(sgm)
    except Exception as script_error:
        if not all(s["type"] == "tensor" for s in part.cuts[i].specs):
            kinds = sorted({s["type"] for s in part.cuts[i].specs if s["type"] != "tensor"})
            if i > 0:
                raise _CannotTakeContainers(
                    part.stages[i - 1].nodes[-1].name,
                    f"{_stage_part(part, i)} cannot be compiled with torch.jit.script ({first_line(script_error).rstrip(':')}), "
                    f"nor traced, as it takes a {' and a '.join(kinds)}: the cut is moved before the stage",
                ) from script_error
            raise ExportError(
                f"{_stage_part(part, i)} cannot be compiled with torch.jit.script ({first_line(script_error).rstrip(':')}), "
                f"nor traced, as it takes a {' and a '.join(kinds)} from the stage before; what to try: make that code "
                "scriptable, or call it with the container's items (`self.m(xs[0], xs[1])`) so that only tensors cross the cut"
            ) from script_error
        log.warning("stage %d (%s) is traced, not scripted: %s", i, part.stages[i].name, script_error)
        example = tuple(probe[n.name] for n in part.cuts[i].values)
        try:
            traced = torch.jit.trace(sgm, example, check_trace=False, strict=False)
        except Exception as trace_error:
            raise ExportError(
                f"{_stage_part(part, i)} cannot be compiled with torch.jit.script ({first_line(script_error).rstrip(':')}) "
                f"nor traced with torch.jit.trace ({type(trace_error).__name__}: {first_line(trace_error)}); "
                "what to try: make that code scriptable (type annotations, no numpy, no Python objects other than "
                "tensors, numbers, strings, lists, tuples and dicts)"
            ) from trace_error
        traced.define(buffers_src)
        traced.save(str(path))
        return "trace"
    scripted.define(buffers_src)
    scripted.save(str(path))
    return "script"


def _stage_part(part: Partition, i: int) -> str:
    """Stage `i` named by the model parts it runs: `stage 2 (module 'meta.0')`."""
    modules = part.stages[i].modules
    if len(modules) == 1:
        return f"stage {i} (module {modules[0]!r})"
    if modules:
        return f"stage {i} (modules {', '.join(map(repr, modules))})"
    return f"stage {i} ({part.stages[i].name!r})"


def _where(p: Probe) -> str:
    return f"batch {p.batch}" if p.seq is None else f"batch {p.batch}, sequence length {p.seq}"


def _call_model(src: ModelSource, inputs: tuple, at: Probe):
    if src.input_names is None:
        _check_arity(src.model, len(inputs))
    try:
        with torch.no_grad():
            return src(inputs)
    except Exception as e:
        hint = "--dynamic-batch N N" if at.seq is None else "--dynamic-batch N N or --dynamic-seq MIN MAX within the lengths it takes"
        raise ExportError(
            f"the model fails on its example inputs at {_where(at)}: {type(e).__name__}: {first_line(e)} "
            f"(a model that takes one batch size only is exported with {hint})"
        ) from e


def _check_arity(model: torch.nn.Module, fed: int) -> None:
    """A forward that needs more positional inputs than the exporter feeds (optical flow's two
    images, say) is named as such, not left to fail as if the batch size were wrong."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(required) > fed:
        raise ExportError(
            f"{type(model).__name__}.forward takes {len(required)} inputs ({', '.join(required)}) but the exporter feeds {fed} "
            "(what to try: build the model in a `pkg.mod:callable` and give it an `example_inputs(batch_size)` method "
            "that returns all of them)"
        )


def _run_chain(stages: list, part: Partition, compilers: list[str], inputs: tuple, at: Probe) -> list[list]:
    """Every cut's values when the stages run one after another on `inputs`."""
    cuts = [list(inputs)]
    with torch.no_grad():
        for i, stage in enumerate(stages):
            try:
                cuts.append(list(stage(*cuts[-1])))
            except Exception as e:
                # A traced stage up to here may hold the example's sizes as constants.
                traced = [f"{k} ({part.stages[k].name!r})" for k in range(i + 1) if compilers[k] == "trace"]
                traced = (
                    f" (stage {', '.join(traced)} is traced, not scripted, so its shapes may be those of the example "
                    "it was traced at; what to try: make it scriptable, --verbose shows why it is not)"
                    if traced
                    else ""
                )
                raise ExportError(
                    f"at {_where(at)}, stage {i} ({part.stages[i].name!r}) fails: {type(e).__name__}: {_last_line(e)}{traced}"
                ) from e
    return cuts


def _last_line(e: Exception) -> str:
    """The cause of a TorchScript error is its last line; of other errors, their first."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and "TorchScript" in lines[0]:
        return lines[-1].removeprefix(f"{type(e).__name__}: ")
    return first_line(e)


def _validate(src: ModelSource, gm: fx.GraphModule, loaded: list, part: Partition, compilers: list[str], inputs: tuple, at: Probe) -> list:
    """Check the traced graph and the compiled chain against the model at one batch size (and
    sequence length)."""
    want = _call_model(src, inputs, at)
    cut_values = _run_chain(loaded, part, compilers, inputs, at)
    by_name = {n.name: v for n, v in zip(part.cuts[-1].values, cut_values[-1])}
    err = relative_error(assemble_output(part.output_tree, by_name), want)
    if err > TOLERANCE:
        # Which is wrong, the trace or the stages made of it? Only worth running then.
        with torch.no_grad():
            traced_err = relative_error(gm(*inputs), want)
        if traced_err > TOLERANCE:
            raise ExportError(
                f"the trace of the model differs from the model at {_where(at)} (relative error {traced_err:.2e}); "
                "its forward probably turns a batch-dependent value into a constant"
            )
    for k, (cut, values) in enumerate(zip(part.cuts, cut_values)):
        for node, spec, v in zip(cut.values, cut.specs, values):
            try:
                check_value(spec, v, at.batch, f"cut {k} value {node.name!r}", at.seq)
            except ValueError as e:
                if k == 0:
                    raise ExportError(
                        f"at {_where(at)}, the model's example inputs give {e}; what to try: make example_inputs follow the "
                        "batch size (and sequence length) it is given in every dimension that changes with them"
                    ) from e
                raise ExportError(f"at {_where(at)}, {_stage_part(part, k - 1)} gives {e}: {_shape_hint(compilers[k - 1], at)}") from e
    if err > TOLERANCE:
        reference = record_values(gm, inputs)
        for k, (cut, values) in enumerate(zip(part.cuts, cut_values)):
            for node, v in zip(cut.values, values):
                if relative_error(v, reference[node.name]) > TOLERANCE:
                    traced = (
                        " (it is traced, not scripted (the warning above says why), so each value it reads out of a tensor "
                        "(.numpy(), .item(), .tolist()) is a constant, the one of the example it was traced at; "
                        "what to try: make it scriptable)"
                        if compilers[k - 1] == "trace"
                        else ""
                    )
                    raise ExportError(
                        f"at {_where(at)}, stage {k - 1} ({part.stages[k - 1].name!r}) computes {node.name!r} "
                        f"differently from the model; output relative error {err:.2e}{traced}"
                    )
        raise ExportError(f"at {_where(at)} the stage chain's output differs from the model's (relative error {err:.2e})")
    return cut_values[-1]


def _shape_hint(compiler: str, at: Probe) -> str:
    """Why a stage's output has another shape at another batch size or length, and what to try."""
    if compiler == "trace":
        return (
            "it is traced, not scripted (the warning above says why), so each value it reads out of a tensor "
            "(.numpy(), .item(), .tolist()) is a constant, the one of the example it was traced at; what to try: make it scriptable"
        )
    one_length = "" if at.seq is None else " or --dynamic-seq N N (one length)"
    return (
        "its code turns a size of the example inputs into a constant; "
        f"what to try: compute the size from the tensors, or export it with --dynamic-batch N N (one batch size){one_length}"
    )


def assemble_output(tree: dict, by_name: dict):
    """The model's output rebuilt from the last cut's values by name, following the manifest's
    `output` tree."""
    kind = tree["type"]
    if kind == "ref":
        return by_name[tree["name"]]
    if kind in ("tuple", "list"):
        items = [assemble_output(t, by_name) for t in tree["items"]]
        return tuple(items) if kind == "tuple" else items
    return {item["key"]: assemble_output(item["value"], by_name) for item in tree["items"]}


def _stage_flops(stage_gms: list[fx.GraphModule], inputs: tuple, batch: int) -> list[int]:
    """FLOPs per sample of each stage (matrix and convolution work, as PyTorch counts it)."""
    flops = []
    values = list(inputs)
    # Grad stays enabled: the counter's module tracker hooks autograd and fails under no_grad
    # on stages that pass a parameter-free tensor through.
    for sgm in stage_gms:
        with FlopCounterMode(display=False) as counter:
            values = list(sgm(*values))
        flops.append(int(counter.get_total_flops()) // batch)
    return flops


def _stage_saved_bytes(stage_gms: list[fx.GraphModule], inputs: tuple, batch: int) -> list[int | None]:
    """Bytes per sample that each stage's training forward leaves for its backward: what
    autograd saves, each storage once, less the stage's parameters and buffers (held anyway).
    Measured on a copy of the stage in training mode (dropout's masks, batch norm's batch
    statistics), the random state left as it was, at `batch` with the stage's floating-point
    inputs needing gradients, as on a server that sends its boundary's gradient back; rounded
    up, so what does not grow with the batch is spread over it. A trainer holds it from a
    forward to its backward (the server reserves it in its memory budget). A stage this cannot
    run on gets None (the server then counts its input), and the stages after it too."""
    saved: list[int | None] = []
    values = list(inputs)
    for i, sgm in enumerate(stage_gms):
        if values is None:
            saved.append(None)
            continue
        storages: dict[int, int] = {}
        try:
            stage = copy.deepcopy(sgm).train()
            resident = {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}

            def pack(t: torch.Tensor, resident=resident, storages=storages) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in resident:
                    storages[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stage(*tree_map(_needing_grad, values))
            values = [tree_map(_detached, v) for v in out]
            saved.append(-(-sum(storages.values()) // batch))
            del stage, out
        except Exception as e:  # noqa: BLE001 - any failure leaves the field out, never the export
            log.warning("stage %d: what its training forward keeps was not measured (%s): the server counts its input", i, first_line(e))
            values = None
            saved.append(None)
    return saved


def _detached(value):
    """A stage's output as the next stage's input: no graph behind it."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def _needing_grad(value):
    """A floating-point tensor as a stage's input in training: needing its gradient (a copy,
    so that the stage's in-place operations do not write to a leaf)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_().clone()
    return value


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shared_parameters(model: torch.nn.Module, stage_gms: list[fx.GraphModule]) -> list[dict]:
    """Parameters that more than one stage holds (tied weights, e.g. an embedding reused as the
    output head): `{"names": [...], "stages": [...], "aliases": [...]}`, the name each stage
    holds it under, in stage order, and every name the model knows it by (`aliases`: the
    modules that share it, which a stage's own names may not show: torch.export keeps one).
    Every stage file saves its own copy, so a trainer must keep the copies equal (sum the
    gradients, apply one update).

    Stage graph modules share the model's `Parameter` objects (torch.fx and torch.export copy
    references to the attributes a graph uses, not the tensors), so identity finds the ties.
    A tie inside one stage is not listed: `named_parameters()` (hence `parameter_names`) lists
    such a tensor once, under its first name, and the saved stage keeps the two names aliased.
    """
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    holders: dict[int, list[tuple[int, str]]] = {}
    order: list[int] = []
    for i, sgm in enumerate(stage_gms):
        for name, p in sgm.named_parameters():
            if id(p) not in holders:
                holders[id(p)] = []
                order.append(id(p))
            holders[id(p)].append((i, name))
    shared = []
    for key in order:
        if len(holders[key]) > 1:
            names = [n for _, n in holders[key]]
            shared.append({"names": names, "stages": [i for i, _ in holders[key]], "aliases": aliases.get(key, names)})
    return shared


def _manifest(
    opts, src, traced: Traced, stage_gms, compilers, inference: InferenceStages, costs, seq_range, references, tmp: Path,
) -> dict:
    model, part = src.model, traced.part
    flops, saved = costs
    stage_params = [sum(p.numel() for p in sgm.parameters()) for sgm in stage_gms]
    cuts = []
    for k, cut in enumerate(part.cuts):
        # With a dynamic sequence, bytes at the longest sequence (a receiver's bound).
        per_sample, fixed, known = bytes_per_sample(cut.specs, seq_range and seq_range[1])
        entry = {
            "index": k,
            "name": cut.name,
            "values": [{"name": n.name, "spec": s} for n, s in zip(cut.values, cut.specs)],
            "tensors": [
                {"name": name, "dtype": leaf["dtype"], "shape": leaf["shape"]}
                for n, s in zip(cut.values, cut.specs)
                for name, leaf in tensor_leaves(n.name, s)
            ],
            "bytes_per_sample": per_sample,
            "bytes_fixed": fixed,
            "usable": known,
        }
        if not known:
            entry["reason"] = "a tensor here has a data-dependent shape, so a receiver cannot bound its size"
        cuts.append(entry)
    stages = [
        {
            "index": i,
            "name": s.name,
            "file": _stage_file(i),
            "modules": s.modules,
            "operations": len(s.nodes),
            "parameters": stage_params[i],
            "flops_per_sample": flops[i],
            "compiler": compilers[i],
            "parameter_names": [name for name, _ in stage_gms[i].named_parameters()],
            "buffer_names": [name for name, _ in stage_gms[i].named_buffers()],
        }
        | ({} if saved[i] is None else {"training_saved_bytes_per_sample": saved[i]})
        | ({} if inference.file(i) is None else {"inference_file": inference.file(i), "inference_passes": inference.passes[i]})
        for i, s in enumerate(part.stages)
    ]
    files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != "manifest.json")
    return {
        "format": "cleave-bundle",
        "format_version": cleave_export.FORMAT_VERSION,
        "model": {
            "source": opts.source,
            "class": type(model).__name__,
            "seed": opts.seed,
            "parameters": sum(p.numel() for p in model.parameters()),
            "preprocess": src.preprocess,
        },
        "exporter": {
            "version": cleave_export.__version__,
            "torch": torch.__version__,
            "tracer": traced.tracer,
            "granularity": opts.granularity,
            "kept_whole": traced.kept_whole,
            "renamed": traced.gm.meta.get(RENAMED, {}),
            "merged_cuts": part.merged,
            "shared_parameters": _shared_parameters(model, stage_gms),
        },
        "batch": {"min": opts.batch_min, "max": opts.batch_max},
        **({} if seq_range is None else {"sequence": {"min": seq_range[0], "max": seq_range[1]}}),
        "inputs": [
            {"name": n.name, "spec": s} | ({"range": src.input_ranges[n.name]} if n.name in src.input_ranges else {})
            for n, s in zip(part.cuts[0].values, part.cuts[0].specs)
        ],
        "output": part.output_tree,
        "cuts": cuts,
        "stages": stages,
        "references": references,
        "files": {name: _sha256(tmp / name) for name in files},
    }
