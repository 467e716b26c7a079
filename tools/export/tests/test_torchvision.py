"""torchvision through the exporter: every kind of builder constructs without a download,
detectors run as `detection.BatchedDetector` (one batch in, padded fixed shapes out, equal to
the torchvision model's own detections) and export with usable cuts up to the part kept whole,
and a segmentation model exports with usable cuts inside it.

Building all of torchvision's ~120 models takes about two minutes on two cores, so the
construction test covers every segmentation and detection builder and a sample of the others
(classification, video, optical flow, quantized); `bench/export-survey/survey.py` builds and
exports all of them. Two bundles are exported (SSDlite and LR-ASPP at 64x64, a few seconds each).
"""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch
import torchvision
from safetensors.torch import load_file
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from cleave_export import detection
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.sources import load_source

TOL = 1e-5

DETECTION = torchvision.models.list_models(module=torchvision.models.detection)
SEGMENTATION = torchvision.models.list_models(module=torchvision.models.segmentation)
SAMPLE = [
    "resnet18", "mobilenet_v3_small", "efficientnet_b0", "regnet_x_400mf", "squeezenet1_0", "shufflenet_v2_x0_5",
    "vit_b_32", "swin_t", "convnext_tiny", "googlenet", "inception_v3",
    "r3d_18", "raft_small", "quantized_mobilenet_v2",
]
"""Builders outside segmentation and detection: small classification models of each family,
including the two whose init differs (googlenet, inception_v3), and one video, one optical-flow
and one quantized builder."""


class DownloadAttempted(AssertionError):
    pass


@pytest.fixture
def no_network(monkeypatch):
    """Every way a builder could fetch weights raises: torchvision's and torch.hub's loaders,
    urllib, and any socket connection."""

    def refuse(*args, **kwargs):
        raise DownloadAttempted(f"a download was attempted: {args[:1]}")

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr(torch.hub, "urlopen", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_the_guard_catches_a_download(no_network):
    with pytest.raises(DownloadAttempted):
        torchvision.models.get_model("squeezenet1_0", weights="DEFAULT")


@pytest.mark.filterwarnings("ignore:The default weight initialization:FutureWarning")
@pytest.mark.parametrize("name", SEGMENTATION + DETECTION + SAMPLE)
def test_builder_constructs_without_a_download(no_network, name):
    # An input shape for every kind (video and flow builders have no preset); only the
    # construction is under test here.
    src = load_source(f"torchvision:{name}", (3, 64, 64), 0)
    assert not src.model.training
    assert isinstance(src.model, detection.BatchedDetector) == (name in DETECTION)


def test_detection_source_takes_images_in_unit_range_without_preprocessing():
    src = load_source("torchvision:ssdlite320_mobilenet_v3_large", None, 0)
    assert isinstance(src.model, detection.BatchedDetector)
    # The detector normalises and resizes itself: the host only scales pixels to [0, 1].
    assert src.preprocess is None
    (images,) = src.make_inputs(2, None)
    assert images.shape == (2, 3, 320, 320) and 0 <= images.min() and images.max() <= 1


# ---------------------------------------------------------------------------------------------
# The wrapper against torchvision's own output.


def _detector(name: str):
    """A detector that finds something with random weights (every score kept), made quick:
    small images (R-CNN, RetinaNet and FCOS resize to 800 otherwise; SSD has its own fixed
    size), few proposals and detections (masks and keypoints are computed per detection)."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None).eval()
    if isinstance(model, torchvision.models.detection.generalized_rcnn.GeneralizedRCNN):
        model.roi_heads.score_thresh = 0.0
        model.roi_heads.detections_per_img = 12
        model.rpn._post_nms_top_n["testing"] = 40
    else:
        model.score_thresh = 0.0
        model.detections_per_img = 40
    if model.transform.fixed_size is None:
        model.transform.min_size, model.transform.max_size = (96,), 128
    return model


def assert_same_detections(padded: dict, expected: list[dict], limit: int):
    """`padded` (BatchedDetector's output) holds `expected` (torchvision's) row for row, then zeros."""
    assert padded["count"].tolist() == [len(e["boxes"]) for e in expected]
    for i, want in enumerate(expected):
        n = len(want["boxes"])
        for key, value in want.items():
            got = padded[key][i]
            assert got.shape == (limit, *value.shape[1:]) and got.dtype == value.dtype, key
            torch.testing.assert_close(got[:n], value, rtol=0, atol=TOL, msg=key)
            assert not got[n:].any(), f"{key}: padding is not zeros"


@pytest.mark.parametrize("name", DETECTION)
def test_batched_detector_matches_torchvision(name):
    model = _detector(name)
    wrapper = detection.BatchedDetector(model).eval()
    images = torch.rand(2, 3, 48, 64)
    with torch.no_grad():
        expected = model(list(images.unbind(0)))
        got = wrapper(images)
    limit = wrapper.detections_per_img
    assert list(got) == wrapper.output_names
    assert sum(len(e["boxes"]) for e in expected) > 0, "nothing detected: the comparison would be empty"
    assert_same_detections(got, expected, limit)
    assert (got["boxes"][..., 0::2] <= 64).all() and (got["boxes"][..., 1::2] <= 48).all()

    # The parts the exporter keeps whole compile with TorchScript and compute the same.
    transform, detect = torch.jit.script(wrapper.transform), torch.jit.script(wrapper.detect)
    with torch.no_grad():
        batch, sizes = transform(images)
        assert sizes.dtype == torch.int64 and sizes.shape == (2, 3, 2)
        assert sizes[:, 0].tolist() == [[48, 64]] * 2 and sizes[:, 2].tolist() == [list(batch.shape[-2:])] * 2
        features = wrapper.backbone(batch)
        if wrapper.head is None:
            scripted = detect(features, sizes)
        else:
            levels = list(features.values())
            scripted = detect(levels, wrapper.head(levels), sizes)
    assert_same_detections(scripted, expected, limit)


@pytest.mark.parametrize("fixed_size", [None, (320, 240)])
def test_scripted_transform_resizes_as_eager_torchvision(fixed_size):
    # torchvision's own scripted resize makes 799 rows where eager makes 800 at these sizes.
    transform = GeneralizedRCNNTransform(800, 1333, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], fixed_size=fixed_size).eval()
    wrapped = detection.DetectionTransform(transform)
    scripted = torch.jit.script(wrapped)
    for h, w in [(375, 500), (427, 640), (333, 500), (48, 64)]:
        images = torch.rand(2, 3, h, w)
        with torch.no_grad():
            expected, _ = transform(list(images.unbind(0)))
            for batch, sizes in (wrapped(images), scripted(images)):
                assert torch.equal(batch, expected.tensors)
                assert sizes[:, 1].tolist() == [list(s) for s in expected.image_sizes]


def test_pad_detections_truncates_and_scripts():
    detections = [
        {"boxes": torch.rand(3, 4), "scores": torch.rand(3), "labels": torch.tensor([1, 2, 3])},
        {"boxes": torch.rand(0, 4), "scores": torch.rand(0), "labels": torch.zeros(0, dtype=torch.int64)},
    ]
    for pad in (detection.pad_detections, torch.jit.script(detection.pad_detections)):
        out = pad(detections, 2)
        assert list(out) == ["boxes", "scores", "labels", "count"]
        assert out["count"].tolist() == [2, 0] and out["labels"].tolist() == [[1, 2], [0, 0]]
        assert out["boxes"].shape == (2, 2, 4) and torch.equal(out["boxes"][0], detections[0]["boxes"][:2])


def test_only_detectors_are_wrapped():
    with pytest.raises(TypeError, match="not a torchvision detector"):
        detection.BatchedDetector(torchvision.models.squeezenet1_0())


# ---------------------------------------------------------------------------------------------
# Exports.


@pytest.fixture(scope="module")
def ssdlite(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "ssdlite"
    report = export_bundle(
        ExportOptions(source="torchvision:ssdlite320_mobilenet_v3_large", out=out, input_shape=(3, 64, 64), batch_max=3)
    )
    return out, report.manifest


def test_detector_exports_with_usable_cuts_up_to_the_part_kept_whole(ssdlite):
    _, m = ssdlite
    assert m["model"]["class"] == "BatchedDetector" and m["model"]["preprocess"] is None
    assert m["exporter"]["tracer"] == "torch.fx"
    stages = [s["name"] for s in m["stages"]]
    assert stages[0] == "transform" and stages[-1] == "detect" and m["stages"][-1]["modules"] == ["detect"]
    assert "detect" not in " ".join(stages[:-1])
    assert any(s.startswith("backbone.") for s in stages) and any(s.startswith("head.") for s in stages)
    assert len(stages) > 10
    # Every cut is usable, and every tensor crossing one is batch-first.
    for cut in m["cuts"]:
        assert cut["usable"], cut["name"]
        for t in cut["tensors"]:
            assert t["shape"][0] == "B" and "?" not in t["shape"], (cut["name"], t)
    sizes = [t for t in m["cuts"][1]["tensors"] if t["dtype"] == "int64"]
    assert [t["shape"] for t in sizes] == [["B", 3, 2]]
    out = {item["key"]: item["value"]["name"] for item in m["output"]["items"]}
    assert list(out) == ["boxes", "scores", "labels", "count"]
    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in m["cuts"][-1]["tensors"]}
    assert shapes[out["boxes"]] == ("float32", ["B", 300, 4])
    assert shapes[out["labels"]] == ("int64", ["B", 300])
    assert shapes[out["count"]] == ("int64", ["B"])


def test_exported_detector_equals_the_torchvision_model(ssdlite):
    """The bundle's reference outputs (what its stage chain computed) are the plain torchvision
    model's detections on the same images, padded."""
    out_dir, m = ssdlite
    torch.manual_seed(0)  # the exporter's seed: the same random weights
    model = torchvision.models.get_model("ssdlite320_mobilenet_v3_large", weights=None, weights_backbone=None).eval()
    names = {item["key"]: item["value"]["name"] for item in m["output"]["items"]}
    for ref in m["references"]:
        tensors = load_file(str(out_dir / ref["file"]))
        images = tensors["input.images"]
        with torch.no_grad():
            expected = model(list(images.unbind(0)))
        padded = {key: tensors[f"output.{name}"] for key, name in names.items()}
        assert padded["count"].sum() > 0
        assert_same_detections(padded, expected, 300)


def test_segmentation_exports_with_usable_cuts_inside(tmp_path):
    m = export_bundle(
        ExportOptions(source="torchvision:lraspp_mobilenet_v3_large", out=tmp_path / "lraspp", input_shape=(3, 64, 64), batch_max=3)
    ).manifest
    inner = m["cuts"][1:-1]
    assert len(inner) > 10 and all(c["usable"] for c in m["cuts"])
    assert any(s["name"].startswith("backbone.") for s in m["stages"])
    assert m["cuts"][-1]["tensors"][0]["shape"] == ["B", 21, 64, 64]
