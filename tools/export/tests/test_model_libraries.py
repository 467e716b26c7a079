"""Sources from the model libraries people build on: `timm:NAME` and `ultralytics:CONFIG.yaml`.

Both libraries are optional extras, never dependencies of the exporter: these tests skip,
saying why, where they are not installed; `make test-extras` installs them into the project
venv and runs these. Run from tools/export.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from cleave_export import ExportError
from cleave_export.sources import load_source
from tests.test_user_models import _every_split_equals_the_whole, _export


def _needs(package: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"{package} is an optional extra, not installed: `make test-extras` installs it and runs these tests",
    )


@_needs("timm")
@pytest.mark.parametrize("name,stages", [("resnet18", 12), ("vit_tiny_patch16_224", 14)])
def test_a_timm_model_exports_at_its_default_size_and_every_split_equals_the_whole(tmp_path, name, stages):
    b = _export(tmp_path, f"timm:{name}", batch_max=8, reference_batches=[1, 3])
    m = b.manifest
    assert m["inputs"][0]["spec"]["shape"] == ["B", 3, 224, 224]
    assert m["model"]["preprocess"]["crop"] == 224 and len(m["model"]["preprocess"]["mean"]) == 3
    assert len(m["stages"]) >= stages and all(c["usable"] for c in m["cuts"])
    _every_split_equals_the_whole(b)


@_needs("timm")
def test_an_unknown_timm_model_is_refused_with_the_nearest_names():
    with pytest.raises(ExportError, match=r"timm has no model 'resnet1800'; the nearest it has: .*resnet18"):
        load_source("timm:resnet1800", None, 0)


@_needs("ultralytics")
@pytest.mark.parametrize("config", ["yolov8n.yaml", "yolo11n-seg.yaml", "yolov8n-cls.yaml"])
def test_a_yolo_model_built_from_its_config_exports_and_every_split_equals_the_whole(tmp_path, config):
    b = _export(tmp_path, f"ultralytics:{config}", input_shape=(3, 64, 64), batch_max=8, reference_batches=[1, 3])
    m = b.manifest
    assert m["inputs"][0]["spec"]["shape"] == ["B", 3, 64, 64] and m["model"]["preprocess"] is None
    assert len(m["stages"]) >= 8
    _every_split_equals_the_whole(b)


@_needs("ultralytics")
def test_a_yolo_source_that_is_not_a_config_is_refused():
    with pytest.raises(ExportError, match=r"name a model config, such as ultralytics:yolov8n.yaml"):
        load_source("ultralytics:yolov8n.pt", None, 0)


def test_without_the_extra_a_library_source_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # what an absent package looks like to import
    with pytest.raises(ExportError, match=r"timm:resnet18 needs timm, which is not installed: .*`make extras` installs it"):
        load_source("timm:resnet18", None, 0)
