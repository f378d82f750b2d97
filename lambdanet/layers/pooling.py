"""Downsampling after a stride-1 layer: the stride-2 form of the global and local attention baselines
(BoTNet, SASA, axial attention) is the stride-1 layer followed by a 2x2 average pool."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["pool_after"]


def pool_after(x: Tensor, stride: int) -> Tensor:
    """``[B, C, H, W]`` -> ``[B, C, ceil(H / stride), ceil(W / stride)]`` by a ``stride x stride`` average pool
    (ceil mode: a partial window at the border averages the pixels it holds); identity for ``stride=1``."""
    return x if stride == 1 else F.avg_pool2d(x, stride, stride, ceil_mode=True)
