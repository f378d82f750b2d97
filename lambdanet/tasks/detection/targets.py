"""Targets in torchvision's detection format, shared by every detection dataset (see
:mod:`lambdanet.tasks.detection.data`): boxes from masks, COCO's size classes, batching."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import cast

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "SIZE_CLASSES",
    "SMALL_AREA",
    "LARGE_AREA",
    "SPLITS",
    "size_class",
    "mask_boxes",
    "instance_target",
    "empty_target",
    "collate_detection",
    "size_statistics",
]

# COCO's size classes by mask area (pycocotools COCOeval areaRng): small < 32^2 <= medium <= 96^2 < large
SMALL_AREA, LARGE_AREA = 32**2, 96**2
SIZE_CLASSES = ("small", "medium", "large")
SPLITS = ("train", "test")


def size_class(area: float) -> str:
    """COCO's size class of a mask area: ``"small"`` (< 32^2), ``"medium"`` or ``"large"`` (> 96^2)."""
    return "small" if area < SMALL_AREA else "large" if area > LARGE_AREA else "medium"


def mask_boxes(masks: Tensor) -> Tensor:
    """The xyxy boxes ``[N, 4]`` (float32) of binary masks ``[N, H, W]``, on pixel edges: the extent of a
    mask spanning columns ``x0..x1`` is ``x0 .. x1 + 1`` (as pycocotools' ``toBbox``); all zeros for an
    empty mask."""
    if masks.shape[0] == 0:
        return torch.zeros(0, 4)
    m = masks.bool()
    rows, cols = m.any(dim=2), m.any(dim=1)  # n h, n w
    h, w = masks.shape[1:]
    ar_h, ar_w = torch.arange(h), torch.arange(w)
    big = max(h, w) + 1
    y0 = torch.where(rows, ar_h, big).amin(dim=1)  # n
    y1 = torch.where(rows, ar_h, -1).amax(dim=1) + 1  # n
    x0 = torch.where(cols, ar_w, big).amin(dim=1)  # n
    x1 = torch.where(cols, ar_w, -1).amax(dim=1) + 1  # n
    boxes = torch.stack([x0, y0, x1, y1], dim=1).float()  # n 4
    return torch.where(rows.any(dim=1, keepdim=True), boxes, torch.zeros_like(boxes))


def instance_target(masks: Tensor, labels: Tensor, image_id: int) -> dict:
    """The torchvision detection target of instance masks ``[N, H, W]`` and their 1-based labels ``[N]``:
    boxes from the masks (:func:`mask_boxes`), area = mask pixels, ``iscrowd`` = 0."""
    masks = masks.to(torch.uint8)
    return {
        "boxes": mask_boxes(masks),
        "labels": labels.long(),
        "masks": masks,
        "image_id": int(image_id),
        "area": masks.flatten(1).sum(dim=1).float() if len(masks) else torch.zeros(0),
        "iscrowd": torch.zeros(len(labels), dtype=torch.int64),
    }


def empty_target(height: int, width: int, image_id: int) -> dict:
    """The target of an image without objects."""
    return instance_target(
        torch.zeros(0, height, width, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64), image_id
    )


def collate_detection(batch: Sequence[tuple[Tensor, dict]]) -> tuple[list[Tensor], list[dict]]:
    """``DataLoader`` collate for detection: images and targets stay lists (their sizes differ)."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def size_statistics(dataset: Dataset) -> dict[str, int]:
    """Objects of ``dataset`` per COCO size class (``{"images", "objects", "small", "medium", "large"}``)."""
    counts = dict.fromkeys(("images", "objects", *SIZE_CLASSES), 0)
    for i in range(len(cast(Sized, dataset))):
        counts["images"] += 1
        for area in dataset[i][1]["area"].tolist():
            counts["objects"] += 1
            counts[size_class(area)] += 1
    return counts
