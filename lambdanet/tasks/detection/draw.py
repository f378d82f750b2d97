"""The pictures of a ``lambdanet detect`` run: its per-epoch plots (:func:`plot_detection_history`) and a
detector's boxes and masks drawn on test images (:func:`draw_predictions`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lambdanet.engine.logger import plot_history
from lambdanet.tasks.detection.config import DetectConfig, set_eval_size

__all__ = ["plot_detection_history", "draw_predictions"]


def plot_detection_history(history: list[dict], out: Path) -> list[Path]:
    """``loss.png`` (training losses) and ``ap.png`` (box / mask AP) per epoch."""
    losses = tuple(sorted({k for r in history for k in r if k.startswith("train_loss")}))
    aps = tuple(k for k in ("bbox_AP", "bbox_AP50", "segm_AP", "segm_AP50") if any(k in r for r in history))
    return plot_history(history, out, (("loss.png", losses, "loss"), ("ap.png", aps, "COCO AP")))


def _category(dataset, label: int) -> str:
    """The name of 1-based ``label`` (the dataset's ``categories``), else the number."""
    names = getattr(dataset, "categories", None)
    return str(names[label - 1]) if names and 0 < label <= len(names) else str(label)


def draw_predictions(
    model: nn.Module, dataset, path: Path, cfg: DetectConfig, device, count: int = 4, score: float = 0.5
) -> Path:
    """Boxes (labelled with category names and scores) and masks of the detections above ``score`` on the
    first ``count`` test images, side by side, saved as one PNG."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks, make_grid, save_image

    model.eval()
    set_eval_size(model, cfg)
    tiles = []
    with torch.no_grad():
        for i in range(min(count, len(dataset))):
            image, _ = dataset[i]
            pred = model([image.to(device)])[0]
            keep = pred["scores"] >= score
            canvas = (image.clamp(0, 1) * 255).to(torch.uint8).cpu()
            if "masks" in pred and keep.any():
                canvas = draw_segmentation_masks(canvas, pred["masks"][keep, 0].cpu() > 0.5, alpha=0.4)
            labels = [
                f"{_category(dataset, int(c))} {s:.2f}" for c, s in zip(pred["labels"][keep], pred["scores"][keep])
            ]
            if keep.any():  # torchvision warns on an image without boxes
                canvas = draw_bounding_boxes(canvas, pred["boxes"][keep].cpu(), labels=labels, colors="yellow")
            tiles.append(canvas.float() / 255)
    size = max(t.shape[-1] for t in tiles), max(t.shape[-2] for t in tiles)
    tiles = [nn.functional.pad(t, (0, size[0] - t.shape[-1], 0, size[1] - t.shape[-2])) for t in tiles]
    save_image(make_grid(tiles, nrow=len(tiles), padding=2), path)
    return path
