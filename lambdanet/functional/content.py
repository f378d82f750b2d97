"""The content part of the lambda layer's fast path (:mod:`lambdanet.ops.position_lambda.fast` re-exports it): key
normalisation (Table 12), the content lambda shared by every query, the per-query content lambdas of a causal
layer through cumulative sums (App. B.2), and the content lambda's application to the queries."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lambdanet.helpers import bind_shapes, check_choice, compute_dtype

__all__ = ["KEY_NORMS", "normalize_keys", "content_lambda", "causal_content_lambdas", "apply_content_lambda"]

KEY_NORMS = ("softmax", "l2", "none")


def normalize_keys(keys: Tensor, method: str, dim: int = 1) -> Tensor:
    """Normalise keys along the context axis ``dim`` (Table 12): ``"softmax"`` (default), ``"l2"``
    (unit L2 norm over the context) or ``"none"``."""
    check_choice(method, "key_norm", KEY_NORMS)
    if not isinstance(keys, Tensor) or not -keys.dim() <= dim < keys.dim():
        got = f"{keys.dim()}-d keys" if isinstance(keys, Tensor) else f"keys of type {type(keys).__name__}"
        raise ValueError(f"dim must be an axis of the keys tensor, got dim={dim!r} for {got}")
    if method == "softmax":
        return keys.softmax(dim=dim)
    if method == "l2":
        return F.normalize(keys, dim=dim)
    return keys


def content_lambda(normalized_keys: Tensor, values: Tensor) -> Tensor:
    """Content lambda shared by every query: ``lambda^c = sum_{m,u} Kbar[m] V[m]^T``.

    Args:
        normalized_keys: ``[b, m, g, k, u]``.
        values: ``[b, m, g, v, u]``.

    Returns:
        ``[b, g, k, v]``.
    """
    if not _same_axes(normalized_keys, values, 5, (0, 1, 2, 4)):  # the checks' cost only where they fail
        bind_shapes(normalized_keys=(normalized_keys, "b m g k u"), values=(values, "b m g v u"))
    b, m, g, k, u = normalized_keys.shape
    v = values.shape[3]
    if g == 1 and u == 1:
        lam = normalized_keys.reshape(b, m, k).transpose(1, 2) @ values.reshape(b, m, v)  # b k v
        return lam.unsqueeze(1)  # b g k v
    return torch.einsum("bmgku,bmgvu->bgkv", normalized_keys, values)  # b g k v


def causal_content_lambdas(keys: Tensor, values: Tensor, method: str = "softmax") -> Tensor:
    """Per-query content lambdas of a causal (masked, App. B.2) layer with cumulative sums.

    Query ``n`` sees context ``m <= n``; its keys are normalised over that context only:
    ``lambda^c_n = sum_u (sum_{m<=n} w[m] V[m]^T) / Z_n`` with ``w = exp(K - max K)`` and
    ``Z_n = sum_{m<=n} w[m]`` for the softmax (``w = K``, ``Z_n = ||K[:n+1]||_2`` for L2). No ``n x m``
    tensor is formed: memory ``Theta(b n g k v u)``, computed in float32 or wider.

    Args:
        keys: ``[b, n, g, k, u]`` raw keys.
        values: ``[b, n, g, v, u]``.
        method: key normalisation, one of :data:`KEY_NORMS`.

    Returns:
        ``[b, n, g, k, v]``.
    """
    check_choice(method, "key_norm", KEY_NORMS)
    if not _same_axes(keys, values, 5, (0, 1, 2, 4)):
        bind_shapes(keys=(keys, "b n g k u"), values=(values, "b n g v u"))
    dtype = compute_dtype(keys.dtype, values.dtype)
    keys, values = keys.to(dtype), values.to(dtype)
    tiny = torch.finfo(dtype).tiny
    if method == "softmax":
        # the shift cancels between numerator and denominator; detached so no gradient reaches the future
        w = torch.exp(keys - keys.amax(dim=1, keepdim=True).detach())  # b n g k u
        z = w.cumsum(dim=1).clamp_min(tiny)  # b n g k u
    elif method == "l2":
        w, z = keys, keys.square().cumsum(dim=1).sqrt().clamp_min(1e-12)  # b n g k u
    else:
        w, z = keys, None
    num = torch.einsum("bngku,bngvu->bngkuv", w, values).cumsum(dim=1)  # b n g k u v
    if z is not None:
        num = num / z.unsqueeze(-1)
    return num.sum(dim=4)  # b n g k v


def apply_content_lambda(queries: Tensor, lam: Tensor) -> Tensor:
    """Apply the shared content lambda: ``y^c[b, n, h] = (lambda^c)^T q^h_n``.

    Args:
        queries: ``[b, n, h, k]``.
        lam: ``[b, g, k, v]`` (``g`` = 1 or ``h``).

    Returns:
        ``[b, n, h, v]``.
    """
    if not (
        _same_axes(queries, lam, 4, (0,)) and queries.shape[3] == lam.shape[2] and lam.shape[1] in (1, queries.shape[2])
    ):
        bind_shapes(queries=(queries, "b n h k"), lam=(lam, "b g k v"))
        raise ValueError(f"lam must have g = 1 or g = h = {queries.shape[2]} lambdas, got shape {tuple(lam.shape)}")
    b, n, h, k = queries.shape
    g, v = lam.shape[1], lam.shape[3]
    if g == 1:
        return (queries.reshape(b, n * h, k) @ lam[:, 0]).view(b, n, h, v)  # b n h v
    return torch.einsum("bnhk,bhkv->bnhv", queries, lam)  # b n h v


def _same_axes(a: Tensor, b: Tensor, rank: int, axes: tuple[int, ...]) -> bool:
    """Whether ``a`` and ``b`` are ``rank``-d tensors that agree on ``axes`` (a fast test before the named check)."""
    return (
        isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == rank == b.dim()
        and all(a.shape[i] == b.shape[i] for i in axes)
    )  # fmt: skip
