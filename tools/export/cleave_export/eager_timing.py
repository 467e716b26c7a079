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

With `--cuts 4,9,14` as well, it times the edge's part instead, at each cut s: the bundle's
inference stages [0, s) chained (what the host runs before it sends cut s) against PyTorch
eager running the same layers, the model traced and cut as the exporter cuts it, each stage a
GraphModule calling the model's own modules eagerly. Runs are interleaved, cut by cut, and
each prefix's output is first checked against eager's. One line per batch size and cut, then
the largest ratio:

    eager batch 1 cut 4 (features.3): median 1.500 ms over 30 runs (threads 1)
    inference stages batch 1 cut 4 (features.3): median 1.200 ms over 30 runs (threads 1; 0.800x eager)
    worst inference stages / eager: 0.912x (batch 8, cut 9)

The chain is called from Python through `torch.jit`, the TorchScript interpreter the Rust
runtime calls through libtorch; what the runtime adds per stage is `split-overhead`'s business.
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
from cleave_export.bundle import assemble_output, trace_stages
from cleave_export.cli import add_model_arguments, batch_list, hf_config
from cleave_export.compare import TOLERANCE, relative_error
from cleave_export.partition import GRANULARITY_DEPTH, parse_granularity
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
    p.add_argument("--cuts", type=batch_list, metavar="S,...",
                   help="with --bundle: time the inference stages before each of these cuts against eager running the same layers")
    a = p.parse_args(argv)
    if a.cuts is not None and a.bundle is None:
        p.error("--cuts needs --bundle")
    if a.runs < 1 or a.warmup < 0 or a.threads < 1 or any(b < 1 for b in a.batches):
        p.error("--runs, --threads and the batch sizes must be positive, --warmup not negative")
    a.hf_config = hf_config(p, a.hf_config)
    return a


def run_stages(stages: list, inputs) -> list:
    """The values after `stages`, run one after another on `inputs`."""
    values = list(inputs)
    for stage in stages:
        values = list(stage(*values))
    return values


class Chain:
    """A bundle's stages, run one after another as the runtime runs them."""

    def __init__(self, bundle: Path, manifest: dict, inference: bool):
        self.manifest = manifest
        files = [s.get("inference_file", s["file"]) if inference else s["file"] for s in manifest["stages"]]
        self.stages = [torch.jit.load(str(bundle / f)).eval() for f in files]

    def __call__(self, inputs: tuple):
        return run_stages(self.stages, inputs)

    def prefix(self, inputs: tuple, cut: int) -> list:
        """The values at `cut`: stages [0, cut) run on the model's inputs."""
        return run_stages(self.stages[:cut], inputs)

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


def _seq_len(src: ModelSource, a: argparse.Namespace) -> int | None:
    """The sequence length the inputs have: `--seq-len`, else the longest the exporter takes."""
    if a.seq_len is not None or src.sequence is None:
        return a.seq_len
    return src.sequence[1]


def time_batches(src: ModelSource, a: argparse.Namespace, chains: dict[str, Chain]) -> Iterator[str]:
    """The report lines, batch size after batch size."""
    seq = _seq_len(src, a)
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


def _eager_stages(src: ModelSource, seed: int, manifest: dict) -> list:
    """The bundle's stages as eager GraphModules: the model traced and cut as its export was."""
    exporter = manifest["exporter"]
    sequence = manifest.get("sequence")
    traced = trace_stages(
        src,
        seed,
        parse_granularity(exporter["granularity"]),
        exporter["granularity"] in GRANULARITY_DEPTH,
        (manifest["batch"]["min"], manifest["batch"]["max"]),
        None if sequence is None else (sequence["min"], sequence["max"]),
    )
    names = [s.name for s in traced.part.stages]
    if names != [s["name"] for s in manifest["stages"]]:
        raise ExportError(f"the model cuts into other stages than the bundle's ({len(names)} stages: {', '.join(names[:5])}, ...)")
    return traced.eager_stages()


def time_cuts(src: ModelSource, a: argparse.Namespace, chain: Chain) -> Iterator[str]:
    """The report lines of `--cuts`, batch size after batch size, then the largest ratio."""
    stage_count = len(chain.stages)
    bad = [s for s in a.cuts if not 0 < s <= stage_count]
    if bad:
        raise ExportError(f"cuts {bad} are outside 1..{stage_count}, the cuts with stages before them")
    eager_stages = _eager_stages(src, a.seed, chain.manifest)

    def eager_prefix(inputs: tuple, cut: int) -> list:
        return run_stages(eager_stages[:cut], inputs)

    seq = _seq_len(src, a)
    worst = (0.0, 0, 0)
    for batch in a.batches:
        inputs = src.example_inputs(a.seed, batch, seq)
        times = {(who, cut): [] for cut in a.cuts for who in ("eager", "inference stages")}
        runners = {"eager": eager_prefix, "inference stages": chain.prefix}
        with torch.inference_mode():
            for cut in a.cuts:
                err = relative_error(chain.prefix(inputs, cut), eager_prefix(inputs, cut))
                if err > TOLERANCE:
                    raise ExportError(
                        f"the inference stages compute other values at cut {cut} than eager at batch {batch} (relative error {err:.1e})"
                    )
            for _ in range(a.warmup):
                for cut in a.cuts:
                    for run in runners.values():
                        run(inputs, cut)
            for i in range(a.runs):
                for cut in a.cuts:
                    # Each goes first every other run, so that neither always meets a cold cache.
                    for who in list(runners)[:: 1 if i % 2 == 0 else -1]:
                        started = time.perf_counter()
                        runners[who](inputs, cut)
                        times[(who, cut)].append(time.perf_counter() - started)
        for cut in a.cuts:
            name = f"batch {batch} cut {cut} ({chain.manifest['cuts'][cut]['name']})"
            eager, ours = statistics.median(times[("eager", cut)]), statistics.median(times[("inference stages", cut)])
            worst = max(worst, (ours / eager, batch, cut))
            yield f"eager {name}: median {eager * 1e3:.3f} ms over {a.runs} runs (threads {a.threads})"
            yield f"inference stages {name}: median {ours * 1e3:.3f} ms over {a.runs} runs (threads {a.threads}; {ours / eager:.3f}x eager)"
    yield f"worst inference stages / eager: {worst[0]:.3f}x (batch {worst[1]}, cut {worst[2]})"


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="The TorchScript type system")
    a = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    try:
        src = load_source(a.source, a.input_shape, a.seed, a.hf_config)
        chains = {} if a.bundle is None else _bundle_chains(a.bundle, src, a.seed)
        lines = time_batches(src, a, chains) if a.cuts is None else time_cuts(src, a, chains["inference stages"])
        for line in lines:
            print(line, flush=True)
    except Exception as e:
        print(f"eager_timing: error: {type(e).__name__ + ': ' if not isinstance(e, ExportError) else ''}{first_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
