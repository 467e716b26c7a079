#!/usr/bin/env python3
"""Export every torchvision builder and a list of transformers architectures, one
`python -m cleave_export` subprocess each (with a timeout), and tabulate what came out:
stages, usable cuts, export time, or the exporter's one-line error.

    cd tools/export && nice -n 19 ../../.venv/bin/python ../../bench/export-survey/survey.py

Results go to `results.json` beside this script (one entry per model, written as each export
ends, so an interrupted run resumes where it stopped with `--resume`) and the table into
`README.md` between its survey markers. Nothing is downloaded: builders get `weights=None`
(and `weights_backbone=None`), transformers models are built from a config, and each export
runs with an empty TORCH_HOME, Hugging Face offline mode and an HTTP(S) proxy that refuses
connections, so a download attempt would fail the export and show in the table.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPORT_DIR = HERE.parent.parent / "tools" / "export"
BEGIN, END = "<!-- survey:begin -->", "<!-- survey:end -->"

SIDE = 64
"""Image side tried first for torchvision models (a video model's frames too)."""
FIXED_SIDE = {"vit_b_16": 224, "vit_b_32": 224, "vit_l_16": 224, "vit_l_32": 224, "vit_h_14": 224, "maxvit_t": 224}
"""Builders whose image size is fixed when they are built (weights=None builds them at 224)."""
FRAMES = 8

# Small configs: enough layers to cut between, small enough to export in seconds. Lists cannot
# be given through --hf-config (it splits on commas), so models configured by lists (ConvNeXt,
# ResNet, Swin V2, SegFormer, MobileViT) keep their default config at a small image size.
_TEXT = "vocab_size=1000,max_position_embeddings=128"
_DECODER = f"num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,intermediate_size=128,{_TEXT}"
HF_MODELS: list[tuple[str, str, tuple[int, ...] | None]] = [
    ("GPT2LMHeadModel", "n_layer=2,n_embd=64,n_head=4,vocab_size=1000,n_positions=128", None),
    ("BertForSequenceClassification", f"num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,{_TEXT}", None),
    ("DistilBertForSequenceClassification", f"n_layers=2,dim=64,n_heads=4,hidden_dim=128,{_TEXT}", None),
    # RoBERTa's positions start after its padding index: room for 128 tokens needs 130.
    ("RobertaForSequenceClassification",
     "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=1000,max_position_embeddings=130", None),
    ("AlbertForSequenceClassification",
     f"num_hidden_layers=2,hidden_size=64,embedding_size=32,num_attention_heads=4,intermediate_size=128,{_TEXT}", None),
    ("ElectraForSequenceClassification",
     f"num_hidden_layers=2,hidden_size=64,embedding_size=32,num_attention_heads=4,intermediate_size=128,{_TEXT}", None),
    ("LlamaForCausalLM", _DECODER, None),
    ("MistralForCausalLM", _DECODER, None),
    ("Qwen2ForCausalLM", _DECODER, None),
    ("GemmaForCausalLM", f"{_DECODER},head_dim=16", None),
    ("Phi3ForCausalLM", f"{_DECODER},pad_token_id=0", None),
    ("GPTNeoXForCausalLM", f"num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,{_TEXT}", None),
    ("OPTForCausalLM", f"num_hidden_layers=2,hidden_size=64,word_embed_proj_dim=64,num_attention_heads=4,ffn_dim=128,{_TEXT}", None),
    ("BloomForCausalLM", "n_layer=2,hidden_size=64,n_head=4,vocab_size=1000", None),
    ("T5EncoderModel", "num_layers=2,d_model=64,d_kv=16,num_heads=4,d_ff=128,vocab_size=1000", None),
    # Whisper's encoder is no top-level transformers class; its audio classifier is, and is fed
    # input_features (listed to show the exporter's answer).
    ("WhisperForAudioClassification", "encoder_layers=2,d_model=64,encoder_attention_heads=4,encoder_ffn_dim=128", None),
    ("ViTForImageClassification",
     "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,patch_size=8,num_labels=10", None),
    ("DeiTForImageClassification",
     "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,patch_size=8,num_labels=10", None),
    ("BeitForImageClassification",
     "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,patch_size=8,num_labels=10", None),
    # BEiT and Swin V2 default to stochastic depth (drop_path_rate=0.1); again without it.
    ("BeitForImageClassification", "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,"
                                   "patch_size=8,num_labels=10,drop_path_rate=0.0", None),
    ("Dinov2Model", "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,image_size=32,patch_size=8", None),
    ("ConvNextForImageClassification", "num_labels=10", (3, 64, 64)),
    ("ResNetForImageClassification", "num_labels=10", (3, 64, 64)),
    ("Swinv2ForImageClassification", "num_labels=10", (3, 64, 64)),
    ("Swinv2ForImageClassification", "num_labels=10,drop_path_rate=0.0", (3, 64, 64)),
    ("SegformerForSemanticSegmentation", "num_labels=10", (3, 64, 64)),
    ("MobileViTForImageClassification", "num_labels=10", (3, 64, 64)),
]


# The model libraries' families (optional extras, `make extras`): timm at each model's
# default input size; YOLO models built from ultralytics' configs, at 320x320 (640 by
# default) to keep the survey short.
TIMM_MODELS = [
    "resnet18", "efficientnet_b0", "mobilenetv3_small_100", "regnety_002", "convnext_atto",
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224",
]
YOLO_CONFIGS = ["yolov8n.yaml", "yolo11n.yaml", "yolov8n-seg.yaml", "yolo11n-pose.yaml", "yolov8n-cls.yaml"]
YOLO_SIDE = 320


@dataclass
class Job:
    """One model to export, and the input shapes to try in order (the next one when the model
    refuses the previous one's inputs)."""

    name: str
    kind: str
    source: str
    shapes: list[tuple[int, ...] | None]
    extra: list[str] = field(default_factory=list)
    timeout: float = 120.0
    note: str = ""


@dataclass
class Result:
    name: str
    kind: str
    source: str
    input: str
    ok: bool
    stages: int | None = None
    cuts: int | None = None
    usable: int | None = None
    seconds: float | None = None
    """The exporter's own export time (its `export time` line)."""
    wall: float | None = None
    """The subprocess's wall time, start-up included."""
    tracer: str = ""
    kept_whole: list[str] = field(default_factory=list)
    parameters: int | None = None
    error: str = ""
    note: str = ""


def torchvision_jobs(detection_timeout: float, timeout: float) -> list[Job]:
    import torchvision
    from torchvision import models

    kinds = {}
    for kind in ("segmentation", "detection", "video", "optical_flow", "quantization"):
        for name in models.list_models(module=getattr(models, kind)):
            kinds[name] = kind
    jobs = []
    for name in models.list_models():
        kind = kinds.get(name, "classification")
        try:
            meta = torchvision.models.get_model_weights(name).DEFAULT.meta
        except Exception:  # noqa: BLE001 -- a builder without published weights: no hints
            meta = {}
        least = max(meta.get("min_size", (1, 1)))
        note = ""
        if kind == "video":
            frames = max(FRAMES, meta.get("min_temporal_size", 1))
            shapes = [(3, FRAMES, SIDE, SIDE)]
            if frames != FRAMES or least > SIDE:
                shapes.append((3, frames, max(least, SIDE), max(least, SIDE)))
        elif kind == "detection":
            shapes = [(3, SIDE, SIDE)]
            inside = 300 if name.startswith("ssd300") else 320 if "320" in name else 800
            note = f"resizes to {inside}x{inside} inside; last stage `detect` (data-dependent part) kept whole"
        else:
            side = FIXED_SIDE.get(name, SIDE)
            shapes = [(3, side, side)] + ([(3, least, least)] if least > side and name not in FIXED_SIDE else [])
            if kind == "quantization":
                note = "weights=None builds the float model with quantization stubs (quantize=False)"
        jobs.append(Job(name, kind, f"torchvision:{name}", shapes, [], detection_timeout if kind == "detection" else timeout, note))
    return jobs


def hf_jobs(timeout: float) -> list[Job]:
    jobs = []
    for cls, config, shape in HF_MODELS:
        name = f"{cls} (drop_path_rate=0)" if "drop_path_rate=0" in config else cls
        jobs.append(Job(name, "transformers", f"hf:{cls}", [shape], ["--hf-config", config], timeout, f"--hf-config {config}"))
    return jobs


def library_jobs(timeout: float) -> list[Job]:
    """timm and ultralytics models, where the library is installed (a note says where not)."""
    import importlib.util

    jobs = []
    if importlib.util.find_spec("timm") is None:
        print("survey: timm is not installed (`make extras`); its models are left out", flush=True)
    else:
        jobs += [Job(f"timm:{name}", "timm", f"timm:{name}", [None], [], timeout, "timm's default input size") for name in TIMM_MODELS]
    if importlib.util.find_spec("ultralytics") is None:
        print("survey: ultralytics is not installed (`make extras`); its models are left out", flush=True)
    else:
        side = (3, YOLO_SIDE, YOLO_SIDE)
        jobs += [
            Job(f"ultralytics:{c}", "ultralytics", f"ultralytics:{c}", [side], [], timeout, "built from its config, random weights")
            for c in YOLO_CONFIGS
        ]
    return jobs


def _environment(torch_home: Path) -> dict:
    env = dict(os.environ)
    # Nothing may be downloaded: an empty cache, offline hubs, a proxy that refuses.
    env.update({
        "TORCH_HOME": str(torch_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "PYTHONWARNINGS": "ignore",
    })
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXPORT_DIR), env.get("PYTHONPATH")]))
    return env


_EXPORTED = re.compile(r"^exported .*: (\d+) stages, (\d+) cuts \((\d+) usable\), ([\d,]+) parameters")
_TIME = re.compile(r"^\s*export time ([\d.]+) s")


def run_job(job: Job, python: str, scratch: Path, env: dict) -> Result:
    result = None
    for shape in job.shapes:
        out = scratch / "bundle"
        cmd = [python, "-m", "cleave_export", job.source, "--out", str(out), "--force", *job.extra]
        if shape is not None:
            cmd += ["--input-shape", ",".join(map(str, shape))]
        shape_text = "x".join(map(str, shape)) if shape else "config"
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=EXPORT_DIR, env=env, capture_output=True, text=True, timeout=job.timeout)
        except subprocess.TimeoutExpired:
            result = Result(job.name, job.kind, job.source, shape_text, False, wall=job.timeout,
                            error=f"timed out after {job.timeout:.0f} s", note=job.note)
            break
        finally:
            wall = time.perf_counter() - started
        result = Result(job.name, job.kind, job.source, shape_text, proc.returncode == 0, wall=round(wall, 1), note=job.note)
        if proc.returncode == 0:
            for line in proc.stdout.splitlines():
                if m := _EXPORTED.match(line):
                    result.stages, result.cuts, result.usable = int(m[1]), int(m[2]), int(m[3])
                    result.parameters = int(m[4].replace(",", ""))
                elif m := _TIME.match(line):
                    result.seconds = float(m[1])
            manifest = json.loads((out / "manifest.json").read_text())
            result.tracer = manifest["exporter"]["tracer"]
            result.kept_whole = manifest["exporter"]["kept_whole"]
            shutil.rmtree(out, ignore_errors=True)
            break
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("cleave_export: error:")]
        last = errors[-1] if errors else lines[-1] if lines else f"exit code {proc.returncode}"
        result.error = last.removeprefix("cleave_export: error: ")
        shutil.rmtree(out, ignore_errors=True)
        if "fails on its example inputs" not in result.error or "missing" in result.error:
            break  # another input size would not help
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: list[Result], command: str, started: str, ended: str, commit: str, earlier: list[dict] = ()) -> str:
    ok = [r for r in results if r.ok]
    lines = [
        f"Run {started} to {ended} at commit {commit} on {platform.node() or 'this machine'} ({os.cpu_count()} cores, shared), with:",
        "",
        f"    {command}",
        "",
    ]
    for run in earlier:
        lines += [
            f"The rows of the models that run did not export come from the run of {run['started']} to {run['ended']} "
            f"at commit {run['commit']}, with:",
            "",
            f"    {run['command']}",
            "",
        ]
    lines += [
        f"{len(ok)} of {len(results)} exported. Export time is the exporter's own (`export time` line: trace, compile,",
        "validate at batch 1, 3 and 8, write); the machine was shared, so times are rough. Usable cuts count the",
        "input and output cuts too.",
        "",
        "| model | kind | input | stages | usable cuts | export time (s) | notes or the one-line error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = ["classification", "segmentation", "detection", "video", "optical_flow", "quantization", "transformers", "timm", "ultralytics"]
    for r in sorted(results, key=lambda r: (order.index(r.kind) if r.kind in order else 99, r.name)):
        if r.ok:
            notes = [f"{r.parameters:,} parameters", r.tracer]
            if r.kept_whole:
                notes.append("kept whole: " + ", ".join(r.kept_whole))
            if r.note:
                notes.append(r.note)
            lines.append(
                f"| {r.name} | {r.kind} | {r.input} | {r.stages} | {r.usable} of {r.cuts} | {r.seconds:.1f} | {_cell('; '.join(notes))} |"
            )
        else:
            lines.append(f"| {r.name} | {r.kind} | {r.input} | - | - | - | **{_cell(r.error)}** |")
    return "\n".join(lines) + "\n"


def write_readme(table: str, readme: Path) -> None:
    text = readme.read_text() if readme.exists() else f"# Export survey\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def _save(path: Path, started: str, ended: str | None, command: str, commit: str, done: dict[str, Result], earlier: list[dict]) -> None:
    header = {"started": started, "ended": ended, "command": command, "commit": commit, "earlier": earlier}
    path.write_text(json.dumps(header | {"results": [asdict(r) for r in done.values()]}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", default=[], metavar="GLOB", help="models whose name matches (repeatable)")
    p.add_argument("--skip-torchvision", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-libraries", action="store_true", help="leave out timm and ultralytics models")
    p.add_argument("--timeout", type=float, default=120, help="seconds per export (default 120)")
    p.add_argument("--detection-timeout", type=float, default=300,
                   help="seconds per detection export (default 300: R-CNN, RetinaNet and FCOS work at 800x800 inside)")
    p.add_argument("--results", type=Path, default=HERE / "results.json")
    p.add_argument("--readme", type=Path, default=HERE / "README.md")
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in --results and skip their models (those --only names are exported again)")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs the exporter")
    p.add_argument("--render", action="store_true", help="only write the table again from --results")
    p.add_argument("--check-args", action="store_true", help="parse the arguments and exit; export nothing")
    a = p.parse_args(argv)
    if a.check_args:
        print("survey.py: arguments ok")
        return 0
    if a.render:
        saved = json.loads(a.results.read_text())
        results = [Result(**r) for r in saved["results"]]
        header = (saved["command"], saved["started"], saved.get("ended", "?"), saved.get("commit", "?"), saved.get("earlier", []))
        write_readme(markdown(results, *header), a.readme)
        return 0

    jobs = [] if a.skip_torchvision else torchvision_jobs(a.detection_timeout, a.timeout)
    jobs += [] if a.skip_transformers else hf_jobs(a.timeout)
    jobs += [] if a.skip_libraries else library_jobs(a.timeout)
    if a.only:
        jobs = [j for j in jobs if any(fnmatch.fnmatch(j.name, g) for g in a.only)]
    done: dict[str, Result] = {}
    earlier: list[dict] = []
    if a.resume and a.results.exists():
        saved = json.loads(a.results.read_text())
        done = {r["name"]: Result(**r) for r in saved["results"]}
        # The run resumed is named beside this one, unless it is this one's interrupted start.
        if saved.get("ended"):
            earlier = [{k: saved.get(k) for k in ("started", "ended", "command", "commit")}, *saved.get("earlier", [])]
        else:
            earlier = saved.get("earlier", [])
    started = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip() or "?"
    command = " ".join(["python", "bench/export-survey/survey.py", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="cleave-survey-") as tmp:
        scratch = Path(tmp)
        (scratch / "torch-home").mkdir()
        env = _environment(scratch / "torch-home")
        for i, job in enumerate(jobs):
            if job.name in done and not a.only:
                continue
            r = run_job(job, a.python, scratch, env)
            done[job.name] = r
            status = f"{r.stages} stages, {r.usable}/{r.cuts} usable, {r.seconds} s" if r.ok else r.error
            print(f"[{i + 1}/{len(jobs)}] {job.name} ({r.input}): {status}", flush=True)
            _save(a.results, started, None, command, commit, done, earlier)
    ended = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
    _save(a.results, started, ended, command, commit, done, earlier)
    results = list(done.values())
    write_readme(markdown(results, command, started, ended, commit, earlier), a.readme)
    print(f"{sum(r.ok for r in results)} of {len(results)} exported; table in {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
