"""Factorised 2-d relative position logits for the self-attention baselines.

Bello et al. 2019 (attention augmentation, BoTNet): ``logit(n, m) = q_n . (k_m + r^H_{a-i} + r^W_{c-j})``
with full-depth height and width tables. SASA (Ramachandran et al. 2019) and HaloNet allocate half of
each head's channels to each axis: ``q_n[:d/2] . r^H_{a-i} + q_n[d/2:] . r^W_{c-j}``. Tables are shared by
all heads (HaloNet App. A). Initialisation ``N(0, d^-1/2)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_choice
from lambdanet.helpers import compute_dtype

__all__ = ["RelativePosition2d", "RelativePosition1d", "attend"]


class RelativePosition2d(nn.Module):
    """Relative position logits factorised over height and width.

    Args:
        max_offset: largest ``|offset|`` per axis ``(oh, ow)``: tables hold ``2 o + 1`` entries.
        dim_head: query depth per head ``d``.
        split: ``"full"`` (both tables ``d`` deep, Bello 2019) or ``"half"`` (``d/2`` channels per axis,
            SASA / HaloNet).
    """

    def __init__(self, max_offset: tuple[int, int], dim_head: int, split: str = "full"):
        super().__init__()
        check_choice(split, "split", ("full", "half"))
        if split == "half" and dim_head < 2:
            raise ValueError(f"split='half' needs dim_head >= 2, got dim_head={dim_head}")
        self.max_offset = tuple(int(o) for o in max_offset)
        self.dim_head, self.split = dim_head, split
        dh = dim_head if split == "full" else dim_head // 2
        dw = dim_head if split == "full" else dim_head - dim_head // 2
        self.rel_h = nn.Parameter(torch.randn(2 * self.max_offset[0] + 1, dh) * dim_head ** -0.5)
        self.rel_w = nn.Parameter(torch.randn(2 * self.max_offset[1] + 1, dw) * dim_head ** -0.5)

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}, dim_head={self.dim_head}, split={self.split!r}"

    def tables(self, q_coords: tuple[Tensor, Tensor], k_coords: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Gather ``T_h[i, a] = r^H[k_a - q_i]`` and ``T_w[j, c]``; offsets beyond the table are clamped
        (callers mask those keys)."""
        (qh, qw), (kh, kw) = q_coords, k_coords
        oh, ow = self.max_offset
        idx_h = (kh[None, :] - qh[:, None] + oh).clamp(0, 2 * oh)  # Qh Kh
        idx_w = (kw[None, :] - qw[:, None] + ow).clamp(0, 2 * ow)  # Qw Kw
        return self.rel_h[idx_h], self.rel_w[idx_w]  # Qh Kh dh, Qw Kw dw

    def forward(self, q: Tensor, q_coords: tuple[Tensor, Tensor], k_coords: tuple[Tensor, Tensor]) -> Tensor:
        """Relative logits for queries ``q[..., Qh, Qw, d]`` at ``q_coords`` against keys at ``k_coords``.

        Returns ``[..., Qh, Qw, Kh, Kw]``.
        """
        t_h, t_w = self.tables(q_coords, k_coords)
        if self.split == "full":
            q_h = q_w = q
        else:
            q_h, q_w = q[..., : t_h.shape[-1]], q[..., t_h.shape[-1]:]
        l_h = torch.einsum("...ijd,iad->...ija", q_h, t_h)  # ... Qh Qw Kh
        l_w = torch.einsum("...ijd,jcd->...ijc", q_w, t_w)  # ... Qh Qw Kw
        return l_h.unsqueeze(-1) + l_w.unsqueeze(-2)  # ... Qh Qw Kh Kw


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None,
           scale: float = 1.0) -> Tensor:
    """Softmax attention ``softmax(q k^T scale + bias, masked) v``.

    ``q [..., Nq, d]``, ``k [..., Nk, d]``, ``v [..., Nk, dv]``, ``bias`` broadcastable to ``[..., Nq, Nk]``,
    ``mask`` (True = keep) broadcastable to it. The logits and the softmax run in :func:`compute_dtype`
    (float32 for half-precision inputs, float64 for float64). Masked keys get the most negative finite
    logit, so a row with no valid key gives a uniform (finite) average instead of NaN.
    """
    logits = q @ k.transpose(-1, -2)  # ... Nq Nk
    dtype = compute_dtype(logits.dtype)
    logits = logits.to(dtype) * scale
    if bias is not None:
        logits = logits + bias.to(dtype)
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(dtype).min)
    attn = logits.softmax(dim=-1).to(v.dtype)
    return attn @ v  # ... Nq dv


class RelativePosition1d(nn.Module):
    """Relative position logits along one axis: ``q_i . r[a - i]`` with a ``2 o + 1``-entry table."""

    def __init__(self, max_offset: int, dim_head: int):
        super().__init__()
        self.max_offset, self.dim_head = int(max_offset), dim_head
        self.rel = nn.Parameter(torch.randn(2 * self.max_offset + 1, dim_head) * dim_head ** -0.5)

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}, dim_head={self.dim_head}"

    def forward(self, q: Tensor) -> Tensor:
        """``q [..., L, d]`` -> logits ``[..., L, L]`` (queries and keys on the same axis)."""
        length = q.shape[-2]
        pos = torch.arange(length, device=q.device)
        idx = (pos[None, :] - pos[:, None] + self.max_offset).clamp(0, 2 * self.max_offset)  # L L
        return torch.einsum("...id,iad->...ia", q, self.rel[idx])  # ... L L
