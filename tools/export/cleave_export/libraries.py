"""Models from the libraries people build on, as optional extras (never dependencies of the
exporter): `timm:NAME` (timm's `create_model`, `pretrained=False`) and
`ultralytics:CONFIG.yaml` (a YOLO model built from its config). `make extras` installs both
into the project venv (ultralytics is AGPL-3.0; it comes with the headless OpenCV build).

Both are built with random weights from the caller's seed; nothing is downloaded.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import tempfile

from torch import nn

from cleave_export import ExportError

EXTRAS_HINT = "it is an optional extra: `make extras` installs it into the project venv"

ULTRALYTICS_SIDE = 640
"""The image side a YOLO model is built for and fed unless --input-shape says otherwise."""


def _import(package: str, source: str):
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ExportError(f"{source} needs {package}, which is not installed: {EXTRAS_HINT}") from e


def timm_model(name: str, source: str) -> tuple[nn.Module, dict | None, tuple[int, ...]]:
    """(model, preprocessing, input shape without the batch) of timm's `name`, at its default input size."""
    timm = _import("timm", source)
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5)
        nearest = f"the nearest it has: {', '.join(close)}" if close else "timm.list_models() lists them"
        raise ExportError(f"timm has no model {name!r}; {nearest}")
    model = timm.create_model(name, pretrained=False)
    cfg = dict(getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {})
    shape = tuple(int(d) for d in cfg.get("input_size", (3, 224, 224)))
    preprocess = None
    if "mean" in cfg and "std" in cfg and len(shape) == 3:
        crop = shape[-1]
        preprocess = {
            "resize": int(math.floor(crop / float(cfg.get("crop_pct", 0.875)))),
            "crop": crop,
            "mean": [float(m) for m in cfg["mean"]],
            "std": [float(s) for s in cfg["std"]],
        }
    return model, preprocess, shape


def ultralytics_model(config: str, source: str) -> tuple[nn.Module, None, tuple[int, ...]]:
    """(model, no preprocessing, input shape) of a YOLO model built from `config` (a yaml shipped
    with ultralytics, `yolov8n.yaml`, `yolo11s-seg.yaml`, or a path to one), images in [0, 1]."""
    # Ultralytics writes a settings file on import; keep it out of the user's home.
    os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "cleave-export-ultralytics"))
    _import("ultralytics", source)
    tasks = importlib.import_module("ultralytics.nn.tasks")
    if not config.endswith((".yaml", ".yml")):
        raise ExportError(f"{source}: name a model config, such as ultralytics:yolov8n.yaml or ultralytics:yolo11s-seg.yaml")
    builders = {
        "detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "classify": tasks.ClassificationModel,
        "pose": tasks.PoseModel, "obb": tasks.OBBModel,
    }
    task = tasks.guess_model_task(config)
    try:
        model = builders[task](config, verbose=False)
    except FileNotFoundError as e:
        raise ExportError(f"ultralytics has no model config {config!r} (its configs are under ultralytics/cfg/models)") from e
    # The heads' export mode: one tensor of decoded predictions out (not with their raw
    # feature maps beside them), as ultralytics' own TorchScript export does.
    for m in model.modules():
        if hasattr(m, "export") and hasattr(m, "stride"):
            m.export = True
    side = 224 if task == "classify" else ULTRALYTICS_SIDE
    return model, None, (3, side, side)
