"""The convolution baselines: the 3x3 convolution of a ResNet bottleneck and its squeeze-and-excitation
variant (LambdaNetworks Table 3 rows 1-2), with the spatial-layer constructor shape."""

from __future__ import annotations

from torch import Tensor, nn

from lambdanet.helpers import check_input, check_positive_int
from lambdanet.layers.squeeze_excite import SqueezeExcite

__all__ = ["ConvLayer", "ConvSE"]


class ConvLayer(nn.Module):
    """``kernel_size x kernel_size`` convolution, no bias (a BatchNorm follows in the block). Time
    ``Theta(b n r d_in d_out)``, space ``Theta(b n d)``; stride is the convolution's."""

    def __init__(self, dim: int, dim_out: int | None = None, *, stride: int = 1, kernel_size: int = 3, groups: int = 1):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        for name, val in (("dim", dim), ("dim_out", dim_out), ("stride", stride), ("groups", groups)):
            check_positive_int(val, name)
        check_positive_int(kernel_size, "kernel_size", odd=True)
        if dim % groups or dim_out % groups:
            raise ValueError(f"groups={groups} must divide dim={dim} and dim_out={dim_out}")
        self.dim = dim
        self.conv = nn.Conv2d(dim, dim_out, kernel_size, stride, kernel_size // 2, groups=groups, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        return self.conv(x)


class ConvSE(ConvLayer):
    """3x3 convolution followed by squeeze-and-excitation on its output (ratio ``rd_ratio``: ``1/16``, SE-ResNet's,
    which gives Table 3's 28.1M; ``0.25`` as in ResNet-RS)."""

    def __init__(
        self, dim: int, dim_out: int | None = None, *, stride: int = 1, kernel_size: int = 3, rd_ratio: float = 1 / 16
    ):
        super().__init__(dim, dim_out, stride=stride, kernel_size=kernel_size)
        self.se = SqueezeExcite(self.conv.out_channels, rd_ratio=rd_ratio)

    def forward(self, x: Tensor) -> Tensor:
        return self.se(super().forward(x))
