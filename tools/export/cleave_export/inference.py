"""Frozen inference versions of the stages: `stage_NNN.infer.pt` beside each `stage_NNN.pt`.

A stage file keeps its modules' train/eval behaviour for split training. Inference loads the
stage's inference file instead (the manifest's `inference_file`; a stage without one runs its
stage file in eval mode). An inference file holds only `forward`, made by these passes (the
manifest's `inference_passes`):

- `freeze`: `torch.jit.freeze` of the stage in eval mode. Weights become constants of the graph,
  submodules are inlined, dropout is removed and `cleave_buffers` is dropped.
- `fold`: freezing's numeric optimizations. Batch norms and constant adds and multiplies are
  folded into the convolution before them (when both sit in the same stage), linear weights
  are pre-transposed. Results change in the last bits.
- `channels_last`: 4-D weights are stored channels_last. A convolution with a channels_last
  weight runs the kernels that are fastest on CPU and returns a channels_last result, whatever
  the layout of its input, and the following operations keep that layout. So inside a chain
  of inference stages activations stay channels_last, and a value crossing a cut may be a
  non-contiguous tensor (same shape and values, other strides); a sender makes it contiguous
  before it goes on the wire.

Nothing in a file depends on the machine it was made on. `torch.jit.optimize_for_inference`
would convert convolutions to MKLDNN tensors and prepacked weights, which run only on a CPU,
so it is not used, and a frozen graph holding anything of the kind is refused. The same file
loads on CUDA with `map_location`.

Each stage gets the first variant of `LADDER` that validates; a stage where none does gets no
inference file, with a warning naming why. Validation walks the chain of inference stages
stage by stage, at every validation input of the export. Stage i runs on the values the
inference stages before it produce, and again on contiguous copies of them (what a server
receives over the wire). Its outputs must be within `TOLERANCE` (relative) of the stage
files' chain on the exact inputs, so the error allowed covers everything accumulated up to
every cut, the output included (the references are the stage files' output). If a stage file
cannot take what the inference stages before it produce (a `view` that needs a contiguous
input, say), the chain is built again without `channels_last`, and failing that without
inference files.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from cleave_export import first_line
from cleave_export.compare import TOLERANCE, absolute_error, relative_error
from cleave_export.specs import flatten_tensors


@dataclass(frozen=True)
class Variant:
    """One way of making an inference stage."""

    channels_last: bool
    fold: bool

    @property
    def passes(self) -> list[str]:
        """The passes it applies, as the manifest lists them."""
        return ["freeze", *(["fold"] if self.fold else []), *(["channels_last"] if self.channels_last else [])]


LADDER = (Variant(channels_last=True, fold=True), Variant(channels_last=False, fold=True), Variant(channels_last=False, fold=False))
"""Tried in this order for each stage; the first that validates is written. Without 4-D
weights `channels_last` changes nothing and is skipped. Without `fold` results are those
of the stage file's operations, only with the weights inlined."""

log = logging.getLogger(__name__)


@dataclass
class InferenceStages:
    """What `write_inference_stages` wrote."""

    passes: list[list[str] | None]
    """Per stage: the passes its inference file was made with, None when it has none."""
    relative_error: float
    """Largest relative error of the inference chain's output against the references, over the
    validation inputs."""
    absolute_error: float
    """Largest absolute error there."""

    def file(self, i: int) -> str | None:
        """Stage i's inference file, None when it has none."""
        return None if self.passes[i] is None else inference_file(i)


def inference_file(i: int) -> str:
    """The name of stage i's inference file."""
    return f"stage_{i:03d}.infer.pt"


def write_inference_stages(stage_files: list[Path], stages: list, names: list[str], validation: list[tuple[str, tuple]]) -> InferenceStages:
    """Write an inference file beside each stage file where one validates.

    `stages` are the stage files loaded, in eval mode; `names` name them in messages;
    `validation` holds (where, inputs) pairs: the inputs the stages were validated at, and a
    description of them ("batch 8")."""
    directory = stage_files[0].parent
    try:
        return _build(stage_files, stages, names, validation, allow_channels_last=True)
    except _ChainBreaks as e:
        log.warning("inference stages: %s; building them again without channels_last weights", e)
    _remove(directory, len(stage_files))
    try:
        return _build(stage_files, stages, names, validation, allow_channels_last=False)
    except _ChainBreaks as e:
        log.warning("inference stages: %s; writing none, inference runs the stage files", e)
    _remove(directory, len(stage_files))
    return InferenceStages([None] * len(stage_files), 0.0, 0.0)


class _Rejected(Exception):
    """A variant of a stage that cannot be used; the message says why."""


class _ChainBreaks(Exception):
    """A stage file that cannot continue the chain of inference stages before it."""


def _build(stage_files: list[Path], stages: list, names: list[str], validation: list[tuple[str, tuple]], allow_channels_last: bool):
    wheres = [where for where, _ in validation]
    exact = [list(inputs) for _, inputs in validation]  # the stage files' chain
    running = [list(inputs) for _, inputs in validation]  # the inference chain as the runtime runs it
    passes: list[list[str] | None] = []
    for i, (path, stage) in enumerate(zip(stage_files, stages)):
        with torch.no_grad():
            want = [list(stage(*x)) for x in exact]
        target = path.parent / inference_file(i)
        reasons, chosen, got = [], None, None
        for variant in _ladder(stage, allow_channels_last):
            try:
                got = _check(_make(path, variant, target), running, want, wheres)
            except _Rejected as e:
                reasons.append(f"{'+'.join(variant.passes)}: {e}")
                continue
            chosen = variant
            break
        if chosen is None:
            target.unlink(missing_ok=True)
            log.warning("stage %d (%s) gets no inference file, inference runs its stage file (%s)", i, names[i], "; ".join(reasons))
            try:
                got = _check(stage, running, want, wheres)
            except _Rejected as e:
                raise _ChainBreaks(f"stage {i} ({names[i]!r}) cannot take what the inference stages before it produce: {e}") from e
        passes.append(None if chosen is None else chosen.passes)
        exact, running = want, got
    return InferenceStages(
        passes,
        max(relative_error(g, w) for g, w in zip(running, exact)),
        max(absolute_error(g, w) for g, w in zip(running, exact)),
    )


def _ladder(stage, allow_channels_last: bool) -> list[Variant]:
    has_4d = any(t.dim() == 4 and t.is_floating_point() for t in chain(stage.parameters(), stage.buffers()))
    return [v for v in LADDER if not v.channels_last or (allow_channels_last and has_4d)]


def _make(stage_file: Path, variant: Variant, target: Path):
    """The variant of a stage, written to `target` and loaded back from there."""
    try:
        module = torch.jit.load(str(stage_file)).eval()
        if variant.channels_last:
            module.to(memory_format=torch.channels_last)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated; the Rust side runs it
            frozen = torch.jit.freeze(module, optimize_numerics=variant.fold)
    except Exception as e:
        raise _Rejected(f"freezing fails: {type(e).__name__}: {first_line(e)}") from e
    problem = machine_specific(frozen.graph)
    if problem is not None:
        raise _Rejected(problem)
    frozen.save(str(target))
    return torch.jit.load(str(target)).eval()


def machine_specific(graph: torch.Graph) -> str | None:
    """Why a graph runs only where it was made (MKLDNN operations or tensors, prepacked
    weights, a constant off the CPU), or None."""
    for node in _nodes(graph):
        kind = node.kind()
        if "mkldnn" in kind.lower() or "prepack" in kind.lower():
            return f"it calls {kind}, which runs on a CPU only"
        if kind == "prim::Constant" and node.hasAttribute("value") and node.kindOf("value") == "t":
            t = node.t("value")
            if t.layout != torch.strided or t.is_mkldnn or t.device.type != "cpu":
                return f"it holds a {t.layout} tensor constant on {t.device}"
    return None


def _nodes(graph_or_block):
    for node in graph_or_block.nodes():
        yield node
        for block in node.blocks():
            yield from _nodes(block)


def _check(module, running: list[list], want: list[list], wheres: list[str]) -> list[list]:
    """`module`'s outputs on the inference chain's values, checked against the stage files'
    chain; also run on contiguous copies of the values where some are not contiguous."""
    outputs = []
    for x, w, where in zip(running, want, wheres):
        got = _run(module, x, where)
        _compare(got, w, where)
        if any(not t.is_contiguous() for _, t in flatten_tensors("", x)):
            _compare(_run(module, _contiguous(x), f"{where}, inputs made contiguous"), w, f"{where}, inputs made contiguous")
        outputs.append(got)
    return outputs


def _run(module, x: list, where: str) -> list:
    try:
        with torch.no_grad():
            return list(module(*x))
    except Exception as e:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        raise _Rejected(f"at {where} it fails: {type(e).__name__}: {lines[-1] if lines else ''}") from e


def _compare(got: list, want: list, where: str) -> None:
    err = relative_error(got, want)
    if err > TOLERANCE:
        raise _Rejected(f"at {where} its outputs are {err:.1e} (relative) from the stage files', over {TOLERANCE:.0e}")


def _contiguous(value):
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(_contiguous(v) for v in value)
    if isinstance(value, dict):
        return {k: _contiguous(v) for k, v in value.items()}
    return value


def _remove(directory: Path, n: int) -> None:
    for i in range(n):
        (directory / inference_file(i)).unlink(missing_ok=True)
