"""COCO evaluation of detectors (pycocotools ``COCOeval``): the box and mask AP of LambdaNetworks Table 6 and
HaloNet Table 5.

:func:`evaluate_detector` runs a detector over a dataset of :mod:`lambdanet.tasks.detection.data` and scores it;
:func:`evaluate_predictions` scores given predictions (torchvision's output format plus ``image_id``)
against a COCO ground truth. Both return fractions in [0, 1] under ``bbox_AP``, ``bbox_AP50``,
``bbox_AP75``, ``bbox_AP_small``, ``bbox_AP_medium``, ``bbox_AP_large`` and the same with ``segm_``; a size
class without ground truth in the evaluated images is ``nan`` (COCOeval's -1).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lambdanet.engine.loop import progress_bar
from lambdanet.tasks.detection.coco import coco_ground_truth, encode_masks
from lambdanet.tasks.detection.targets import collate_detection

__all__ = ["evaluate_detector", "evaluate_predictions", "predictions_to_coco", "METRICS", "IOU_TYPES"]

# COCOeval.stats[0:6] in order
METRICS = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")
IOU_TYPES = ("bbox", "segm")
MASK_THRESHOLD = 0.5  # Mask R-CNN's mask probabilities are binarised here (torchvision's reference evaluation)


def predictions_to_coco(predictions: Sequence[dict], iou_type: str) -> list[dict]:
    """COCO result entries of predictions (dicts with ``image_id``, ``boxes`` ``[N, 4]`` xyxy, ``scores``
    ``[N]``, ``labels`` ``[N]`` and, for ``"segm"``, ``masks`` ``[N, 1, H, W]`` probabilities or ``[N, H, W]``
    binary): ``bbox`` entries carry xywh boxes, ``segm`` entries RLE masks (binarised at 0.5)."""
    if iou_type not in IOU_TYPES:
        raise ValueError(f"iou_type must be one of {list(IOU_TYPES)}, got {iou_type!r}")
    results = []
    for pred in predictions:
        image_id = int(pred["image_id"])
        scores, labels = pred["scores"].tolist(), pred["labels"].tolist()
        if iou_type == "bbox":
            for (x0, y0, x1, y1), score, label in zip(pred["boxes"].tolist(), scores, labels):
                results.append(
                    {
                        "image_id": image_id,
                        "category_id": int(label),
                        "bbox": [x0, y0, x1 - x0, y1 - y0],
                        "score": float(score),
                    }
                )
            continue
        if "masks" not in pred:
            raise ValueError(f"segm evaluation needs masks in every prediction; image {image_id} has none")
        masks = pred["masks"][:, 0] if pred["masks"].dim() == 4 else pred["masks"]  # n H W
        binary = masks >= MASK_THRESHOLD if masks.is_floating_point() else masks.bool()  # n H W
        for rle, score, label in zip(encode_masks(binary), scores, labels):
            results.append(
                {"image_id": image_id, "category_id": int(label), "segmentation": rle, "score": float(score)}
            )
    return results


def coco_api(data: dict):
    """A pycocotools ``COCO`` over an in-memory dict (its index messages silenced)."""
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def evaluate_predictions(
    ground_truth: dict, predictions: Sequence[dict], iou_types: Sequence[str] = IOU_TYPES
) -> dict[str, float]:
    """COCO AP of ``predictions`` against ``ground_truth`` (a COCO-format dict, e.g.
    :func:`lambdanet.tasks.detection.data.coco_ground_truth`), over the images that have a prediction entry
    (an image without detections needs an entry with empty tensors)."""
    from pycocotools.cocoeval import COCOeval

    gt = coco_api(ground_truth)
    image_ids = sorted({int(p["image_id"]) for p in predictions})
    if unknown := sorted(set(image_ids) - set(gt.getImgIds())):
        raise ValueError(f"predictions refer to image ids {unknown[:5]} that are not in the ground truth")
    metrics: dict[str, float] = {}
    for iou_type in iou_types:
        results = predictions_to_coco(predictions, iou_type)
        with contextlib.redirect_stdout(io.StringIO()):
            if results:
                dt = gt.loadRes(results)
            else:  # pycocotools cannot load an empty result list: an empty result set scores 0
                dt = coco_api(
                    {"images": ground_truth["images"], "categories": ground_truth["categories"], "annotations": []}
                )
            evaluator = COCOeval(gt, dt, iouType=iou_type)
            evaluator.params.imgIds = image_ids
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        for name, value in zip(METRICS, evaluator.stats[: len(METRICS)]):
            metrics[f"{iou_type}_{name}"] = float(value) if value >= 0 else math.nan
    return metrics


@torch.inference_mode()
def evaluate_detector(
    model: nn.Module,
    dataset: Dataset,
    *,
    batch_size: int = 2,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """COCO box (and, for a model with a mask head, mask) AP of ``model`` on ``dataset``.

    Args:
        model: a torchvision detector (:func:`lambdanet.tasks.detection.model.create_detector`); run in eval mode
            and left in the mode it had.
        dataset: returns ``(image, target)`` pairs (:mod:`lambdanet.tasks.detection.data`); only the targets'
            ``image_id`` is read, the ground truth comes from :func:`coco_ground_truth`.
        batch_size: images per forward pass.
        device: where to run (default: the model's).
        progress: a progress bar on stderr when it is a terminal (:func:`lambdanet.engine.loop.progress_bar`).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training, predictions = model.training, []
    model.eval()
    # a generator of its own: an evaluation between epochs must not draw from the training's random numbers
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_detection,
                        generator=torch.Generator())  # fmt: skip
    bar = progress_bar(progress, len(loader), desc="evaluate")
    try:
        for images, targets in loader:
            outputs = model([image.to(device) for image in images])
            for target, output in zip(targets, outputs):
                predictions.append(
                    {
                        "image_id": int(target["image_id"]),
                        **{k: v.cpu() for k, v in output.items() if isinstance(v, Tensor)},
                    }
                )
            if bar is not None:
                bar.update()
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    roi_heads = getattr(model, "roi_heads", None)
    has_mask = bool(roi_heads is not None and roi_heads.has_mask())
    return evaluate_predictions(coco_ground_truth(dataset), predictions, IOU_TYPES if has_mask else ("bbox",))
