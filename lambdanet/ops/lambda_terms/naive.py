"""The two terms of the causal lambda as defined, one query position at a time (``Theta(n^2)``; the tests'
references, any dtype; float64 in the tests)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["naive_content_lambda", "naive_position_lambda", "L2_EPS"]

L2_EPS = 1e-12  # the smallest prefix norm ``key_norm="l2"`` divides by (``F.normalize``'s)


def naive_content_lambda(q: Tensor, keys: Tensor, values: Tensor, key_norm: str = "softmax") -> Tensor:
    """``q [b, n, h, k]``, raw ``keys [b, n, k, u]``, ``values [b, n, v, u]`` -> ``[b, n, h, v]``: query ``n``
    applies ``sum_u sum_{m<=n} Kn[m] V[m]^T`` with the keys of its prefix ``m <= n`` normalised per channel:
    ``"softmax"`` (the paper's), ``"l2"`` (``K / max(||K[:n+1]||_2, eps)``) or ``"none"`` (the raw keys)."""
    out = []
    for n in range(q.shape[1]):
        K = keys[:, : n + 1]  # b m k u
        if key_norm == "softmax":
            K = torch.softmax(K, dim=1)
        elif key_norm == "l2":
            K = K / K.norm(dim=1, keepdim=True).clamp_min(L2_EPS)
        elif key_norm != "none":
            raise ValueError(f"key_norm must be 'softmax', 'l2' or 'none', got {key_norm!r}")
        lam = torch.einsum("bmku,bmvu->bkv", K, values[:, : n + 1])  # b k v
        out.append(torch.einsum("bhk,bkv->bhv", q[:, n], lam))  # b h v
    return _stacked(out, q, values)  # b n h v


def _stacked(out: list[Tensor], q: Tensor, values: Tensor) -> Tensor:
    """The queries' outputs ``[b, h, v]`` as ``[b, n, h, v]`` (an empty sequence: ``[b, 0, h, v]``)."""
    if out:
        return torch.stack(out, dim=1)
    return torch.zeros(q.shape[0], 0, q.shape[2], values.shape[2], dtype=torch.result_type(q, values), device=q.device)


def naive_position_lambda(q: Tensor, values: Tensor, emb: Tensor) -> Tensor:
    """``q [b, n, h, k]``, ``values [b, n, v, u]``, ``emb [r, k, u]`` -> ``[b, n, h, v]``: query ``n`` applies
    ``sum_u sum_{j<r, j<=n} emb[j] V[n-j]^T`` (the position lambdas alone, Table 10's position-only row)."""
    out = []
    for n in range(q.shape[1]):
        lam = q.new_zeros(q.shape[0], q.shape[3], values.shape[2])  # b k v
        for j in range(min(emb.shape[0], n + 1)):
            lam = lam + torch.einsum("ku,bvu->bkv", emb[j], values[:, n - j])  # b k v
        out.append(torch.einsum("bhk,bkv->bhv", q[:, n], lam))  # b h v
    return _stacked(out, q, values)  # b n h v
