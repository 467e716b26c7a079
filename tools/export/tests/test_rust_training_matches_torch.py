"""The Rust host's monolithic training equals PyTorch's own training on the same stages.

`host --config` (with `train.mode: monolithic`) trains every stage of the digits bundle for
a few steps; here the same TorchScript stage files are trained in Python with `torch.optim`
(the single-tensor implementations the Rust optimizers are written after), with the same
batches and the same dropout seeding. The Rust checkpoint must match: every parameter,
buffer and optimizer state tensor. This checks the Rust side's backward, loss and optimizers
against PyTorch itself rather than against a Rust re-statement of them.

Needs the release host binary and the test bundles (`make test-bundles`); skips without them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
HOST = REPO / "target" / "release" / "host"
BUNDLES = Path(os.environ.get("CLEAVE_TEST_BUNDLES", REPO / "target" / "test-bundles"))
BUNDLE = BUNDLES / "digits"
TRAIN = BUNDLES / "digits-train.safetensors"
TEST = BUNDLES / "digits-test.safetensors"

SEED = 7
STEPS = 20
BATCH = 16
TOLERANCE = 1e-5

MASK = 0xFFFFFFFFFFFFFFFF


def stage_seed(seed: int, step: int, stage: int) -> int:
    """`cleave_common::training::stage_seed`: the generator seed of `stage` in step `step`."""
    z = (seed ^ ((step * 0x9E3779B97F4A7C15) & MASK) ^ ((stage * 0xD1B54A32D192ED03) & MASK)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) >> 1


def test_stage_seed_is_a_splitmix_finaliser():
    # With step 1 and stage 0 the mixed word is seed ^ the golden gamma, the first state of
    # SplitMix64 seeded with `seed`: the first output of SplitMix64(0) is 0xE220A8397B1DCDAF
    # (Steele, Lea and Flood's reference values), shifted right once to fit an i64.
    assert stage_seed(0, 1, 0) == 0xE220A8397B1DCDAF >> 1
    assert stage_seed(0x9E3779B97F4A7C15, 0, 0) == 0xE220A8397B1DCDAF >> 1
    seeds = {stage_seed(s, t, i) for s in (0, 7) for t in (0, 1, 2) for i in (0, 1, 11)}
    assert len(seeds) == 18
    assert all(0 <= v < 2**63 for v in seeds)


# torch.optim's single-tensor optimizers scale with `a.add(b, alpha=s)` (L2 weight decay
# `grad.add(param, alpha=wd)`, SGD's `param.add_(grad, alpha=-lr)`), which the CPU kernel
# computes with a fused multiply-add (one rounding); the Rust optimizers take the same fused
# path (`a.addcmul(b, s as a 0-dim tensor)`). Rounding `b * s` first instead left one-ulp
# differences that twenty steps amplified to 1e-4 (Adam normalises the rounding-noise
# gradient of the convolution biases ahead of batch norm) or 1e-2 (a ReLU or max-pool tie
# flips). The `*-pow2` cases use exact products, so they isolate everything but rounding.
#
# name: (the host's YAML, the torch.optim reference, pytest marks)
OPTIMIZERS = {
    "adam": (
        "{ kind: adam, lr: 0.01, weight_decay: 0.0001 }",
        lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.0001, foreach=False),
        [],
    ),
    "sgd": (
        "{ kind: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005 }",
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.0005, foreach=False),
        [],
    ),
    "adam-pow2": (
        f"{{ kind: adam, lr: 0.01, weight_decay: {2.0**-13!r} }}",
        lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=2.0**-13, foreach=False),
        [],
    ),
    "adamw": (
        "{ kind: adamw, lr: 0.01, weight_decay: 0.01 }",
        lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, foreach=False),
        [],
    ),
    "sgd-pow2": (
        f"{{ kind: sgd, lr: {2.0**-4!r}, momentum: 0.9, weight_decay: {2.0**-11!r} }}",
        lambda params: torch.optim.SGD(params, lr=2.0**-4, momentum=0.9, weight_decay=2.0**-11, foreach=False),
        [],
    ),
}


def _require_inputs():
    missing = [str(p) for p in (HOST, BUNDLE / "manifest.json", TRAIN, TEST) if not p.exists()]
    if missing:
        reason = (
            "needs the release host binary and the test bundles (`cargo build --release` and "
            f"`make test-bundles`, or set CLEAVE_TEST_BUNDLES); missing: {', '.join(missing)}"
        )
        # `make test` builds both first and sets CLEAVE_REQUIRE_HOST: there a skip would hide a gap.
        if os.environ.get("CLEAVE_REQUIRE_HOST"):
            pytest.fail(reason)
        pytest.skip(reason)


def _run_host(tmp_path: Path, optimizer_yaml: str, steps: int, threads: int, extra_yaml: str = "") -> dict[str, torch.Tensor]:
    output = tmp_path / "out"
    config = tmp_path / "edge.yaml"
    config.write_text(
        f"""server: http://127.0.0.1:50051
bundle: {BUNDLE}
split: 0
device: cpu
output: {output}
train:
  mode: monolithic
  data: {{ train: {TRAIN}, test: {TEST}, targets: label }}
  epochs: 1
  batch_size: {BATCH}
  eval_batch_size: {BATCH}
  seed: {SEED}
  max_steps: {steps}
  optimizer: {optimizer_yaml}
  loss: cross-entropy
{extra_yaml}"""
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run([str(HOST), "--config", str(config)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"host failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    checkpoint = output / "checkpoints" / f"step-{steps}" / "host.safetensors"
    assert checkpoint.exists(), f"no checkpoint at {checkpoint}; host said:\n{done.stdout}\n{done.stderr}"
    return load_file(str(checkpoint))


def microbatch_seed(seed: int, index: int) -> int:
    """`cleave_common::training::seeding::microbatch_seed`: the session seed of micro-batch `index`."""
    return seed ^ ((index * 0xA24BAED4963EE407) & MASK)


def _train_reference(
    make_optimizer, steps: int, make_scheduler=None, clip: float | None = None, norms: list | None = None, microbatches: int = 1
):
    """Trains the bundle's stage files with torch.optim as the host does; returns the
    parameters and buffers by name, the optimizer and the initial parameter values. With
    `make_scheduler`, it steps once per step; with `clip`, `clip_grad_norm_` runs before
    each step and each step's total norm is appended to `norms`; with `microbatches`, each
    batch is cut by `torch.chunk` and each part's loss, weighed by its share of the batch,
    is backpropagated into the same `.grad` before the one step."""
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    stages = [torch.jit.load(str(BUNDLE / s["file"]), map_location="cpu") for s in manifest["stages"]]
    params: dict[str, torch.nn.Parameter] = {}
    for stage, entry in zip(stages, manifest["stages"]):
        stage.train()
        named = dict(stage.named_parameters())
        assert sorted(named) == sorted(entry["parameter_names"]), entry["name"]
        for name, p in named.items():
            assert name not in params, f"{name} is held by two stages"
            params[name] = p
    initial = {name: p.detach().clone() for name, p in params.items()}
    optimizer = make_optimizer(list(params.values()))
    scheduler = make_scheduler(optimizer) if make_scheduler else None

    output = manifest["output"]
    assert output["type"] == "ref", output
    last_cut = [v["name"] for v in manifest["cuts"][-1]["values"]]
    input_names = [v["name"] for v in manifest["cuts"][0]["values"]]
    assert input_names == ["x"], input_names

    data = load_file(str(TRAIN))
    x, labels = data["x"], data["label"]
    assert len(x) >= steps * BATCH, "the training split is too small for the steps asked"
    for t in range(steps):
        batch = slice(t * BATCH, (t + 1) * BATCH)
        optimizer.zero_grad(set_to_none=True)
        parts = zip(torch.chunk(x[batch], microbatches), torch.chunk(labels[batch], microbatches))
        for k, (part_x, part_labels) in enumerate(parts):
            values = (part_x,)
            for i, stage in enumerate(stages):
                torch.manual_seed(stage_seed(microbatch_seed(SEED, k), t, i))
                values = stage(*values)
                assert isinstance(values, tuple), f"stage {i} returned {type(values)}"
            out = values[last_cut.index(output["name"])]
            loss = F.cross_entropy(out, part_labels)
            if microbatches > 1:
                loss = loss * (len(part_x) / BATCH)
            loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), clip).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    buffers = {name: b for stage in stages for name, b in stage.named_buffers()}
    return params, buffers, optimizer, initial


def _max_diffs(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    diffs = {}
    for name, e in expected.items():
        g = got[name]
        assert g.shape == e.shape, f"{name}: shape {tuple(g.shape)} in the checkpoint, {tuple(e.shape)} in torch"
        diffs[name] = (g.double() - e.detach().double()).abs().max().item() if e.numel() else 0.0
    return diffs


@pytest.mark.parametrize("kind", [pytest.param(k, marks=marks) for k, (_, _, marks) in OPTIMIZERS.items()])
def test_rust_monolithic_training_matches_torch_optim(tmp_path, kind):
    _require_inputs()
    optimizer_yaml, make_optimizer, _ = OPTIMIZERS[kind]
    # Matrix products and convolutions sum in an order that depends on the thread count:
    # the host runs with as many threads as this process.
    threads = torch.get_num_threads()
    rust = _run_host(tmp_path, optimizer_yaml, STEPS, threads)
    params, buffers, optimizer, initial = _train_reference(make_optimizer, STEPS)

    # Same names: every parameter and buffer, and nothing else besides the optimizer state.
    rust_params = {k[len("param."):]: v for k, v in rust.items() if k.startswith("param.")}
    rust_buffers = {k[len("buffer."):]: v for k, v in rust.items() if k.startswith("buffer.")}
    rust_optim = {k[len("optim."):]: v for k, v in rust.items() if k.startswith("optim.")}
    assert set(rust) == {f"param.{k}" for k in rust_params} | {f"buffer.{k}" for k in rust_buffers} | {
        f"optim.{k}" for k in rust_optim
    }
    assert set(rust_params) == set(params)
    assert set(rust_buffers) == set(buffers)

    # The weights moved: a test that trained nothing on either side would pass otherwise.
    # Every tensor changed, and the moves dwarf the tolerance (the convolution biases ahead
    # of batch norm get almost no gradient and move little; the rest move by 1e-2 and more).
    for side, trained in (("torch", {n: p.detach() for n, p in params.items()}), ("the host", rust_params)):
        moved = {name: (trained[name] - initial[name]).abs().max().item() for name in params}
        assert all(m > 0 for m in moved.values()), f"{side} left some parameters as they were: {moved}"
        assert max(moved.values()) > 1000 * TOLERANCE, f"{side} barely moved the parameters: {moved}"
        assert sum(m > 1e-2 for m in moved.values()) >= len(moved) - 2, f"{side} barely moved some parameters: {moved}"

    for name, b in buffers.items():
        if name.endswith("num_batches_tracked"):
            assert b.item() == STEPS, f"torch {name} = {b.item()}"
            assert rust_buffers[name].item() == STEPS, f"host {name} = {rust_buffers[name].item()}"

    # The optimizer state, under the host's `optim.NAME.FIELD` keys.
    state = optimizer.state
    expected_optim = {}
    for name, p in params.items():
        for field, value in state[p].items():
            expected_optim[f"{name}.{field}"] = value if torch.is_tensor(value) else torch.tensor(value)
    assert set(rust_optim) == set(expected_optim), (sorted(rust_optim), sorted(expected_optim))

    diffs = {
        **{f"param.{k}": v for k, v in _max_diffs(params, rust_params).items()},
        **{f"buffer.{k}": v for k, v in _max_diffs(buffers, rust_buffers).items()},
        **{f"optim.{k}": v for k, v in _max_diffs(expected_optim, rust_optim).items()},
    }
    worst = max(diffs, key=diffs.get)
    print(f"{kind}: max abs difference {diffs[worst]:.3g} ({worst}) over {len(diffs)} tensors")
    over = {k: v for k, v in diffs.items() if v > TOLERANCE}
    assert not over, (
        f"{kind}: after {STEPS} steps the host differs from torch.optim by up to {diffs[worst]:.3g} "
        f"({worst}); over {TOLERANCE}: {over}"
    )


def _warmup_cosine(optimizer):
    lr = torch.optim.lr_scheduler
    warmup = lr.LinearLR(optimizer, start_factor=0.1, end_factor=1.0, total_iters=5)
    cosine = lr.CosineAnnealingLR(optimizer, T_max=15, eta_min=0.001)
    return lr.SequentialLR(optimizer, [warmup, cosine], milestones=[5])


# name: (the host's optimizer, its schedule and clipping, the torch.optim reference, its
# scheduler, the clipping norm)
SCHEDULES = {
    "adam-warmup-cosine-clip": (
        "{ kind: adam, lr: 0.01 }",
        "  schedule: { warmup: { steps: 5, start_factor: 0.1 }, decay: { kind: cosine, total_steps: 15, min_lr: 0.001 } }\n"
        "  clip_grad_norm: 4.5\n",
        lambda params: torch.optim.Adam(params, lr=0.01, foreach=False),
        _warmup_cosine,
        4.5,
    ),
    "sgd-step-clip": (
        "{ kind: sgd, lr: 0.05, momentum: 0.9 }",
        "  schedule: { decay: { kind: step, step_size: 6, gamma: 0.5 } }\n  clip_grad_norm: 3.5\n",
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False),
        lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.5),
        3.5,
    ),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_rust_schedules_and_clipping_match_torch(tmp_path, case):
    """A learning-rate schedule and `clip_grad_norm` in the host's monolithic training equal
    torch.optim.lr_scheduler and torch.nn.utils.clip_grad_norm_ on the same steps."""
    _require_inputs()
    optimizer_yaml, extra_yaml, make_optimizer, make_scheduler, clip = SCHEDULES[case]
    rust = _run_host(tmp_path, optimizer_yaml, STEPS, torch.get_num_threads(), extra_yaml)
    norms: list[float] = []
    params, _, _, initial = _train_reference(make_optimizer, STEPS, make_scheduler, clip, norms)
    # Clipping did something, and not everything: some steps over the norm, some under.
    clipped = sum(n > clip for n in norms)
    assert 0 < clipped < STEPS, f"{case}: {clipped} of {STEPS} steps clipped (norms {norms})"
    rust_params = {k[len("param."):]: v for k, v in rust.items() if k.startswith("param.")}
    moved = max((params[n].detach() - initial[n]).abs().max().item() for n in params)
    assert moved > 1000 * TOLERANCE, f"{case}: torch barely moved the parameters ({moved})"
    diffs = _max_diffs(params, rust_params)
    worst = max(diffs, key=diffs.get)
    print(f"{case}: {clipped} of {STEPS} steps clipped; max abs difference {diffs[worst]:.3g} ({worst})")
    assert diffs[worst] <= TOLERANCE, f"{case}: the host differs from torch by {diffs[worst]:.3g} ({worst})"


def test_rust_micro_batches_match_torch_gradient_accumulation(tmp_path):
    """`train.microbatches: 3` in the host's monolithic training equals PyTorch's gradient
    accumulation (`torch.chunk`, each part's loss weighed by its share, one step a batch),
    with clipping by the accumulated gradients' norm; batch norm sees each micro-batch
    on its own, in both."""
    _require_inputs()
    extra = "  microbatches: 3\n  clip_grad_norm: 3.5\n"
    rust = _run_host(tmp_path, "{ kind: adam, lr: 0.01 }", STEPS, torch.get_num_threads(), extra)
    norms: list[float] = []
    make_optimizer = lambda params: torch.optim.Adam(params, lr=0.01, foreach=False)  # noqa: E731
    params, buffers, _, initial = _train_reference(make_optimizer, STEPS, None, 3.5, norms, microbatches=3)
    assert 0 < sum(n > 3.5 for n in norms) < STEPS, f"clipping did something, not everything: {norms}"
    rust_params = {k[len("param."):]: v for k, v in rust.items() if k.startswith("param.")}
    rust_buffers = {k[len("buffer."):]: v for k, v in rust.items() if k.startswith("buffer.")}
    for name, b in buffers.items():
        if name.endswith("num_batches_tracked"):
            assert b.item() == rust_buffers[name].item() == 3 * STEPS, f"{name}: once per micro-batch"
    moved = max((params[n].detach() - initial[n]).abs().max().item() for n in params)
    assert moved > 1000 * TOLERANCE, f"torch barely moved the parameters ({moved})"
    diffs = {**_max_diffs(params, rust_params), **_max_diffs(buffers, rust_buffers)}
    worst = max(diffs, key=diffs.get)
    print(f"microbatches 3: max abs difference {diffs[worst]:.3g} ({worst})")
    assert diffs[worst] <= TOLERANCE, f"the host differs from torch by {diffs[worst]:.3g} ({worst})"
