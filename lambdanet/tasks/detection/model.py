"""Mask R-CNN and Faster R-CNN (torchvision) on a feature pyramid over any registered lambdanet backbone.

LambdaNetworks Table 6 compares LambdaResNet and ResNet backbones on COCO detection and instance segmentation
with Mask R-CNN; HaloNet Table 5 does the same with ResNet-50/101 + SE whose last stage's 3x3 convolutions are
halo attention. :func:`create_detector` puts torchvision's detectors on :class:`FeaturePyramidBackbone`:
``create_model(name, features_only=True, num_classes=0)`` (``forward`` returns the c2..c5 maps,
``feature_info`` their channels) under torchvision's ``FeaturePyramidNetwork`` (P2-P5 and a max-pooled P6).

**Input sizes.** torchvision's ``GeneralizedRCNNTransform`` resizes an image so that its short side is
``min_size`` unless its long side would pass ``max_size``, then pads the batch to a multiple of
``size_divisible`` (32, the backbones' largest stride): the feature maps are exact multiples of every stride.
Halo attention pads its maps to whole blocks itself (``HaloAttention`` masks that padding out of the softmax;
the timm-convention layers, ``mask_padding=False``, let it take part as zeros), so block sizes (8, 10, 12, 14
in the HaloNets; 8 or 32 in :data:`BACKBONE_PRESETS`) need no other padding. Local lambda layers (``r`` set)
take any size. Global-context layers (a lambda layer with ``r=None``, BoTNet's and other relative
self-attention, axial attention) size their relative tables by ``img_size`` and serve every input up to it:
unless ``img_size`` is given, :func:`create_detector` builds backbones that take it with the largest padded
input, ``ceil(max_size / size_divisible) * size_divisible`` (:func:`detector_input_size`). Absolute position
embeddings (``position_embedding="absolute"``) need inputs of exactly ``img_size``, which detection does not
have: use relative embeddings.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, cast

import torch
from torch import Tensor, nn

from lambdanet.constants import IMAGENET_MEAN, IMAGENET_STD
from lambdanet.helpers import is_finite_real
from lambdanet.models import create_model, list_models, model_args

__all__ = [
    "DetectorOptions",
    "detector_options",
    "BackbonePreset",
    "BACKBONE_PRESETS",
    "FeaturePyramidBackbone",
    "create_detector",
    "create_feature_backbone",
    "detector_input_size",
    "halo_hybrid_kwargs",
    "resolve_backbone",
    "input_normalization",
    "STUDY_BACKBONES",
]

FEATURE_NAMES = ("0", "1", "2", "3")  # the FPN levels P2..P5 the RoI heads pool from (P6 is "pool")


@dataclass(frozen=True)
class DetectorOptions:
    """The detector around the backbone; the defaults are torchvision's Mask R-CNN (FPN) settings.

    Attributes:
        fpn_channels: channels of every pyramid level.
        anchor_sizes: one anchor size per level P2..P6 (COCO at 800 px: 32..512; images of ~256 px want
            smaller ones, e.g. ``(16, 32, 64, 128, 256)``).
        aspect_ratios: anchor aspect ratios (height / width) at every level.
        representation_size: width of the box head's two fully connected layers.
        mask_head_channels: width of the mask head's four 3x3 convolutions.
        mask_roi_size: side of the RoI features the mask head reads (torchvision: 14); its masks are twice as
            fine (28 x 28 by default, 56 x 56 at 28): thin strokes such as handwritten digits need the finer one.
        size_divisible: batches are padded to a multiple of this (must be a multiple of the backbone's
            largest stride, 32).
        rpn_pre_nms_top_n, rpn_post_nms_top_n: (training, inference) proposals the RPN keeps per level
            before its non-maximum suppression and per image after it (torchvision: 2000 / 1000 each; scenes
            with a few objects need far fewer, and the RoI heads' cost is proportional to them).
        rpn_batch_size_per_image, box_batch_size_per_image: anchors / proposals sampled per image for the
            RPN and box-head losses.
        box_score_thresh: detections scoring less are dropped at inference.
        box_detections_per_img: detections kept per image.
        frozen_bn: keep the backbone's BatchNorm statistics and affine parameters fixed (as torchvision
            does with pretrained backbones and small per-device batches); ``None``: frozen exactly when the
            backbone is pretrained.
        channels_last: run the backbone body in the channels-last memory format (oneDNN's and cuDNN's
            faster convolution layout; the pyramid and the heads see ordinary contiguous maps).
    """

    fpn_channels: int = 256
    anchor_sizes: tuple[int, ...] = (32, 64, 128, 256, 512)
    aspect_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    representation_size: int = 1024
    mask_head_channels: int = 256
    mask_roi_size: int = 14
    size_divisible: int = 32
    rpn_pre_nms_top_n: tuple[int, int] = (2000, 1000)
    rpn_post_nms_top_n: tuple[int, int] = (2000, 1000)
    rpn_batch_size_per_image: int = 256
    box_batch_size_per_image: int = 512
    box_score_thresh: float = 0.05
    box_detections_per_img: int = 100
    frozen_bn: bool | None = None
    channels_last: bool = False

    def __post_init__(self):
        for name in (
            "fpn_channels",
            "representation_size",
            "mask_head_channels",
            "mask_roi_size",
            "size_divisible",
            "rpn_batch_size_per_image",
            "box_batch_size_per_image",
            "box_detections_per_img",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DetectorOptions.{name} must be a positive int, got {value!r}")
        for name in ("rpn_pre_nms_top_n", "rpn_post_nms_top_n"):
            value = getattr(self, name)
            if (
                not isinstance(value, (list, tuple))
                or len(value) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value)
            ):
                raise ValueError(
                    f"DetectorOptions.{name} must be two positive ints (training, inference), got {value!r}"
                )
        if (
            not isinstance(self.anchor_sizes, (list, tuple))
            or len(self.anchor_sizes) != len(FEATURE_NAMES) + 1
            or not all(is_finite_real(s) and s > 0 for s in self.anchor_sizes)
        ):
            raise ValueError(
                f"DetectorOptions.anchor_sizes must be {len(FEATURE_NAMES) + 1} positive sizes, one "
                f"per level P2..P6, got {self.anchor_sizes!r}"
            )
        if (
            not isinstance(self.aspect_ratios, (list, tuple))
            or not self.aspect_ratios
            or not all(is_finite_real(r) and r > 0 for r in self.aspect_ratios)
        ):
            raise ValueError(f"DetectorOptions.aspect_ratios must be positive ratios, got {self.aspect_ratios!r}")
        if not is_finite_real(self.box_score_thresh) or not 0.0 <= self.box_score_thresh <= 1.0:
            raise ValueError(f"DetectorOptions.box_score_thresh must be in [0, 1], got {self.box_score_thresh!r}")
        for name in ("frozen_bn", "channels_last"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "frozen_bn")):
                raise ValueError(f"DetectorOptions.{name} must be true or false, got {value!r}")


def detector_options(overrides: dict) -> DetectorOptions:
    """:class:`DetectorOptions` with ``overrides`` (``lambdanet detect --detector``: lists as tuples); a one-line
    ``ValueError`` naming the keys it does not take, or the value out of range."""
    valid = [f.name for f in fields(DetectorOptions)]
    if unknown := sorted(set(overrides) - set(valid)):
        raise ValueError(f"detector does not take {unknown}; valid keys: {', '.join(valid)}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return DetectorOptions(**values)


@dataclass(frozen=True)
class BackbonePreset:
    """A named backbone: a registered model and the ``create_model`` options that make it."""

    model: str
    kwargs: Mapping[str, object] = field(default_factory=dict)
    paper: str = ""


def halo_hybrid_kwargs(block_size: int, halo_size: int = 3, heads: int = 8) -> dict:
    """``create_model`` options of a ResNet + SE whose c5 3x3 convolutions are halo attention (HaloNet
    Table 5): squeeze-and-excitation (ratio 1/16) in the convolution blocks, ``stage_layers="CCCL"`` with
    ``spatial_layer="halo_attention"``; 8 heads as in HaloNet's c5 (Table A2 caption); the strided first
    c5 block subsamples its queries (HaloNet Fig. 2), so ``block_size`` must be even."""
    return {
        "se": True,
        "stage_layers": "CCCL",
        "spatial_layer": "halo_attention",
        "layer_kwargs": {"block_size": block_size, "halo_size": halo_size, "heads": heads},
    }


# HaloNet Table 5's backbones: ResNet-50/101 + SE (ratio 1/16, Hu et al. 2018) and its hybrids with halo attention
# in c5 (b = 8 or 32, h = 3); at 26 layers, the halo side of the study (STUDY_BACKBONES). LambdaNetworks Table 6
# compares registered models directly (resnet101 / lambda_resnet101, resnet152 / lambda_resnet152).
BACKBONE_PRESETS: dict[str, BackbonePreset] = {
    f"resnet{depth}_se{suffix}": BackbonePreset(f"resnet{depth}", kwargs, f"{source}: ResNet-{depth} + SE{note}")
    for depth, source in (
        (26, "HaloNet Table 5's recipe at 26 layers"),
        (50, "HaloNet Table 5"),
        (101, "HaloNet Table 5"),
    )
    for suffix, kwargs, note in (
        ("", {"se": True}, " (baseline)"),
        ("_halo_b8", halo_hybrid_kwargs(8), ", c5 3x3 convolutions replaced by halo attention (b=8, h=3)"),
        ("_halo_b32", halo_hybrid_kwargs(32), ", c5 3x3 convolutions replaced by halo attention (b=32, h=3)"),
    )
}

# The side-by-side study (docs/detection.md, in Table 6's layout): a ResNet, its +SE twin, its lambda hybrid
# (lambda layers in c4 and c5, LambdaNetworks Table 13's C-C-L-L) and its halo hybrid (HaloNet Table 5), all
# with [2, 2, 2, 2] blocks so that a 2-core CPU trains each in minutes.
STUDY_BACKBONES: dict[str, str] = {
    "resnet26": "ResNet-26",
    "resnet26_se": "ResNet-26 + SE",
    "lambda_resnet26": "LambdaResNet-26 (lambda layers in c4, c5)",
    "resnet26_se_halo_b8": "ResNet-26 + SE, halo attention in c5 (b=8, h=3)",
}


def input_normalization(model: nn.Module) -> tuple[list[float], list[float]]:
    """(mean, std) per RGB channel that ``model``'s inputs are normalised with: its ``pretrained_cfg``'s, else
    ImageNet's (torchvision's detection default)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return list(cfg.get("mean", IMAGENET_MEAN)), list(cfg.get("std", IMAGENET_STD))


def detector_input_size(max_size: int, size_divisible: int) -> int:
    """The largest (padded) side a detector's backbone sees: ``max_size`` rounded up to ``size_divisible``.
    Global-context layers are sized by it (module docstring)."""
    return math.ceil(max_size / size_divisible) * size_divisible


def resolve_backbone(backbone: str, backbone_kwargs: Mapping) -> tuple[str, dict]:
    """(registered model, ``create_model`` options) of a registered name or a :data:`BACKBONE_PRESETS` name
    (``backbone_kwargs`` override the preset's options)."""
    if backbone in BACKBONE_PRESETS:
        preset = BACKBONE_PRESETS[backbone]
        return preset.model, {**preset.kwargs, **backbone_kwargs}
    if backbone not in list_models(task="image"):
        raise ValueError(
            f"backbone must be a registered model or one of BACKBONE_PRESETS "
            f"{sorted(BACKBONE_PRESETS)}, got {backbone!r}"
        )
    return backbone, dict(backbone_kwargs)


def create_feature_backbone(
    backbone: str, *, max_size: int, size_divisible: int = 32, pretrained: bool = False, **backbone_kwargs
) -> tuple[nn.Module, str, dict]:
    """The feature extractor of :func:`create_detector`: ``create_model(name, features_only=True,
    num_classes=0, ...)`` with ``img_size`` defaulting to :func:`detector_input_size` where the model takes
    it. Returns (module, registered name, the options it was built with)."""
    name, kwargs = resolve_backbone(backbone, backbone_kwargs)
    accepted = model_args(name)
    if "features_only" not in accepted:
        raise ValueError(
            f"backbone {name!r} has no features_only option: a detector backbone must be a registered "
            "model that takes features_only=True and then returns its c2..c5 feature maps "
            "(and lists their channels in feature_info)"
        )
    if "img_size" in accepted and kwargs.get("img_size") is None:
        kwargs["img_size"] = detector_input_size(max_size, size_divisible)
    body = create_model(name, num_classes=0, features_only=True, pretrained=pretrained, **kwargs)
    info = getattr(body, "feature_info", None)
    if not isinstance(info, list) or len(info) != len(FEATURE_NAMES) or any("num_chs" not in i for i in info):
        raise ValueError(
            f"backbone {name!r} must list its {len(FEATURE_NAMES)} feature maps c2..c5 in feature_info "
            f"(dicts with 'num_chs' and 'reduction'), got {info!r}"
        )
    largest = max(i.get("reduction", 32) for i in info)
    if size_divisible % largest:
        raise ValueError(
            f"size_divisible must be a multiple of backbone {name!r}'s largest stride {largest}, got {size_divisible}"
        )
    return body, name, kwargs


class FeaturePyramidBackbone(nn.Module):
    """A ``features_only`` backbone under torchvision's ``FeaturePyramidNetwork``: ``forward`` maps images
    ``[B, 3, H, W]`` to ``{"0": P2, "1": P3, "2": P4, "3": P5, "pool": P6}``, each ``out_channels`` wide (the
    attribute torchvision's detectors read).

    Args:
        body: returns the list of c2..c5 maps; ``body.feature_info[i]["num_chs"]`` are their channels.
        out_channels: channels of the pyramid.
        frozen_bn: keep the body's BatchNorm layers in eval mode and their parameters fixed.
        channels_last: hold the body's weights and run it in the channels-last memory format; its maps are
            made contiguous again for the pyramid.
    """

    def __init__(
        self, body: nn.Module, out_channels: int = 256, *, frozen_bn: bool = False, channels_last: bool = False
    ):
        from torchvision.ops import FeaturePyramidNetwork
        from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(
            [i["num_chs"] for i in cast("list[dict]", body.feature_info)], out_channels, extra_blocks=LastLevelMaxPool()
        )
        self.out_channels, self.frozen_bn, self.channels_last = out_channels, frozen_bn, channels_last
        if channels_last:
            body.to(memory_format=torch.channels_last)
        if frozen_bn:
            for m in self.batch_norms():
                m.requires_grad_(False)

    def batch_norms(self) -> list[nn.Module]:
        # every kind: BatchNorm2d, torch's SyncBatchNorm, and the CPU process group's AllReduceBatchNorm
        return [m for m in self.body.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def train(self, mode: bool = True) -> FeaturePyramidBackbone:
        super().train(mode)
        if self.frozen_bn:
            for m in self.batch_norms():
                m.eval()
        return self

    def forward(self, x: Tensor) -> OrderedDict[str, Tensor]:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)  # B 3 H W, stored B H W 3
            feats = [f.contiguous() for f in self.body(x)]
        else:
            feats = self.body(x)  # [c2 (B, C2, H/4, W/4), ..., c5 (B, C5, H/32, W/32)]
        return self.fpn(OrderedDict(zip(FEATURE_NAMES, feats)))  # "0".."3", "pool": (B, out_channels, h, w)


def _rcnn_kwargs(opts: DetectorOptions, norm: tuple, min_size: int, max_size: int, num_classes: int) -> dict:
    """The keywords torchvision's ``FasterRCNN`` / ``MaskRCNN`` take from :class:`DetectorOptions`: the
    transform (``norm``: the backbone's mean and std), the anchors and RPN, the box branch."""
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.rpn import RPNHead
    from torchvision.ops import MultiScaleRoIAlign

    levels = len(opts.anchor_sizes)
    anchors = AnchorGenerator(tuple((s,) for s in opts.anchor_sizes), (tuple(opts.aspect_ratios),) * levels)
    c = opts.fpn_channels
    mean, std = norm
    return {
        "min_size": min_size,
        "max_size": max_size,
        "image_mean": mean,
        "image_std": std,
        "size_divisible": opts.size_divisible,
        "rpn_batch_size_per_image": opts.rpn_batch_size_per_image,
        "rpn_anchor_generator": anchors,
        "rpn_head": RPNHead(c, anchors.num_anchors_per_location()[0]),
        "rpn_pre_nms_top_n_train": opts.rpn_pre_nms_top_n[0],
        "rpn_pre_nms_top_n_test": opts.rpn_pre_nms_top_n[1],
        "rpn_post_nms_top_n_train": opts.rpn_post_nms_top_n[0],
        "rpn_post_nms_top_n_test": opts.rpn_post_nms_top_n[1],
        "box_roi_pool": MultiScaleRoIAlign(list(FEATURE_NAMES), output_size=7, sampling_ratio=2),
        "box_head": TwoMLPHead(c * 7 * 7, opts.representation_size),
        "box_predictor": FastRCNNPredictor(opts.representation_size, num_classes + 1),
        "box_batch_size_per_image": opts.box_batch_size_per_image,
        "box_score_thresh": opts.box_score_thresh,
        "box_detections_per_img": opts.box_detections_per_img,
    }


def create_detector(
    backbone: str,
    num_classes: int,
    *,
    masks: bool = True,
    min_size: int = 800,
    max_size: int = 1333,
    pretrained_backbone: bool = False,
    options: DetectorOptions | None = None,
    **backbone_kwargs,
) -> nn.Module:
    """torchvision's Mask R-CNN (``masks=True``) or Faster R-CNN on an FPN over a lambdanet backbone.

    Args:
        backbone: a registered model that takes ``features_only`` (``resnet50``, ``lambda_resnet26``,
            ``lambda_resnet50``, ``resnet_rs50_se``, ``halonet_h0``, ``lambda_resnet26t``, ``halonet26t``, ...)
            or a :data:`BACKBONE_PRESETS` name (HaloNet Table 5's hybrids).
        num_classes: object categories, the background excluded (the heads predict ``num_classes + 1``
            classes, 0 the background: labels are 1-based as in torchvision).
        masks: add the mask branch (Mask R-CNN); ``False`` gives Faster R-CNN.
        min_size, max_size: the resizing of ``GeneralizedRCNNTransform`` (module docstring).
        pretrained_backbone: load the backbone's published ImageNet weights (``create_model(pretrained=True)``).
        options: the detector's other settings (:class:`DetectorOptions`).
        **backbone_kwargs: ``create_model`` options of the backbone (``stage_layers="CCLL"``,
            ``base_width=8``, ``img_size``, ...), over a preset's.

    Images are float ``[3, H, W]`` in [0, 1], any size; the transform normalises them with the backbone's
    ``pretrained_cfg`` mean and standard deviation. The model carries ``detector_cfg`` (what it was built
    from) and the backbone's registered name in it.
    """
    from torchvision.models.detection import FasterRCNN, MaskRCNN
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    for arg, value, note in (
        ("num_classes", num_classes, " (object categories, background excluded)"),
        ("min_size", min_size, ""),
        ("max_size", max_size, ""),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{arg} must be a positive int{note}, got {value!r}")
    opts = options if options is not None else DetectorOptions()
    body, name, kwargs = create_feature_backbone(
        backbone,
        max_size=max_size,
        size_divisible=opts.size_divisible,
        pretrained=pretrained_backbone,
        **backbone_kwargs,
    )
    frozen = pretrained_backbone if opts.frozen_bn is None else opts.frozen_bn
    features = FeaturePyramidBackbone(body, opts.fpn_channels, frozen_bn=frozen, channels_last=opts.channels_last)
    c = opts.fpn_channels
    common = _rcnn_kwargs(opts, input_normalization(body), min_size, max_size, num_classes)
    if masks:
        m = opts.mask_head_channels
        model = MaskRCNN(
            features,
            num_classes=None,
            **common,
            mask_roi_pool=MultiScaleRoIAlign(list(FEATURE_NAMES), output_size=opts.mask_roi_size, sampling_ratio=2),
            mask_head=MaskRCNNHeads(c, (m,) * 4, 1),
            mask_predictor=MaskRCNNPredictor(m, m, num_classes + 1),
        )
    else:
        model = FasterRCNN(features, num_classes=None, **common)
    model.detector_cfg = {
        "backbone": backbone,
        "model": name,
        "backbone_kwargs": kwargs,
        "num_classes": num_classes,
        "masks": masks,
        "min_size": min_size,
        "max_size": max_size,
        "pretrained_backbone": pretrained_backbone,
        "options": asdict(opts),
    }
    return model
