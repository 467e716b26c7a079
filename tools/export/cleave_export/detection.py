"""torchvision's detectors as modules that take one batch and return fixed shapes, so that the
exporter can cut them.

torchvision's detection models (Faster, Mask and Keypoint R-CNN, RetinaNet, FCOS, SSD,
SSDlite) take a *list* of images and return a list of per-image dicts whose lengths depend on
the data; torch.fx cannot trace their forward, and nothing after the backbone has a shape a
receiver could bound. `BatchedDetector` wraps one as four parts, in order:

    transform  `DetectionTransform`: the model's own normalise + resize + batch (eval mode),
               kept whole; the image sizes it found travel on as an int64 tensor `sizes [B, 3, 2]`
    backbone   the model's backbone (+ FPN), traced, so the exporter cuts inside it
    head       one-stage detectors only (RetinaNet, FCOS, SSD): the convolutional head giving
               class and box outputs per anchor, fixed shapes, traced
    detect     everything whose shapes depend on the data (RPN and ROI heads, or anchors,
               decoding and NMS), then boxes mapped back to the input size and padded: kept
               whole, so it lands in the last stage

Every value between the parts has the batch as its first dimension, so every cut before
`detect` is usable. The output is a dict of batch-first tensors: per image at most `D`
detections (the model's own `detections_per_img`), padded with zeros, and how many are real:
`boxes [B, D, 4]`, `scores [B, D]`, `labels [B, D]` (int64), Mask R-CNN's `masks [B, D, 1, H,
W]`, Keypoint R-CNN's `keypoints [B, D, K, 3]` and `keypoints_scores [B, D, K]`, then `count
[B]` (int64). Rows below `count` are exactly what the wrapped model returns for that image.

The wrapper runs in eval mode only: in training mode torchvision's heads need targets.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection.fcos import FCOS
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.retinanet import RetinaNet
from torchvision.models.detection.ssd import SSD
from torchvision.models.detection.transform import GeneralizedRCNNTransform

DETECTORS = (GeneralizedRCNN, RetinaNet, FCOS, SSD)
"""The torchvision detector classes `BatchedDetector` wraps (SSDlite is an `SSD`)."""


def is_detector(model: nn.Module) -> bool:
    """Whether `model` is a torchvision detector that `BatchedDetector` wraps."""
    return isinstance(model, DETECTORS)


def pad_detections(detections: List[Dict[str, Tensor]], limit: int) -> Dict[str, Tensor]:
    """Per-image detections (torchvision's output) as batch-first tensors of `limit` rows each,
    zero-padded, keys `boxes`, `scores`, `labels`, the model's other keys in its order, then
    `count` (int64 [B], the real rows of each image)."""
    keys = ["boxes", "scores", "labels"]
    for key in detections[0].keys():
        if key not in keys:
            keys.append(key)
    out: Dict[str, Tensor] = {}
    for key in keys:
        rows: List[Tensor] = []
        for det in detections:
            value = det[key][:limit]
            padding = value.new_zeros([limit - value.shape[0]] + list(value.shape[1:]))
            rows.append(torch.cat([value, padding], 0))
        out[key] = torch.stack(rows)
    counts = [min(det["boxes"].shape[0], limit) for det in detections]
    out["count"] = torch.tensor(counts, dtype=torch.int64, device=detections[0]["boxes"].device)
    return out


def _image_list(like: Tensor, sizes: Tensor) -> Tuple[ImageList, List[Tuple[int, int]]]:
    """The `ImageList` torchvision's heads read (the padded batch's shape and each image's
    resized size) and the input sizes, from `sizes [B, 3, 2]`. The heads read only the shape of
    `ImageList.tensors`, so it is a zero-stride stand-in rather than the batch itself, which
    would otherwise have to cross every cut."""
    resized: List[Tuple[int, int]] = []
    original: List[Tuple[int, int]] = []
    per_image: List[List[List[int]]] = sizes.tolist()
    for s in per_image:
        original.append((s[0][0], s[0][1]))
        resized.append((s[1][0], s[1][1]))
    padded: List[int] = sizes[0, 2].tolist()
    stand_in = like.new_zeros(1).expand([sizes.shape[0], 1, padded[0], padded[1]])
    return ImageList(stand_in, resized), original


def resize_like_eager(image: Tensor, min_size: int, max_size: int, fixed_size: Optional[Tuple[int, int]]) -> Tensor:
    """torchvision's detection resize (`transform._resize_image_and_masks` in eval mode) as it
    computes in eager mode, also under TorchScript. torchvision's own code computes the scale
    in float32 when scripted, which makes 799 rows where eager makes 800 for 375x500, 333x500
    or 427x640 images; a scripted stage must compute what the eager model does."""
    if fixed_size is not None:
        return F.interpolate(image[None], size=[fixed_size[1], fixed_size[0]], mode="bilinear", align_corners=False)[0]
    h, w = image.shape[-2], image.shape[-1]
    scale = min(float(min_size) / float(min(h, w)), float(max_size) / float(max(h, w)))
    resized = F.interpolate(image[None], scale_factor=scale, mode="bilinear", recompute_scale_factor=True, align_corners=False)
    return resized[0]


class DetectionTransform(nn.Module):
    """The detector's own transform in eval mode (normalise, resize, pad into one batch) on a
    batch `[B, 3, H, W]` of images in [0, 1]. Returns the padded batch and `sizes [B, 3, 2]`
    (int64): per image its input size, its resized size and the padded batch's size, (H, W) each.

    The exporter keeps it whole: torch.fx cannot iterate a traced batch."""

    def __init__(self, transform: GeneralizedRCNNTransform):
        super().__init__()
        self.transform = transform

    def forward(self, images: Tensor) -> Tuple[Tensor, Tensor]:
        t = self.transform
        resized: List[Tensor] = []
        for image in images.unbind(0):
            resized.append(resize_like_eager(t.normalize(image), t.min_size[-1], t.max_size, t.fixed_size))
        padded = t.batch_images(resized, size_divisible=t.size_divisible)
        sizes: List[List[List[int]]] = []
        for image in resized:
            sizes.append(
                [[images.shape[-2], images.shape[-1]], [image.shape[-2], image.shape[-1]], [padded.shape[-2], padded.shape[-1]]]
            )
        return padded, torch.tensor(sizes, dtype=torch.int64, device=images.device)


class RCNNDetect(nn.Module):
    """Faster, Mask and Keypoint R-CNN after the backbone: region proposals, ROI heads, boxes
    (masks, keypoints) back to the input size, padded. Kept whole by the exporter: its forward
    reads `self.training`, and torch.fx cannot trace it either."""

    def __init__(self, model: GeneralizedRCNN):
        super().__init__()
        self.rpn = model.rpn
        self.roi_heads = model.roi_heads
        self.transform = model.transform

    def forward(self, features: Dict[str, Tensor], sizes: Tensor) -> Dict[str, Tensor]:
        if self.training:
            raise RuntimeError("a batched detector runs in eval mode only: in training mode its heads need targets")
        images, original = _image_list(list(features.values())[0], sizes)
        proposals, _ = self.rpn(images, features)
        detections, _ = self.roi_heads(features, proposals, images.image_sizes)
        detections = self.transform.postprocess(detections, images.image_sizes, original)
        return pad_detections(detections, self.roi_heads.detections_per_img)


# The one-stage detectors decode with methods of the model itself (`postprocess_detections`),
# so their `detect` parts are instances of the model's class holding only what decoding reads
# (no backbone, no head): TorchScript compiles the inherited methods they call.
_DECODING_ATTRIBUTES = ("transform", "anchor_generator", "box_coder", "score_thresh", "nms_thresh", "detections_per_img", "topk_candidates")


def _take_decoding_attributes(part: nn.Module, model: nn.Module) -> None:
    # Not the model class's __init__, which would build a whole new model.
    nn.Module.__init__(part)
    for name in _DECODING_ATTRIBUTES:
        setattr(part, name, getattr(model, name))


class RetinaNetDetect(RetinaNet):
    """RetinaNet after its head: anchors, decoding, NMS, boxes back to the input size, padded.
    Kept whole by the exporter: its forward reads `self.training`."""

    def __init__(self, model: RetinaNet):
        _take_decoding_attributes(self, model)

    def forward(self, features: List[Tensor], head_outputs: Dict[str, Tensor], sizes: Tensor) -> Dict[str, Tensor]:
        if self.training:
            raise RuntimeError("a batched detector runs in eval mode only: in training mode its heads need targets")
        images, original = _image_list(features[0], sizes)
        anchors = self.anchor_generator(images, features)
        # As RetinaNet.forward: split the outputs and anchors per feature level.
        num_anchors_per_level = [x.size(2) * x.size(3) for x in features]
        hw = 0
        for v in num_anchors_per_level:
            hw += v
        a = head_outputs["cls_logits"].size(1) // hw
        num_anchors_per_level = [n * a for n in num_anchors_per_level]
        split_head_outputs: Dict[str, List[Tensor]] = {}
        for k in head_outputs:
            split_head_outputs[k] = list(head_outputs[k].split(num_anchors_per_level, dim=1))
        split_anchors = [list(x.split(num_anchors_per_level)) for x in anchors]
        detections = self.postprocess_detections(split_head_outputs, split_anchors, images.image_sizes)
        detections = self.transform.postprocess(detections, images.image_sizes, original)
        return pad_detections(detections, self.detections_per_img)


class FCOSDetect(FCOS):
    """FCOS after its head: anchor points, decoding, NMS, boxes back to the input size, padded.
    Kept whole by the exporter: its forward reads `self.training`."""

    def __init__(self, model: FCOS):
        _take_decoding_attributes(self, model)

    def forward(self, features: List[Tensor], head_outputs: Dict[str, Tensor], sizes: Tensor) -> Dict[str, Tensor]:
        if self.training:
            raise RuntimeError("a batched detector runs in eval mode only: in training mode its heads need targets")
        images, original = _image_list(features[0], sizes)
        anchors = self.anchor_generator(images, features)
        # As FCOS.forward: split the outputs and anchors per feature level.
        num_anchors_per_level = [x.size(2) * x.size(3) for x in features]
        split_head_outputs: Dict[str, List[Tensor]] = {}
        for k in head_outputs:
            split_head_outputs[k] = list(head_outputs[k].split(num_anchors_per_level, dim=1))
        split_anchors = [list(x.split(num_anchors_per_level)) for x in anchors]
        detections = self.postprocess_detections(split_head_outputs, split_anchors, images.image_sizes)
        detections = self.transform.postprocess(detections, images.image_sizes, original)
        return pad_detections(detections, self.detections_per_img)


class SSDDetect(SSD):
    """SSD and SSDlite after their head: default boxes, decoding, NMS, boxes back to the input
    size, padded. Kept whole by the exporter: its forward reads `self.training`."""

    def __init__(self, model: SSD):
        _take_decoding_attributes(self, model)

    def forward(self, features: List[Tensor], head_outputs: Dict[str, Tensor], sizes: Tensor) -> Dict[str, Tensor]:
        if self.training:
            raise RuntimeError("a batched detector runs in eval mode only: in training mode its heads need targets")
        images, original = _image_list(features[0], sizes)
        anchors = self.anchor_generator(images, features)
        detections = self.postprocess_detections(head_outputs, anchors, images.image_sizes)
        detections = self.transform.postprocess(detections, images.image_sizes, original)
        return pad_detections(detections, self.detections_per_img)


_ONE_STAGE = ((RetinaNet, RetinaNetDetect), (FCOS, FCOSDetect), (SSD, SSDDetect))


class BatchedDetector(nn.Module):
    """A torchvision detector taking one batch `[B, 3, H, W]` of images in [0, 1] and returning
    fixed-shape, batch-first, zero-padded detections (see the module doc). It shares the
    wrapped model's modules (and so its weights)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if not is_detector(model):
            raise TypeError(f"{type(model).__name__} is not a torchvision detector ({', '.join(c.__name__ for c in DETECTORS)})")
        self.transform = DetectionTransform(model.transform)
        self.backbone = model.backbone
        self.output_names = ["boxes", "scores", "labels"]
        if isinstance(model, GeneralizedRCNN):
            self.head = None
            self.detect = RCNNDetect(model)
            if model.roi_heads.has_mask():
                self.output_names.append("masks")
            if model.roi_heads.has_keypoint():
                self.output_names += ["keypoints", "keypoints_scores"]
        else:
            self.head = model.head
            self.detect = next(part for cls, part in _ONE_STAGE if isinstance(model, cls))(model)
        self.output_names.append("count")
        # (H, W) of `example_inputs`: the size the model resizes images to (`fixed_size` is (W, H)).
        fixed, side = model.transform.fixed_size, min(model.transform.min_size)
        self.default_size = (int(fixed[1]), int(fixed[0])) if fixed else (int(side), int(side))

    @property
    def detections_per_img(self) -> int:
        """D, the rows of each image's detections: the model's own limit."""
        return getattr(self.detect, "roi_heads", self.detect).detections_per_img

    def forward(self, images: Tensor) -> Dict[str, Tensor]:
        batch, sizes = self.transform(images)
        features = self.backbone(batch)
        if not isinstance(features, dict):  # a backbone without FPN returns one feature map
            features = OrderedDict([("0", features)])
        if self.head is None:
            out = self.detect(features, sizes)
        else:
            levels = list(features.values())
            out = self.detect(levels, self.head(levels), sizes)
        return {key: out[key] for key in self.output_names}

    def example_inputs(self, batch_size: int) -> tuple[Tensor]:
        """Random images in [0, 1] at the size the model works at."""
        return (torch.rand(batch_size, 3, *self.default_size),)
