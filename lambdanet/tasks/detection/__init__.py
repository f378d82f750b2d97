"""Detection and instance segmentation with lambda and halo backbones (LambdaNetworks Table 6, HaloNet
Table 5): Mask R-CNN / Faster R-CNN on an FPN over any registered backbone (:mod:`.model`), an offline
glyph instance-segmentation dataset and COCO folders (:mod:`.data`; the scenes in :mod:`.glyphs` and
:mod:`.glyph_render`), COCO evaluation (:mod:`.evaluate`, needs pycocotools).

``lambdanet detect`` trains on the engine: :mod:`.config` (:class:`~.config.DetectConfig`, its recipes and
schedule), :mod:`.task` (:class:`~.task.DetectionTask`, :func:`~.task.train_detector`), :mod:`.pretrain` (the
backbone's glyph-crop pre-training), :mod:`.draw` (plots and pictures) and :mod:`.study` (the Table 6 study)."""

from lambdanet.tasks.detection.data import (
    CocoInstances,
    GlyphInstances,
    GlyphSceneConfig,
    build_detection_datasets,
    coco_ground_truth,
    collate_detection,
    dataset_to_coco,
    list_detection_datasets,
    size_statistics,
)
from lambdanet.tasks.detection.evaluate import evaluate_detector, evaluate_predictions
from lambdanet.tasks.detection.model import BACKBONE_PRESETS, DetectorOptions, create_detector

__all__ = [
    "create_detector",
    "DetectorOptions",
    "BACKBONE_PRESETS",
    "GlyphInstances",
    "GlyphSceneConfig",
    "CocoInstances",
    "build_detection_datasets",
    "list_detection_datasets",
    "coco_ground_truth",
    "dataset_to_coco",
    "collate_detection",
    "size_statistics",
    "evaluate_detector",
    "evaluate_predictions",
]
