"""Axial self-attention (Ho et al. 2019; Wang et al. 2020): attention along the height axis, then along
the width axis, each with 1-d relative position logits. LambdaNetworks Table 4 "axial self-attention".

Complexity (``n = H W``): time ``Theta(b n (H + W) d)``, space ``Theta(b h n (H + W))``, i.e.
``Theta(b h n sqrt(n))`` for square maps. Stride 2: a 2x2 average pool (ceil mode) after. Each row (column) is one
batch entry of :func:`~lambdanet.layers.relative_position.attend` (fused SDPA on CUDA, the math reference on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_input, check_positive_int, to_ntuple
from lambdanet.layers.pooling import pool_after
from lambdanet.layers.relative_attention import check_feat_size
from lambdanet.layers.relative_position import RelativePosition1d, attend

__all__ = ["AxialAttention1d", "AxialAttention"]


class AxialAttention1d(nn.Module):
    """Multi-head self-attention along one spatial axis (``axis=2``: height, ``3``: width)."""

    def __init__(self, dim: int, dim_out: int, *, axis: int, max_len: int, heads: int = 8):
        super().__init__()
        check_choice(axis, "axis", (2, 3))
        for name, val in (("dim", dim), ("dim_out", dim_out), ("heads", heads), ("max_len", max_len)):
            check_positive_int(val, name)
        if dim_out % heads:
            raise ValueError(f"heads={heads} must divide dim_out={dim_out}")
        self.dim, self.dim_out, self.heads, self.axis = dim, dim_out, heads, axis
        self.qkv = nn.Conv2d(dim, 3 * dim_out, 1, bias=False)
        self.rel = RelativePosition1d(max_len - 1, dim_out // heads)

    def forward(self, x: Tensor) -> Tensor:
        b, _, hh, ww = x.shape
        h, d = self.heads, self.dim_out // self.heads
        qkv = self.qkv(x).reshape(b, 3, h, d, hh, ww)
        # axis 2: sequences run down the columns (3 b h W H d), axis 3: along the rows (3 b h H W d)
        q, k, v = (qkv.permute(1, 0, 2, 5, 4, 3) if self.axis == 2 else qkv.permute(1, 0, 2, 4, 5, 3)).unbind(0)
        out = attend(q, k, v, self.rel(q), scale=d**-0.5)  # b h other L d
        out = out.permute(0, 1, 4, 3, 2) if self.axis == 2 else out.permute(0, 1, 4, 2, 3)  # b h d H W
        return out.reshape(b, self.dim_out, hh, ww)


class AxialAttention(nn.Module):
    """Height-axis then width-axis attention on ``[B, dim, H, W]`` (inputs up to ``feat_size``)."""

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        feat_size: int | Sequence[int] | None = None,
        stride: int = 1,
        heads: int = 8,
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        for name, val in (("dim", dim), ("dim_out", dim_out), ("heads", heads)):
            check_positive_int(val, name)
        check_choice(stride, "stride", (1, 2))
        if feat_size is None:
            raise ValueError("AxialAttention needs feat_size, the (largest) input size, for its relative tables")
        self.dim, self.stride = dim, stride
        self.feat_size = to_ntuple(feat_size, 2, "feat_size")
        for s in self.feat_size:
            check_positive_int(s, "feat_size")
        self.height = AxialAttention1d(dim, dim_out, axis=2, max_len=self.feat_size[0], heads=heads)
        self.width = AxialAttention1d(dim_out, dim_out, axis=3, max_len=self.feat_size[1], heads=heads)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        check_feat_size(x.shape[2:], self.feat_size, type(self).__name__)
        return pool_after(self.width(self.height(x)), self.stride)
