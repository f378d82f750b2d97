"""What a classifier is measured by: top-k counts, :func:`evaluate` over a loader (summed over ranks) and the
panels of a classification run's plots."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lambdanet.engine.distributed import DistContext, all_reduce_sum
from lambdanet.engine.loop import to_device
from lambdanet.runtime import autocast_context

__all__ = ["topk_correct", "evaluate", "CLASSIFICATION_PANELS"]

# the classification run's plots: (file, metrics, y label) (lambdanet.engine.logger.plot_history)
CLASSIFICATION_PANELS = (
    ("loss.png", ("train_loss", "val_loss", "test_loss"), "cross-entropy"),
    ("accuracy.png", ("train_top1", "val_top1", "test_top1", "test_top1_ema"), "top-1"),
)


def topk_correct(logits: Tensor, target: Tensor, ks=(1, 5)) -> list[int]:
    """Number of samples whose target is among the top-k predictions, for each k (k capped at #classes)."""
    maxk = min(max(ks), logits.shape[1])
    pred = logits.topk(maxk, dim=1).indices  # b maxk
    hit = pred.eq(target[:, None])
    return [int(hit[:, : min(k, maxk)].any(dim=1).sum()) for k in ks]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    *,
    device: torch.device,
    ctx: DistContext | None = None,
    amp: str = "none",
    channels_last: bool = False,
    loss_fn: nn.Module | None = None,
) -> dict:
    """Top-1 / top-5 accuracy (fractions) and mean cross-entropy over ``loader`` (summed over ranks)."""
    ctx = ctx or DistContext()
    model.eval()
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    c1: float  # counts: ints, floats after the reduction
    c5: float
    n: float
    loss_sum, c1, c5, n = 0.0, 0, 0, 0
    for x, y in loader:
        x, y = to_device(x, device, channels_last), y.to(device, non_blocking=True)
        with autocast_context(device, amp):
            logits = model(x).float()
        loss_sum += float(loss_fn(logits, y)) * y.shape[0]
        k1, k5 = topk_correct(logits, y)
        c1, c5, n = c1 + k1, c5 + k5, n + y.shape[0]
    loss_sum, c1, c5, n = all_reduce_sum([loss_sum, c1, c5, n], ctx)
    return {"loss": loss_sum / max(n, 1), "top1": c1 / max(n, 1), "top5": c5 / max(n, 1), "samples": int(n)}
