"""Local self-attention: HaloNet's blocked local attention and SASA's pixel-centred windows.

Both share one core, :class:`BlockedLocalAttention` (HaloNet Sec. 2.2, Fig. 1-2): the image is cut into
non-overlapping ``b x b`` query blocks, each attending to its ``(b + 2h) x (b + 2h)`` neighbourhood (the block
plus a halo of ``h`` pixels). Keys and values are projected once over the whole image, then gathered into the
haloed windows (projecting after an unfold would cost ``((b + 2h)/b)^2`` times the key/value FLOPs). Pixels
outside the image (halo padding, or padding up to a multiple of ``b``) are masked out of the softmax (the
inverted-mask bug of halonet-pytorch #4 cannot happen: the tests compare border pixels with a naive reference).

* :class:`HaloAttention` (HaloNet): unmasked block + halo neighbourhood; translation equivariant only for shifts
  by multiples of ``b`` unless ``pixel_centered=True``, which masks every query to its own ``(2h + 1)^2``
  window. Downsampling subsamples the queries (HaloNet Fig. 2): same neighbourhood, 4x fewer queries. Relative
  embeddings factorised over height and width, half a head's channels each, shared by the heads (App. A).
* :class:`LocalSelfAttention` (SASA, Ramachandran et al. 2019): every pixel attends to the ``k x k`` window
  centred on it (7x7 default), computed blockwise with a mask; stride 2 = 2x2 average pool after.

Complexity (HaloNet Table 1, ``c`` channels, ``n = H W``): memory ``Theta(n/b^2 (b + 2h)^2 c)`` for the gathered
neighbourhoods and ``Theta(b_ h n (b + 2h)^2)`` for the relative logits and, on the math path, the attention
weights (batch ``b_``, heads ``h``); FLOPs per pixel ``Theta((b + 2h)^2 c)``. Both are linear in ``n``.

The softmax runs in :func:`~lambdanet.layers.relative_position.attend`: each block's ``(b/s)^2`` queries against
its ``(b + 2h)^2`` keys are one batch entry of ``F.scaled_dot_product_attention`` on CUDA (relative logits and
padding / window mask in one additive ``attn_mask``), the math reference on CPU
(:func:`~lambdanet.layers.relative_position.auto_attention_impl` is the rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_input, check_int, check_positive_int
from lambdanet.layers.pooling import pool_after
from lambdanet.layers.relative_position import RelativePosition2d, attend

__all__ = ["BlockedLocalAttention", "HaloAttention", "LocalSelfAttention"]


class BlockedLocalAttention(nn.Module):
    """Blocked local multi-head self-attention on ``[B, dim, H, W]`` (any H, W).

    Args:
        dim: input channels.
        dim_out: value / output channels; ``heads`` must divide it.
        block_size: query block ``b``.
        halo_size: halo ``h`` (pixels around each block).
        heads: attention heads.
        dim_qk: total query/key channels (default ``dim_out``).
        stride: query subsampling factor (must divide ``block_size``).
        window: if set (odd, ``<= 2 h + 1``), every query only sees the ``window x window`` pixels centred on it.
        rel_max_offset: relative table size (default: every offset the geometry can produce). A smaller table
            clips the offsets beyond it to its last entry (Shaw et al.'s clipping): those keys are still attended.
        rel_split: ``"half"`` (HaloNet App. A: half a head's channels per axis) or ``"full"`` (full-depth tables,
            as in timm's checkpoints).
        rel_geometry: ``"pixel"``: true pixel offsets between query and key. ``"window"`` (timm's checkpoints):
            from a query's index inside its (subsampled) block to the key's index inside the haloed window, with a
            ``2 (b + 2h) - 1``-entry table; not translation geometry (queries sit ``h`` pixels right of where it
            places them, subsampled queries are not scaled by the stride), but what those weights learnt.
        mask_padding: mask the halo padding and the image padding out of the softmax (default). ``False``
            (timm's checkpoints): padded pixels take part as keys of zero content and zero value.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int,
        *,
        block_size: int,
        halo_size: int,
        heads: int,
        dim_qk: int | None = None,
        stride: int = 1,
        window: int | None = None,
        rel_max_offset: int | None = None,
        rel_split: str = "half",
        rel_geometry: str = "pixel",
        mask_padding: bool = True,
    ):
        super().__init__()
        check_choice(rel_geometry, "rel_geometry", ("pixel", "window"))
        check_choice(rel_split, "rel_split", ("half", "full"))
        dim_qk = dim_out if dim_qk is None else dim_qk
        for name, val in (
            ("dim", dim),
            ("dim_out", dim_out),
            ("heads", heads),
            ("dim_qk", dim_qk),
            ("block_size", block_size),
            ("stride", stride),
        ):
            check_positive_int(val, name)
        check_int(halo_size, "halo_size", 0)
        if rel_max_offset is not None:
            check_int(rel_max_offset, "rel_max_offset", 0, note=" or None")
        if not isinstance(mask_padding, bool):
            raise ValueError(f"mask_padding must be True or False, got {mask_padding!r}")
        if dim_out % heads or dim_qk % heads:
            raise ValueError(f"heads={heads} must divide dim_out={dim_out} and dim_qk={dim_qk}")
        if (dim_qk // heads) < 2:
            raise ValueError(f"each head needs at least 2 query/key channels (dim_qk={dim_qk}, heads={heads})")
        if block_size % stride:
            raise ValueError(
                f"stride={stride} must divide block_size={block_size} (queries are subsampled inside each block)"
            )
        if window is not None:
            check_positive_int(window, "window", odd=True)
            if window // 2 > halo_size:
                raise ValueError(f"window={window} needs halo_size >= {window // 2}, got halo_size={halo_size}")
        self.dim, self.dim_out, self.dim_qk, self.heads = dim, dim_out, dim_qk, heads
        self.block_size, self.halo_size, self.stride, self.window = block_size, halo_size, stride, window
        self.rel_geometry, self.mask_padding = rel_geometry, mask_padding
        self.q = nn.Conv2d(dim, dim_qk, 1, bias=False)
        self.kv = nn.Conv2d(dim, dim_qk + dim_out, 1, bias=False)
        if rel_max_offset is None:
            rel_max_offset = (
                block_size + 2 * halo_size - 1
                if rel_geometry == "window"
                else window // 2
                if window is not None
                else block_size + halo_size - 1
            )
        self.rel = RelativePosition2d((rel_max_offset, rel_max_offset), dim_qk // heads, split=rel_split)

    def extra_repr(self) -> str:
        extra = "" if self.rel_geometry == "pixel" else f", rel_geometry={self.rel_geometry!r}"
        extra += "" if self.mask_padding else ", mask_padding=False"
        return (
            f"block_size={self.block_size}, halo_size={self.halo_size}, heads={self.heads}, "
            f"stride={self.stride}, window={self.window}{extra}"
        )

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        b, _, hh, ww = x.shape
        bs, hs, s, h = self.block_size, self.halo_size, self.stride, self.heads
        dk, dv = self.dim_qk // h, self.dim_out // h
        nbh, nbw = math.ceil(hh / bs), math.ceil(ww / bs)
        nb, bq, win = nbh * nbw, bs // s, bs + 2 * hs
        hq, wq = math.ceil(hh / s), math.ceil(ww / s)
        q = self.q(x[..., ::s, ::s] if s > 1 else x)  # b (h dk) hq wq
        q = F.pad(q, (0, nbw * bq - wq, 0, nbh * bq - hq))
        q = q.reshape(b, h, dk, nbh, bq, nbw, bq).permute(0, 1, 3, 5, 4, 6, 2)  # b h nbh nbw bq bq dk
        kv = self.kv(x)  # project once: b (h dk + h dv) H W
        kv = F.pad(kv, (hs, nbw * bs - ww + hs, hs, nbh * bs - hh + hs))
        kv = kv.unfold(2, win, bs).unfold(3, win, bs)  # b c nbh nbw win win (a view)
        kv = kv.reshape(b, self.dim_qk + self.dim_out, nb, win * win)  # gather the haloed windows
        k = kv[:, : self.dim_qk].reshape(b, h, dk, nb, win * win).permute(0, 1, 3, 4, 2)  # b h nb (win win) dk
        v = kv[:, self.dim_qk :].reshape(b, h, dv, nb, win * win).permute(0, 1, 3, 4, 2)  # b h nb (win win) dv
        mask = self._mask(hh, ww, x.device)  # nb (bq bq) (win win), True = a real pixel in reach
        coords_q = torch.arange(bq, device=x.device)  # "window": query i of a block sits at window index i
        if self.rel_geometry == "pixel":  # at window pixel i s + h
            coords_q = coords_q * s + hs
        coords_k = torch.arange(win, device=x.device)
        bias = self.rel(q, (coords_q, coords_q), (coords_k, coords_k))  # b h nbh nbw bq bq win win
        bias = bias.reshape(b, h, nb, bq * bq, win * win)
        out = attend(q.reshape(b, h, nb, bq * bq, dk), k, v, bias, mask, scale=dk**-0.5)  # b h nb (bq bq) dv
        out = out.reshape(b, h, nbh, nbw, bq, bq, dv).permute(0, 1, 6, 2, 4, 3, 5)  # b h dv nbh bq nbw bq
        out = out.reshape(b, self.dim_out, nbh * bq, nbw * bq)
        return out[..., :hq, :wq]

    def _mask(self, hh: int, ww: int, device: torch.device) -> Tensor | None:
        """``[nb, (bq bq) | 1, (win win)]``, True = a key the query may see; ``None``: every key."""
        if not self.mask_padding and self.window is None:
            return None
        bs, hs, s = self.block_size, self.halo_size, self.stride
        nbh, nbw = math.ceil(hh / bs), math.ceil(ww / bs)
        bq, win = bs // s, bs + 2 * hs
        valid = torch.zeros(nbh * bs + 2 * hs, nbw * bs + 2 * hs, dtype=torch.bool, device=device)
        valid[hs : hs + hh, hs : hs + ww] = True
        if not self.mask_padding:
            valid[:] = True
        valid = valid.unfold(0, win, bs).unfold(1, win, bs).reshape(nbh * nbw, 1, win * win)
        if self.window is None:
            return valid
        qc = torch.arange(bq, device=device) * s + hs
        kc = torch.arange(win, device=device)
        near = (kc[None, :] - qc[:, None]).abs() <= self.window // 2  # bq win
        window = (near[:, None, :, None] & near[None, :, None, :]).reshape(1, bq * bq, win * win)
        return valid & window


class HaloAttention(BlockedLocalAttention):
    """HaloNet blocked local self-attention (HaloNet Sec. 2.2-2.3).

    Args:
        dim, dim_out: input / output channels.
        stride: query subsampling (HaloNet Fig. 2 uses 1 or 2; any divisor of ``block_size``), or a 2x2
            average pool after the stride-1 layer with ``downsample="pool"``.
        block_size: ``b`` (8).
        halo_size: ``h`` (3).
        heads: heads (default ``dim_out // 16``: 16 value channels per head).
        dim_qk: total query/key channels (default ``dim_out``).
        pixel_centered: mask each query to the ``(2h + 1)^2`` window centred on it (translation
            equivariant, HaloNet Sec. 4.3 "relaxing translational equivariance" ablation).
        downsample: how ``stride=2`` downsamples: ``"subsample"`` the queries (default) or ``"pool"`` (timm's
            convention where ``stride`` does not divide ``block_size``).
        rel_split, rel_geometry, mask_padding: as in :class:`BlockedLocalAttention` (the defaults are the
            paper's; ``"full"``, ``"window"``, ``False`` reproduce timm's HaloNet checkpoints).
    """

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        stride: int = 1,
        block_size: int = 8,
        halo_size: int = 3,
        heads: int | None = None,
        dim_qk: int | None = None,
        pixel_centered: bool = False,
        downsample: str = "subsample",
        rel_split: str = "half",
        rel_geometry: str = "pixel",
        mask_padding: bool = True,
    ):
        check_positive_int(dim, "dim")
        dim_out = dim if dim_out is None else dim_out
        check_positive_int(dim_out, "dim_out")
        if not isinstance(pixel_centered, bool):
            raise ValueError(f"pixel_centered must be True or False, got {pixel_centered!r}")
        check_choice(downsample, "downsample", ("subsample", "pool"))
        if heads is None:
            heads = max(1, dim_out // 16)
            if dim_out % heads:  # the default the user never named: say it
                raise ValueError(f"heads (by default dim_out // 16 = {heads}) must divide dim_out={dim_out}; pass "
                                 "heads that do")  # fmt: skip
        pool = downsample == "pool" and stride > 1
        super().__init__(
            dim,
            dim_out,
            block_size=block_size,
            halo_size=halo_size,
            heads=heads,
            dim_qk=dim_qk,
            stride=1 if pool else stride,
            window=2 * halo_size + 1 if pixel_centered else None,
            rel_split=rel_split,
            rel_geometry=rel_geometry,
            mask_padding=mask_padding,
        )
        self.pool_stride = stride if pool else 1

    def forward(self, x: Tensor) -> Tensor:
        return pool_after(super().forward(x), self.pool_stride)


class LocalSelfAttention(nn.Module):
    """SASA local self-attention: each pixel attends to the ``kernel_size^2`` window centred on it.

    Args:
        dim, dim_out: input / output channels.
        stride: 1 or 2 (2x2 average pool after, as in SASA).
        kernel_size: window ``k`` (odd, 7).
        heads: heads (8).
        block_size: query block of the blocked implementation (a speed/memory knob, not a model change).
    """

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        stride: int = 1,
        kernel_size: int = 7,
        heads: int = 8,
        block_size: int = 8,
        dim_qk: int | None = None,
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        check_positive_int(kernel_size, "kernel_size", odd=True)
        check_choice(stride, "stride", (1, 2))
        self.stride, self.kernel_size = stride, kernel_size
        self.attn = BlockedLocalAttention(
            dim,
            dim_out,
            block_size=block_size,
            halo_size=kernel_size // 2,
            heads=heads,
            dim_qk=dim_qk,
            window=kernel_size,
        )

    def forward(self, x: Tensor) -> Tensor:
        return pool_after(self.attn(x), self.stride)
