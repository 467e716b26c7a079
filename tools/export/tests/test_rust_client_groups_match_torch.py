"""Several edges training one server part (`train.clients`) equal the same training written
with PyTorch.

A `server` process and two `host` processes train the digits bundle split at cut 4, each edge
on its own shard of the training split (64 and 48 rows, so 4 and 3 steps an epoch) with its
own dropout seed, for two epochs. Here the same TorchScript stage files are trained in
Python: one copy of the server's stages and its optimizer, one copy of the prefix and its
optimizer per edge, the steps in the group's order (sequential: each edge's epoch in turn;
splitfed: a step each in turn, then FedAvg of the prefixes weighed by the shards' rows). Every
edge's prefix and the server's part must match within 1e-5.

Needs the release binaries and the test bundles (`make test-bundles`); skips without them.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.test_rust_training_matches_torch import BUNDLE, HOST, REPO, TEST, TRAIN, _max_diffs, _require_inputs, stage_seed

SERVER = REPO / "target" / "release" / "server"
SPLIT = 4
# U-shaped runs keep [TAIL, N) and the loss on the edges too.
TAIL = 10
BATCH = 16
EPOCHS = 2
SHARDS = [(0, 64), (64, 112)]
SEEDS = [3, 11]
LR = 0.01
TOLERANCE = 1e-5


def _start_server(config: Path, env: dict[str, str], seconds: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Starts a server on a port of its own choosing (`listen: ...:0`); returns it and its URL
    once it says where it listens. A port picked here could be taken before the server binds
    it, and a connect loop on a free ephemeral port can connect to itself first."""
    server = subprocess.Popen([str(SERVER), "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    addresses: queue.Queue[str] = queue.Queue()

    def read() -> None:
        # Reads every line, so that the server never blocks on a full pipe.
        for line in server.stdout:
            # "serving ID on DEVICE on ADDRESS (plaintext, ...)"
            if line.startswith("serving "):
                addresses.put(line.split(" (")[0].rsplit(" on ", 1)[1])

    threading.Thread(target=read, daemon=True).start()
    try:
        return server, f"http://{addresses.get(timeout=seconds)}"
    except queue.Empty:
        server.kill()
        pytest.fail(f"the server did not say where it listens within {seconds} s (exit {server.wait()})")


def _run_group(tmp_path: Path, mode: str, u_shaped: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Trains the group; returns each edge's last host checkpoint and the server's part."""
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(
        f"listen: 127.0.0.1:0\ninsecure: true\nbundle: {BUNDLE}\ndevice: cpu\n"
        f"training: {{ checkpoint_dir: {tmp_path / 'server-checkpoints'}, max_sessions: 2, client_wait_timeout: 120s }}\n"
    )
    data = load_file(str(TRAIN))
    # Both binaries run with as many threads as this process (a reduction's order follows them).
    threads = str(torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": env}
    server, url = _start_server(server_yaml, env)
    try:
        hosts = []
        train_mode = f"mode: u-shaped\n  tail: {TAIL}" if u_shaped else "mode: split"
        for edge, ((lo, hi), seed) in enumerate(zip(SHARDS, SEEDS)):
            shard = tmp_path / f"shard-{edge}.safetensors"
            save_file({name: t[lo:hi].contiguous() for name, t in data.items()}, str(shard))
            config = tmp_path / f"edge-{edge}.yaml"
            config.write_text(
                f"""server: {url}
bundle: {BUNDLE}
split: {SPLIT}
device: cpu
output: {tmp_path / f"out-{edge}"}
train:
  {train_mode}
  data: {{ train: {shard}, test: {TEST}, targets: label }}
  epochs: {EPOCHS}
  batch_size: {BATCH}
  eval_batch_size: 16
  seed: {seed}
  optimizer: {{ kind: adam, lr: {LR} }}
  loss: cross-entropy
  clients: {{ mode: {mode}, group: g1, edges: {len(SHARDS)}, edge: {edge} }}
"""
            )
            hosts.append(subprocess.Popen([str(HOST), "--config", str(config)], **pipes))
        outputs = [h.communicate(timeout=300)[0] for h in hosts]
        for h, out in zip(hosts, outputs):
            assert h.returncode == 0, f"an edge failed ({h.returncode}):\n{out}"
    finally:
        server.terminate()
        server.wait(timeout=30)
    checkpoints, server_parts = [], []
    for edge, (lo, hi) in enumerate(SHARDS):
        steps = EPOCHS * -(-(hi - lo) // BATCH)
        host_file = tmp_path / f"out-{edge}" / "checkpoints" / f"step-{steps}" / "host.safetensors"
        checkpoints.append(load_file(str(host_file)))
        with safe_open(str(host_file), "pt") as f:
            meta = json.loads(f.metadata()["cleave.checkpoint"])
        namespace = meta["extra"]["server_namespace"]
        server_parts.append(load_file(str(tmp_path / "server-checkpoints" / namespace / f"step-{steps}.safetensors")))
    # Every session saved the one part the group trains.
    for name, t in server_parts[0].items():
        assert torch.equal(t, server_parts[1][name]), name
    return checkpoints, server_parts[0]


def _stages(start: int, end: int) -> list[torch.jit.ScriptModule]:
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    stages = [torch.jit.load(str(BUNDLE / s["file"]), map_location="cpu") for s in manifest["stages"][start:end]]
    for s in stages:
        s.train()
    return stages


def _params(stages) -> list[torch.nn.Parameter]:
    return [p for s in stages for p in s.parameters()]


def _state(stages) -> dict[str, torch.Tensor]:
    """Parameters and buffers named as a checkpoint names them."""
    params = {f"param.{name}": t for s in stages for name, t in s.named_parameters()}
    return params | {f"buffer.{name}": t for s in stages for name, t in s.named_buffers()}


def _train_reference(mode: str, u_shaped: bool):
    """The group's training in PyTorch: each edge's stages (its prefix, and its tail when
    U-shaped) and the one server part."""
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    n = len(manifest["stages"])
    output = manifest["output"]
    last_cut = [v["name"] for v in manifest["cuts"][-1]["values"]]
    data = load_file(str(TRAIN))
    end = TAIL if u_shaped else n
    prefixes = [_stages(0, SPLIT) + (_stages(TAIL, n) if u_shaped else []) for _ in SHARDS]
    server = _stages(SPLIT, end)
    edge_optimizers = [torch.optim.Adam(_params(p), lr=LR, foreach=False) for p in prefixes]
    server_optimizer = torch.optim.Adam(_params(server), lr=LR, foreach=False)
    steps = [0 for _ in SHARDS]

    def step(edge: int, rows: slice) -> None:
        t, seed = steps[edge], SEEDS[edge]
        values = (data["x"][rows],)
        edge_stages = prefixes[edge]
        chain = edge_stages[:SPLIT] + server + edge_stages[SPLIT:]
        for i, stage in enumerate(chain):
            torch.manual_seed(stage_seed(seed, t, i))
            values = stage(*values)
        loss = F.cross_entropy(values[last_cut.index(output["name"])], data["label"][rows])
        edge_optimizers[edge].zero_grad(set_to_none=True)
        server_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        edge_optimizers[edge].step()
        server_optimizer.step()
        steps[edge] += 1

    batches = [[slice(b, min(b + BATCH, hi)) for b in range(lo, hi, BATCH)] for lo, hi in SHARDS]
    for _ in range(EPOCHS):
        if mode == "sequential":
            order = [(edge, rows) for edge, edge_batches in enumerate(batches) for rows in edge_batches]
        else:
            longest = max(len(b) for b in batches)
            order = [(edge, batches[edge][k]) for k in range(longest) for edge in range(len(SHARDS)) if k < len(batches[edge])]
        for edge, rows in order:
            step(edge, rows)
        if mode == "splitfed":
            _fedavg(prefixes)
    return [_state(p) for p in prefixes], _state(server)


def _fedavg(prefixes) -> None:
    """Every prefix's floating-point parameters and buffers set to their average, each edge
    weighed by its share of the rows, summed in the edges' order."""
    total = sum(hi - lo for lo, hi in SHARDS)
    states = [{n: t for s in p for n, t in [*s.named_parameters(), *s.named_buffers()] if t.is_floating_point()} for p in prefixes]
    with torch.no_grad():
        for name in states[0]:
            average = None
            for state, (lo, hi) in zip(states, SHARDS):
                term = state[name] * ((hi - lo) / total)
                average = term if average is None else average + term
            for state in states:
                state[name].copy_(average)


@pytest.mark.parametrize(("mode", "u_shaped"), [("sequential", False), ("splitfed", False), ("splitfed", True)])
def test_a_client_group_trains_as_pytorch_does_in_the_group_s_order(tmp_path, mode, u_shaped):
    _require_inputs()
    if not SERVER.exists():
        pytest.fail(f"no server binary at {SERVER}")
    checkpoints, server_part = _run_group(tmp_path, mode, u_shaped)
    prefixes, server = _train_reference(mode, u_shaped)
    for edge, (expected, got) in enumerate(zip(prefixes, checkpoints)):
        diffs = _max_diffs(expected, got)
        assert max(diffs.values()) <= TOLERANCE, f"edge {edge}: {diffs}"
    diffs = _max_diffs(server, server_part)
    assert max(diffs.values()) <= TOLERANCE, f"the server's part: {diffs}"
    # Sequential: each edge kept its own weights; splitfed: every epoch ended with their average.
    differ = [not torch.equal(checkpoints[0][name], checkpoints[1][name]) for name in prefixes[0] if name.startswith("param.")]
    assert any(differ) if mode == "sequential" else not any(differ)
