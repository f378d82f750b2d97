"""Stochastic depth (Huang et al. 2016): drop a residual branch per example during training."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DropPath", "drop_path"]


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Zero the whole example with probability ``p`` and rescale survivors by ``1 / (1 - p)``."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * mask / keep


class DropPath(nn.Module):
    """Module form of :func:`drop_path` (``p`` = drop probability)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path rate must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
