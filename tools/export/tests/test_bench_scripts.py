"""The bench scripts parse their arguments: each one's `--check-args` parses them (defaults
included) and exits 0 without running anything (no server, no root, no network namespace),
so an argument parser that refuses its own defaults shows here rather than at the start of a
long bench.

The executable scripts run as programs (their `#!` line, as `make` runs them); survey.py,
which is not executable, runs with this interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
PROGRAMS = [
    "serving", "chaos", "link-sweep", "loopback-floor", "gpu", "soak", "protocol-cpu", "train-pipeline", "fleet-solve", "fleet-check",
    "generate",
]
"""Executable bench scripts, run as `bench/NAME`."""


def check_args(script: str, *argv: str) -> subprocess.CompletedProcess:
    path = BENCH / script
    cmd = [str(path)] if os.access(path, os.X_OK) else [sys.executable, str(path)]
    return subprocess.run([*cmd, "--check-args", *argv], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_every_bench_script_is_known_here():
    # A bench script added later gets its own --check-args run: list it in PROGRAMS.
    programs = sorted(p.name for p in BENCH.iterdir() if p.is_file() and os.access(p, os.X_OK))
    assert programs == sorted(PROGRAMS)


@pytest.mark.parametrize("script", [*PROGRAMS, "export-survey/survey.py"])
def test_check_args_parses_the_defaults_and_runs_nothing(script):
    run = check_args(script)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) <= 1, run.stdout
    assert run.stderr == ""


def test_serving_runs_every_scenario_by_default_and_refuses_unknown_ones():
    assert check_args("serving").stdout == "bench/serving: arguments ok; scenarios batching edf cuts mixed\n"
    one = check_args("serving", "batching")
    assert (one.returncode, one.stdout) == (0, "bench/serving: arguments ok; scenarios batching\n")
    bad = check_args("serving", "nonsense")
    assert bad.returncode != 0
    assert "invalid choice: 'nonsense' (choose from batching, edf, cuts, mixed)" in bad.stderr


def load_bench(script: str):
    """A bench script as a module (it has no .py suffix), to test its pure helpers."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader(f"bench_{script.replace('-', '_')}", str(BENCH / script))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def load_serving():
    return load_bench("serving")


def test_serving_edf_tightest_slo_line_gives_each_policy_p99_and_their_ratio():
    line = load_serving().tightest_slo_line
    fifo, edf = {"p99_ms": 42.6, "errors": 0}, {"p99_ms": 10.8, "errors": 0}
    assert line(fifo, edf) == "serving edf tightest-slo: fifo light p99 42.60 ms, edf light p99 10.80 ms, fifo/edf 3.94"
    # Errors are not in a p99 of answered requests: the line names them.
    assert line({**fifo, "errors": 2}, edf).endswith("fifo/edf 3.94; light errors fifo 2 edf 0 (not in the p99s)")
    # No light request answered: no p99 (`null` in load.json) and no ratio.
    assert line(fifo, {"p99_ms": None, "errors": 5}) == (
        "serving edf tightest-slo: fifo light p99 42.60 ms, edf light p99 n/a, fifo/edf n/a; light errors fifo 0 edf 5 (not in the p99s)"
    )


def test_train_pipeline_reports_each_micro_batch_count_against_one_and_the_best_per_link():
    bench = load_bench("train-pipeline")
    args = type("Args", (), {"models": ["digits"], "microbatches": [1, 2, 4], "bandwidths": [None, 25.0], "batch": 32,
                             "steps": 12, "rounds": 3, "codec": "raw"})
    runs = {"unshaped": {"1": [6.0, 5.0, 7.0], "2": [6.5, 6.6, 6.4], "4": [None, 8.0, 9.0]},
            "25 Mbit/s": {"1": [30.0, 31.0, 29.0], "2": [22.0, 21.0, 23.0], "4": [None, None, None]}}
    lines = bench.report(args, {"digits": runs})
    assert lines[-3:] == [
        "pipeline digits at unshaped: best M=1, step 6.0 ms, 1.00 x of M=1",
        "pipeline digits at 25 Mbit/s: best M=2, step 22.0 ms, 0.73 x of M=1",
        "",
    ]
    # The median over the rounds that ran; a configuration with none says so.
    assert "8.5 ms 1.42x" in lines[2] and "failed" in lines[3]
    assert check_args("train-pipeline", "--microbatches", "2,4").returncode != 0
    assert "choose among digits, resnet18-64" in check_args("train-pipeline", "--models", "vgg").stderr


def test_generate_knows_its_models_and_needs_token_120():
    assert check_args("generate").stdout == "bench/generate: arguments ok; models gpt2 llama\n"
    assert check_args("generate", "--models", "gpt2,nonsense").returncode != 0
    assert check_args("generate", "--new-tokens", "120").returncode != 0
