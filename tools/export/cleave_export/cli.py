"""`python -m cleave_export SOURCE --out DIR`: export a model as a cleave bundle."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from cleave_export import ExportError
from cleave_export.bundle import ExportOptions, export_bundle


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 3,224,224") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: dimensions must be positive")
    return dims


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of batch sizes like 1,3") from None


def parse_args(argv: list[str]) -> ExportOptions:
    p = argparse.ArgumentParser(
        prog="python -m cleave_export",
        description="Export a PyTorch model as a cleave bundle: TorchScript stages split at every module boundary.",
    )
    p.add_argument("source", help="torchvision:NAME (random init) or package.module:callable returning an nn.Module")
    p.add_argument("--out", required=True, type=Path, help="bundle directory to write")
    p.add_argument("--input-shape", type=_shape, help="input shape without the batch, e.g. 3,224,224")
    p.add_argument("--dynamic-batch", nargs=2, type=int, metavar=("MIN", "MAX"), default=(1, 64),
                   help="batch sizes the bundle accepts (default 1 64)")
    p.add_argument("--granularity", default="block",
                   help="where stages may be cut: top (top-level modules), block (one level deeper, default), "
                        "layer (two deeper), op (every operation) or a module depth")
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and reference inputs")
    p.add_argument("--reference-batches", type=_batches, default=(1, 3),
                   help="batch sizes of the reference input/output pairs (default 1,3)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    return ExportOptions(
        source=a.source,
        out=a.out,
        input_shape=a.input_shape,
        batch_min=a.dynamic_batch[0],
        batch_max=a.dynamic_batch[1],
        granularity=a.granularity,
        seed=a.seed,
        reference_batches=a.reference_batches,
        force=a.force,
    )


def main(argv: list[str] | None = None) -> int:
    # TorchScript warns about annotations inside torchvision modules; they do not affect the export.
    warnings.filterwarnings("ignore", message="The TorchScript type system")
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = export_bundle(opts)
    except ExportError as e:
        print(f"cleave_export: error: {e}", file=sys.stderr)
        return 2
    m, t = report.manifest, report.timings
    usable = sum(c["usable"] for c in m["cuts"])
    print(
        f"exported {m['model']['source']} to {opts.out}: {len(m['stages'])} stages, "
        f"{len(m['cuts'])} cuts ({usable} usable), {m['model']['parameters']:,} parameters"
    )
    if m["exporter"]["kept_whole"]:
        print(f"  kept whole (not traceable inside): {', '.join(m['exporter']['kept_whole'])}")
    for reason in m["exporter"]["merged_cuts"]:
        print(f"  merged cut {reason}")
    print(
        f"  export time {t['total']:.2f} s (trace {t['trace']:.2f}, compile {t['compile']:.2f}, "
        f"validate at batch {','.join(map(str, report.validated_batches))} {t['validate']:.2f}, write {t['write']:.2f})"
    )
    return 0
