"""`python -m cleave_export SOURCE --out DIR`: export a model as a cleave bundle."""

from __future__ import annotations

import argparse
import logging
import site
import sys
import sysconfig
import traceback
import warnings
from pathlib import Path

from cleave_export import ExportError, first_line
from cleave_export.bundle import ExportOptions, ExportReport, export_bundle
from cleave_export.huggingface import parse_config


def _shape(text: str) -> tuple[int, ...]:
    """`--input-shape`: the input without the batch, C,H,W (3,224,224). `3x224x224` is taken too,
    but not fewer than three dimensions written with `x`: `8x1` or `224x224` reads as an image
    size (no channels) or a batch times something, and would fail only later, on the model."""
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 3,224,224") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: dimensions must be positive")
    if "x" in text and len(dims) < 3:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the input shape is C,H,W without the batch, e.g. 3,224,224 "
            f"(if the input really has {len(dims)} dimension{'s' if len(dims) > 1 else ''}, write {','.join(map(str, dims))})"
        )
    return dims


def batch_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of batch sizes, as an argparse type."""
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of batch sizes like 1,3") from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments that say which model to build and feed (SOURCE, --input-shape, --hf-config,
    --seed), shared with `python -m cleave_export.eager_timing`."""
    p.add_argument("source", help="torchvision:NAME (random init), hf:CLASS (a transformers model class built from "
                                  "its config, random init) or package.module:callable returning an nn.Module")
    p.add_argument("--input-shape", type=_shape, metavar="C,H,W", help="input shape without the batch, e.g. 3,224,224")
    p.add_argument("--hf-config", default="", metavar="KEY=VALUE,...",
                   help="config fields of an hf:CLASS model, e.g. num_hidden_layers=2,hidden_size=64")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and reference inputs")


def parse_args(argv: list[str]) -> tuple[bool, bool, ExportOptions]:
    """(whether to print tracebacks, whether to print only errors and warnings, the export asked for)."""
    p = argparse.ArgumentParser(
        prog="python -m cleave_export",
        description="Export a PyTorch model as a cleave bundle: TorchScript stages split at every module boundary.",
    )
    add_model_arguments(p)
    p.add_argument("--out", required=True, type=Path, help="bundle directory to write")
    p.add_argument("--dynamic-batch", nargs=2, type=int, metavar=("MIN", "MAX"), default=(1, 64),
                   help="batch sizes the bundle accepts (default 1 64)")
    p.add_argument("--dynamic-seq", nargs=2, type=int, metavar=("MIN", "MAX"),
                   help="sequence lengths the bundle accepts, for models taking token ids "
                        "(default for transformers text models: 1 to the model's positions, at most 128) "
                        "or a waveform (wav2vec2, HuBERT ...: S counts frames, the waveform takes k*S+c samples, "
                        "as the manifest's input spec says)")
    p.add_argument("--generation", action="store_true",
                   help="also write stages for split generation, each layer with its key/value cache as an input "
                        "(causal language models: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    p.add_argument("--granularity", default="block",
                   help="where stages may be cut: top (top-level modules), block (one level deeper, default), "
                        "layer (two deeper), op (every operation) or a module depth")
    p.add_argument("--reference-batches", type=batch_list, default=(1, 3),
                   help="batch sizes of the reference input/output pairs (default 1,3)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors and warnings, not what was exported")
    p.add_argument("-v", "--verbose", action="store_true", help="on failure, print the traceback too")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    return a.verbose, a.quiet, ExportOptions(
        source=a.source,
        out=a.out,
        input_shape=a.input_shape,
        batch_min=a.dynamic_batch[0],
        batch_max=a.dynamic_batch[1],
        granularity=a.granularity,
        seed=a.seed,
        reference_batches=a.reference_batches,
        force=a.force,
        seq=tuple(a.dynamic_seq) if a.dynamic_seq else None,
        hf_config=hf_config(p, a.hf_config),
        generation=a.generation,
    )


def hf_config(parser: argparse.ArgumentParser, text: str) -> dict:
    """`--hf-config`'s fields, or the parser's usage error."""
    try:
        return parse_config(text)
    except ExportError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    # TorchScript warns about annotations inside torchvision modules; they do not affect the export.
    warnings.filterwarnings("ignore", message="The TorchScript type system")
    verbose, quiet, opts = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = export_bundle(opts)
    except Exception as e:  # one line for people (the traceback with --verbose), exit code 2
        if verbose:
            traceback.print_exc()
        if isinstance(e, ExportError):
            # One line: a library may have appended its own notes to the message.
            print(f"cleave_export: error: {first_line(e)}", file=sys.stderr)
        else:  # a failure the exporter did not foresee: name it, and the code of ours or the user's it came from
            where = _innermost_own_frame(e)
            print(
                f"cleave_export: error: exporting {opts.source} failed in {Path(where.filename).name}:"
                f"{where.lineno} ({where.name}): {type(e).__name__}: {first_line(e)}; what to try: "
                f"{'' if verbose else 'run with --verbose for the traceback; '}"
                "if that line is the exporter's, report the traceback as a bug",
                file=sys.stderr,
            )
        return 2
    if not quiet:
        print_report(report, opts.out)
    return 0


def _innermost_own_frame(e: BaseException) -> traceback.FrameSummary:
    """The innermost frame of the traceback in the user's code or the exporter's, not in a
    library's (torch's tracers, transformers) nor Python's: the part the user can act on."""
    frames = traceback.extract_tb(e.__traceback__)
    # Python's own modules and installed packages; not the whole prefix (sysconfig's `data`,
    # `scripts`), under which a user's code may live.
    library_dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    libraries = [str(Path(p).resolve()) for p in {*library_dirs, *site.getsitepackages()} if p]
    exporter = str(Path(__file__).resolve().parent)
    for frame in reversed(frames):
        path = str(Path(frame.filename).resolve())
        if path.startswith(exporter) or not any(path.startswith(lib) for lib in libraries):
            return frame
    return frames[-1]


def print_report(report: ExportReport, out: Path) -> None:
    """What was exported to `out`, and how long it took (the lines -q leaves out)."""
    m, t = report.manifest, report.timings
    usable = sum(c["usable"] for c in m["cuts"])
    print(
        f"exported {m['model']['source']} to {out}: {len(m['stages'])} stages, "
        f"{len(m['cuts'])} cuts ({usable} usable), {m['model']['parameters']:,} parameters"
    )
    if m["exporter"]["kept_whole"]:
        print(f"  kept whole (not traceable inside): {', '.join(m['exporter']['kept_whole'])}")
    for reason in m["exporter"]["merged_cuts"]:
        print(f"  merged cut {reason}")
    print(
        f"  export time {t['total']:.2f} s (trace {t['trace']:.2f}, compile {t['compile']:.2f}, "
        f"validate at batch {','.join(map(str, report.validated_batches))}"
        f"{' and sequence length ' + ','.join(map(str, report.validated_seqs)) if report.validated_seqs else ''} "
        f"{t['validate']:.2f}, inference stages {t['inference']:.2f}, write {t['write']:.2f})"
    )
    generation = m.get("generation")
    if generation:
        cached = sum(1 for s in generation["stages"] if "cache" in s)
        per_token = sum(s["cache"]["bytes_per_token"] for s in generation["stages"] if "cache" in s)
        print(
            f"  generation: {len(generation['stages'])} stages ({cached} with a key/value cache, {per_token:,} bytes per token "
            f"and sequence), within {generation['reference']['relative_error']:.1e} (relative) of transformers with its cache, "
            f"{t['generation']:.2f} s"
        )
    inference = report.inference
    frozen = [p for p in inference.passes if p is not None]
    if frozen:
        print(
            f"  inference stages: {len(frozen)} of {len(inference.passes)} frozen "
            f"({sum('channels_last' in p for p in frozen)} with channels_last weights); their chain's output is within "
            f"{inference.relative_error:.1e} (relative), {inference.absolute_error:.1e} (absolute) of the references"
        )
    else:
        print("  inference stages: none (inference runs the stage files)")
