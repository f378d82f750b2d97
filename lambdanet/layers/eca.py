"""Efficient channel attention (ECA-Net, Wang et al. 2020): squeeze-and-excitation without the bottleneck,
a 1-d convolution across the pooled channels (the gate of timm's ``eca_*`` checkpoints)."""

from __future__ import annotations

import math

from torch import Tensor, nn

from lambdanet.helpers import check_input, check_positive_int

__all__ = ["EfficientChannelAttention", "eca_kernel_size"]


def eca_kernel_size(channels: int, gamma: float = 2.0, beta: float = 1.0) -> int:
    """ECA-Net Eq. 12: ``k = |log2(C) / gamma + beta / gamma|_odd``: truncated to an int, an even one raised to
    the next odd number, at least 3 (timm's rule; C = 256: 4.5 -> 4 -> 5)."""
    t = int(abs(math.log2(channels) + beta) / gamma)
    return max(t if t % 2 else t + 1, 3)


class EfficientChannelAttention(nn.Module):
    """``x * sigmoid(conv1d_k(mean(x)))`` over the channel axis (``k`` from :func:`eca_kernel_size`).

    Args:
        channels: input = output channels.
        kernel_size: the 1-d kernel (default: adaptive from ``channels``).

    Time ``Theta(b n c)``, space ``Theta(b c)``; ``k`` parameters.
    """

    def __init__(self, channels: int, kernel_size: int | None = None):
        super().__init__()
        check_positive_int(channels, "channels")
        kernel_size = eca_kernel_size(channels) if kernel_size is None else kernel_size
        check_positive_int(kernel_size, "kernel_size", odd=True)
        self.channels = channels
        self.conv = nn.Conv1d(1, 1, kernel_size, padding=kernel_size // 2, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.channels, None, self, dim_name="channels")
        b, c = x.shape[:2]
        s = x.mean(dim=tuple(range(2, x.dim()))).view(b, 1, c)  # b 1 c
        return x * self.conv(s).sigmoid().view(b, c, *([1] * (x.dim() - 2)))  # gate: b c 1 1
