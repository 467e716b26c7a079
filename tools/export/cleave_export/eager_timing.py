"""PyTorch eager timing of a model, the baseline for the Rust runtime's compute:

    python -m cleave_export.eager_timing SOURCE [--input-shape 3,224,224] [--seed N] [--hf-config ...] \\
        --batches 1,8 --runs 30 --threads N [--bundle DIR]

builds the model exactly as the exporter does (the same SOURCE, --input-shape, --hf-config and
--seed, in eval mode), feeds it the exporter's example inputs at each batch size and prints one
line per batch size, the median wall time of one forward under `torch.inference_mode()` after
warm-up runs:

    eager batch 8: median 123.456 ms over 30 runs (threads 2)

With `--bundle DIR`, a bundle exported from the same SOURCE and seed, it also times the bundle's
chains as the runtime runs them, stage after stage, interleaved run by run with the eager model
(so that both see the same machine): the stage files, and the inference files (a stage's stage
file where it has none). Each chain's output is first checked against the eager output.

    stages batch 8: median 125.000 ms over 30 runs (threads 2; 1.013x eager)
    inference stages batch 8: median 97.000 ms over 30 runs (threads 2; 0.786x eager)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch

from cleave_export import ExportError, first_line
from cleave_export.bundle import assemble_output
from cleave_export.cli import add_model_arguments, batch_list, hf_config
from cleave_export.compare import TOLERANCE, relative_error
from cleave_export.sources import ModelSource, load_source
from cleave_export.specs import check_value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cleave_export.eager_timing",
        description="Time a model in PyTorch eager mode, built and fed as the exporter builds and feeds it.",
    )
    add_model_arguments(p)
    p.add_argument("--batches", type=batch_list, default=(1, 8), help="batch sizes to time (default 1,8)")
    p.add_argument("--runs", type=int, default=30, help="timed runs per batch size (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch intra-op threads (default {torch.get_num_threads()}, all cores)")
    p.add_argument("--seq-len", type=int, help="sequence length, for models taking token ids (default: the longest the exporter takes)")
    p.add_argument("--bundle", type=Path, help="also time this bundle's stage files and inference files, chained")
    a = p.parse_args(argv)
    if a.runs < 1 or a.warmup < 0 or a.threads < 1 or any(b < 1 for b in a.batches):
        p.error("--runs, --threads and the batch sizes must be positive, --warmup not negative")
    a.hf_config = hf_config(p, a.hf_config)
    return a


class Chain:
    """A bundle's stages, run one after another as the runtime runs them."""

    def __init__(self, bundle: Path, manifest: dict, inference: bool):
        self.manifest = manifest
        files = [s.get("inference_file", s["file"]) if inference else s["file"] for s in manifest["stages"]]
        self.stages = [torch.jit.load(str(bundle / f)).eval() for f in files]

    def __call__(self, inputs: tuple):
        values = list(inputs)
        for stage in self.stages:
            values = list(stage(*values))
        return values

    def output(self, inputs: tuple):
        """The model's output rebuilt from the chain's last values."""
        by_name = {v["name"]: x for v, x in zip(self.manifest["cuts"][-1]["values"], self(inputs))}
        return assemble_output(self.manifest["output"], by_name)


def _bundle_chains(bundle: Path, src: ModelSource, seed: int) -> dict[str, Chain]:
    try:
        manifest = json.loads((bundle / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {bundle / 'manifest.json'}: {e}") from e
    model = manifest["model"]
    if (model["source"], model["seed"]) != (src.source, seed):
        raise ExportError(
            f"{bundle} was exported from {model['source']} with seed {model['seed']}, not {src.source} with seed {seed}"
        )
    return {"stages": Chain(bundle, manifest, inference=False), "inference stages": Chain(bundle, manifest, inference=True)}


def _check_chain(name: str, chain: Chain, src: ModelSource, inputs: tuple, batch: int, seq: int | None) -> None:
    """The chain takes these inputs (the bundle's input specs) and computes the eager output."""
    for value, x in zip(chain.manifest["inputs"], inputs):
        try:
            check_value(value["spec"], x, batch, f"input {value['name']!r}", seq)
        except ValueError as e:
            raise ExportError(f"the bundle does not take these inputs (another --input-shape?): {e}") from e
    err = relative_error(chain.output(inputs), src(inputs))
    if err > TOLERANCE:
        raise ExportError(f"the bundle's {name} compute another output than the eager model at batch {batch} (relative error {err:.1e})")


def time_batches(src: ModelSource, a: argparse.Namespace, chains: dict[str, Chain]) -> Iterator[str]:
    """The report lines, batch size after batch size."""
    seq = a.seq_len
    if seq is None and src.sequence is not None:
        seq = src.sequence[1]
    for batch in a.batches:
        inputs = src.example_inputs(a.seed, batch, seq)
        runners = {"eager": lambda: src(inputs)} | {name: (lambda c=c: c(inputs)) for name, c in chains.items()}
        times: dict[str, list[float]] = {name: [] for name in runners}
        with torch.inference_mode():
            for name, chain in chains.items():
                _check_chain(name, chain, src, inputs, batch, seq)
            for _ in range(a.warmup):
                for run in runners.values():
                    run()
            for _ in range(a.runs):
                for name, run in runners.items():
                    started = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - started)
        eager = statistics.median(times["eager"])
        yield f"eager batch {batch}: median {eager * 1e3:.3f} ms over {a.runs} runs (threads {a.threads})"
        for name in chains:
            median = statistics.median(times[name])
            ratio = f"{median / eager:.3f}x eager"
            yield f"{name} batch {batch}: median {median * 1e3:.3f} ms over {a.runs} runs (threads {a.threads}; {ratio})"


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="The TorchScript type system")
    a = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    try:
        src = load_source(a.source, a.input_shape, a.seed, a.hf_config)
        chains = {} if a.bundle is None else _bundle_chains(a.bundle, src, a.seed)
        for line in time_batches(src, a, chains):
            print(line, flush=True)
    except Exception as e:
        print(f"eager_timing: error: {type(e).__name__ + ': ' if not isinstance(e, ExportError) else ''}{first_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
