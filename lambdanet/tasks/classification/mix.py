"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) for classification training, with timm's conventions
(``timm.data.Mixup`` in its default ``"batch"`` mode):

* one mixing weight ``lam`` per batch, drawn from ``Beta(alpha, alpha)``; with both enabled, CutMix is chosen
  with probability :data:`SWITCH_PROB` (timm's default), else Mixup;
* each image is mixed with the batch in reverse order (image ``i`` with image ``B - 1 - i``);
* Mixup: ``lam * x + (1 - lam) * x.flip(0)``; CutMix: a box of ``(1 - lam)`` of the image area (sides
  ``sqrt(1 - lam)`` times the image's, rounded down, centred at a uniform position, clipped at the borders) is
  pasted from the flipped batch, and ``lam`` is corrected to the area actually kept;
* targets ``lam * y + (1 - lam) * y.flip(0)`` of label-smoothed one-hot vectors (``smoothing / classes`` off,
  ``1 - smoothing + smoothing / classes`` on), trained with the soft-target cross-entropy.

The draws come from a generator seeded by (run seed, process, epoch, batch): a resumed run mixes its batches as
the uninterrupted one did, and a run without mixing draws nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SWITCH_PROB", "BatchMix", "MixDraw", "cutmix_box", "mix_targets", "soft_target_cross_entropy"]

SWITCH_PROB = 0.5  # chance of CutMix over Mixup when both are enabled (timm's default switch_prob)


@dataclass(frozen=True)
class MixDraw:
    """One batch's draw: the weight of the original images and, for CutMix, the pasted box ``(y0, y1, x0, x1)``
    (rows ``y0:y1``, columns ``x0:x1``) with ``lam`` the kept area's fraction."""

    lam: float
    box: tuple[int, int, int, int] | None = None


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> MixDraw:
    """A box of about ``(1 - lam)`` of a ``height x width`` image at a uniform centre, clipped to the image;
    the returned ``lam`` is ``1 - box area / image area``."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    y0, y1 = max(cy - cut_h // 2, 0), min(cy + (cut_h + 1) // 2, height)  # cut_h rows unless clipped
    x0, x1 = max(cx - cut_w // 2, 0), min(cx + (cut_w + 1) // 2, width)
    return MixDraw(1.0 - (y1 - y0) * (x1 - x0) / (height * width), (y0, y1, x0, x1))


def mix_targets(y: Tensor, num_classes: int, lam: float, smoothing: float = 0.0) -> Tensor:
    """``lam`` times the label-smoothed one-hot targets of ``y`` plus ``1 - lam`` times those of ``y.flip(0)``."""
    off = smoothing / num_classes
    one_hot = F.one_hot(y, num_classes).float() * (1.0 - smoothing) + off  # b classes
    return one_hot * lam + one_hot.flip(0) * (1.0 - lam)


def soft_target_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean over the batch of ``-sum_c targets[c] * log_softmax(logits)[c]``."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


class BatchMix:
    """Mixup and/or CutMix of training batches (module docstring); ``mixup`` / ``cutmix`` are the Beta
    concentrations (0: that one off)."""

    def __init__(self, mixup: float, cutmix: float, *, num_classes: int, smoothing: float, seed: int, rank: int = 0):
        self.mixup, self.cutmix, self.num_classes, self.smoothing = mixup, cutmix, num_classes, smoothing
        self.seed, self.rank = seed, rank

    def draw(self, epoch: int, batch: int, height: int, width: int) -> MixDraw:
        """The draw of batch ``batch`` of epoch ``epoch`` (0-based) for images of ``height x width``."""
        rng = np.random.default_rng([self.seed, self.rank, epoch, batch])
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or rng.random() < SWITCH_PROB)
        alpha = self.cutmix if use_cutmix else self.mixup
        lam = float(rng.beta(alpha, alpha))
        return cutmix_box(height, width, lam, rng) if use_cutmix else MixDraw(lam)

    def __call__(self, x: Tensor, y: Tensor, draw: MixDraw) -> tuple[Tensor, Tensor]:
        """The mixed images ``[b, c, h, w]`` and their soft targets ``[b, classes]``."""
        if draw.box is None:
            mixed = x * draw.lam + x.flip(0) * (1.0 - draw.lam)
        else:
            y0, y1, x0, x1 = draw.box
            mixed = x.clone()
            mixed[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
        return mixed, mix_targets(y, self.num_classes, draw.lam, self.smoothing)
