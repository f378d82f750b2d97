"""Stochastic depth (Huang et al. 2016): drop a residual branch per example during training."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_number, plain_real

__all__ = ["DropPath", "drop_path"]


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Zero the whole example with probability ``p`` (in ``[0, 1]``) and rescale survivors by ``1 / (1 - p)``;
    ``p = 1`` drops every example (zeros, as timm's)."""
    if p == 0.0 or not training:
        return x
    if not torch.compiler.is_compiling():  # (a rate that varies is a symbolic float there: DropPath checked it)
        check_number(plain_real(p), "p", 0, 1, note=" (the probability of dropping an example)")
    keep = 1.0 - p
    mask = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * mask / keep if keep > 0 else x * mask


class DropPath(nn.Module):
    """Module form of :func:`drop_path` (``p`` = drop probability)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        p = plain_real(p)
        check_number(p, "p", 0, 1, high_open=True, note=" (the drop path rate: the probability of dropping a branch)")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return drop_path(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
