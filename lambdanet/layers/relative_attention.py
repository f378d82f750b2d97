"""Global self-attention baselines with 2-d relative position logits.

* :class:`RelativeSelfAttention`: multi-head self-attention over a fixed-size feature map with relative logits
  factorised over height and width (Bello et al. 2019; BoTNet's MHSA): Table 4 "global self-attention".
* :class:`AttentionAugmentedConv`: attention augmentation (Bello et al. 2019): ``dim_out - dv`` channels of 3x3
  convolution concatenated with ``dv`` of relative self-attention (Table 3 "conv + relative self-attention").

Complexity (``n = m = H W``): time ``Theta(b n m (h k + d))``, space ``Theta(b h n m)`` (the relative logits
and, on the math path, the attention maps). Stride 2: a 2x2 average pool (ceil mode) after the attention, as
in BoTNet. The softmax runs in :func:`~lambdanet.layers.relative_position.attend` (fused SDPA with the
relative logits as ``attn_mask`` on CUDA, the math reference on CPU;
:func:`~lambdanet.layers.relative_position.auto_attention_impl` is the rule).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_input, check_positive_int, check_real, to_ntuple
from lambdanet.layers.pooling import pool_after
from lambdanet.layers.relative_position import RelativePosition2d, attend

__all__ = ["RelativeSelfAttention", "AttentionAugmentedConv", "check_feat_size"]


def check_feat_size(spatial: Sequence[int], feat_size: Sequence[int], layer: str) -> None:
    """Inputs up to ``feat_size`` are served (the relative tables are cropped); larger ones are not."""
    if any(s > f for s, f in zip(spatial, feat_size)):
        raise ValueError(
            f"{layer} was built for feat_size={tuple(feat_size)}; got a larger input of spatial size {tuple(spatial)}"
        )


class RelativeSelfAttention(nn.Module):
    """Global multi-head self-attention with 2-d relative position logits on ``[B, dim, H, W]``.

    Args:
        dim: input channels.
        dim_out: output channels (values); ``heads`` must divide it.
        feat_size: the largest input ``(H, W)``; sizes the relative tables (``2 H - 1`` by ``2 W - 1``).
        stride: 1 or 2 (2x2 average pool after).
        heads: attention heads (4 as in BoTNet).
        dim_qk: total query/key channels (default ``dim_out``).
        rel_split: ``"full"`` (Bello 2019) or ``"half"`` channel allocation of the relative tables.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        feat_size: int | Sequence[int] | None = None,
        stride: int = 1,
        heads: int = 4,
        dim_qk: int | None = None,
        rel_split: str = "full",
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        dim_qk = dim_out if dim_qk is None else dim_qk
        for name, val in (("dim", dim), ("dim_out", dim_out), ("heads", heads), ("dim_qk", dim_qk)):
            check_positive_int(val, name)
        check_choice(stride, "stride", (1, 2))
        check_choice(rel_split, "rel_split", ("full", "half"))
        if feat_size is None:
            raise ValueError(f"{type(self).__name__} is global: it needs feat_size, the (largest) input size")
        if dim_out % heads or dim_qk % heads:
            raise ValueError(f"heads={heads} must divide dim_out={dim_out} and dim_qk={dim_qk}")
        if rel_split == "half" and dim_qk // heads < 2:
            raise ValueError(
                f"rel_split='half' needs at least 2 query/key channels per head, got dim_qk={dim_qk} for heads={heads}"
            )
        self.dim, self.dim_out, self.dim_qk, self.heads, self.stride = dim, dim_out, dim_qk, heads, stride
        self.feat_size = to_ntuple(feat_size, 2, "feat_size")
        for s in self.feat_size:
            check_positive_int(s, "feat_size")
        self.qkv = nn.Conv2d(dim, 2 * dim_qk + dim_out, 1, bias=False)
        self.rel = RelativePosition2d((self.feat_size[0] - 1, self.feat_size[1] - 1), dim_qk // heads, rel_split)

    def attention(self, x: Tensor) -> Tensor:
        """Stride-1 attention output ``[B, dim_out, H, W]``."""
        b, _, hh, ww = x.shape
        h, dk, dv = self.heads, self.dim_qk // self.heads, self.dim_out // self.heads
        q, k, v = self.qkv(x).split([self.dim_qk, self.dim_qk, self.dim_out], dim=1)
        q = q.reshape(b, h, dk, hh, ww).permute(0, 1, 3, 4, 2)  # b h H W dk
        k = k.reshape(b, h, dk, hh * ww).transpose(-1, -2)  # b h m dk
        v = v.reshape(b, h, dv, hh * ww).transpose(-1, -2)  # b h m dv
        coords = (torch.arange(hh, device=x.device), torch.arange(ww, device=x.device))
        bias = self.rel(q, coords, coords).reshape(b, h, hh * ww, hh * ww)  # b h n m
        out = attend(q.reshape(b, h, hh * ww, dk), k, v, bias, scale=dk**-0.5)  # b h n dv
        return out.transpose(-1, -2).reshape(b, self.dim_out, hh, ww)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        check_feat_size(x.shape[2:], self.feat_size, type(self).__name__)
        return pool_after(self.attention(x), self.stride)


class AttentionAugmentedConv(nn.Module):
    """Attention-augmented convolution (Bello et al. 2019): ``concat(conv3x3(x), MHSA(x) W_O)``.

    Args:
        dim, dim_out, feat_size, stride: as for the other spatial layers.
        heads: ``N_h`` (8).
        k_ratio: ``kappa = d_k / dim_out`` (0.2).
        v_ratio: ``upsilon = d_v / dim_out`` (0.1); ``d_k`` and ``d_v`` are rounded to multiples of ``heads``.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        feat_size: int | Sequence[int] | None = None,
        stride: int = 1,
        heads: int = 8,
        k_ratio: float = 0.2,
        v_ratio: float = 0.1,
        rel_split: str = "full",
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        for name, val in (("dim", dim), ("dim_out", dim_out), ("heads", heads)):
            check_positive_int(val, name)
        check_choice(stride, "stride", (1, 2))
        check_real(k_ratio, "k_ratio")
        check_real(v_ratio, "v_ratio", high=1, high_open=True)
        dk = max(heads, round(k_ratio * dim_out / heads) * heads)
        dv = max(heads, round(v_ratio * dim_out / heads) * heads)
        if dv >= dim_out:
            raise ValueError(
                f"dim_out={dim_out} is too small for {heads} heads with v_ratio={v_ratio}: "
                f"the attention would take all {dv} channels"
            )
        self.dim, self.stride = dim, stride
        self.conv = nn.Conv2d(dim, dim_out - dv, 3, stride, 1, bias=False)
        self.attn = RelativeSelfAttention(
            dim, dv, feat_size=feat_size, stride=stride, heads=heads, dim_qk=dk, rel_split=rel_split
        )
        self.proj = nn.Conv2d(dv, dv, 1, bias=False)  # W_O, mixes the heads

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        check_feat_size(x.shape[2:], self.attn.feat_size, type(self).__name__)
        attn = pool_after(self.proj(self.attn.attention(x)), self.stride)
        return torch.cat([self.conv(x), attn], dim=1)
