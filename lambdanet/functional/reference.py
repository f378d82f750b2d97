"""The paper-shaped reference functions, with the figures' argument order and shapes: plain einsums, exactly
as printed (LambdaNetworks Figs. 3, 5, 6, 7, 8). Symbols and layouts: :mod:`lambdanet.functional`."""

from __future__ import annotations

import torch
from torch import Tensor

from lambdanet.helpers import bind_shapes as _bind
from lambdanet.helpers import check_choice
from lambdanet.ops.position_lambda.fast import POSITION_IMPLS, position_lambdas

__all__ = ["lambda_layer", "compute_position_lambdas", "masked_lambda_layer", "multihead_lambda_layer"]


def lambda_layer(queries: Tensor, keys: Tensor, embeddings: Tensor, values: Tensor) -> Tensor:
    """Multi-query lambda layer, Fig. 3 (and Fig. 8 when an intra-depth axis ``u`` is present).

    Args:
        queries: ``[b, h, n, k]``.
        keys: ``[b, m, k]`` raw keys (normalised here with a softmax over the context ``m``),
            or ``[b, m, k, u]`` with intra-depth.
        embeddings: ``[n, m, k]`` position embeddings ``E`` (or ``[n, m, k, u]``).
        values: ``[b, m, v]`` (or ``[b, m, v, u]``).

    Returns:
        ``[b, n, h * v]``: ``y_n = concat_h((lambda^c + lambda^p_n)^T q^h_n)`` (Eq. 1-2).
    """
    for name, t in (("keys", keys), ("embeddings", embeddings), ("values", values)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if keys.dim() == 4 or values.dim() == 4 or embeddings.dim() == 4:
        s = _bind(
            queries=(queries, "b h n k"),
            keys=(keys, "b m k u"),
            embeddings=(embeddings, "n m k u"),
            values=(values, "b m v u"),
        )
        content_lambda = torch.einsum("bmku,bmvu->bkv", keys.softmax(dim=1), values)  # b k v
        position_lambdas = torch.einsum("nmku,bmvu->bnkv", embeddings, values)  # b n k v
    else:
        s = _bind(
            queries=(queries, "b h n k"),
            keys=(keys, "b m k"),
            embeddings=(embeddings, "n m k"),
            values=(values, "b m v"),
        )
        content_lambda = torch.einsum("bmk,bmv->bkv", keys.softmax(dim=1), values)  # b k v
        position_lambdas = torch.einsum("nmk,bmv->bnkv", embeddings, values)  # b n k v
    content_output = torch.einsum("bhnk,bkv->bnhv", queries, content_lambda)  # b n h v
    position_output = torch.einsum("bhnk,bnkv->bnhv", queries, position_lambdas)  # b n h v
    return (content_output + position_output).reshape(s["b"], s["n"], s["h"] * s["v"])  # b n d


def compute_position_lambdas(embeddings: Tensor, values: Tensor, impl: str = "einsum") -> Tensor:
    """Position lambdas of a 1-d sequence, Fig. 5.

    Args:
        embeddings: ``impl="einsum"``: ``[n, m, k]`` (or ``[n, m, k, u]``).
            ``impl="conv"`` / ``"depthwise_conv"``: a relative kernel ``[r, k]`` (or ``[r, k, u]``), ``r`` odd,
            entry ``r // 2`` being offset 0, i.e. the einsum form with ``E[n, m] = R[m - n + r // 2]``
            inside the scope and 0 outside.
        values: ``[b, m, v]`` (or ``[b, m, v, u]``); for the convolutions ``m == n`` (zero padding keeps n).
        impl: ``"einsum"``, ``"conv"`` (the (n+1)-d convolution) or ``"depthwise_conv"`` (the n-d
            depthwise convolution with channel multiplier ``k``).

    Returns:
        ``[b, n, k, v]``.
    """
    check_choice(impl, "impl", POSITION_IMPLS)
    if impl == "einsum":
        if embeddings.dim() == 4 or values.dim() == 4:
            _bind(embeddings=(embeddings, "n m k u"), values=(values, "b m v u"))
            return torch.einsum("nmku,bmvu->bnkv", embeddings, values)  # b n k v
        _bind(embeddings=(embeddings, "n m k"), values=(values, "b m v"))
        return torch.einsum("nmk,bmv->bnkv", embeddings, values)  # b n k v
    if embeddings.dim() == 2:
        s = _bind(embeddings=(embeddings, "r k"), values=(values, "b n v"))
        kernel = embeddings.t().reshape(1, s["k"], 1, s["r"])  # g=1 k u=1 r
        vals = values.transpose(1, 2).reshape(s["b"], 1, s["v"], 1, s["n"])  # b g v u n
    else:
        s = _bind(embeddings=(embeddings, "r k u"), values=(values, "b n v u"))
        kernel = embeddings.permute(1, 2, 0).unsqueeze(0)  # g=1 k u r
        vals = values.permute(0, 2, 3, 1).unsqueeze(1)  # b g=1 v u n
    if s["r"] % 2 == 0:
        raise ValueError(f"embeddings must have an odd scope size r for impl={impl!r}, got r={s['r']}")
    lam = position_lambdas(vals, kernel, center=(s["r"] // 2,), impl=impl)  # b 1 v k n
    return lam[:, 0].permute(0, 3, 2, 1)  # b n k v


def masked_lambda_layer(
    queries: Tensor, normalized_keys: Tensor, embeddings: Tensor, values: Tensor, mask: Tensor
) -> Tensor:
    """Masked multi-query lambda layer, Fig. 6: query ``n`` only sees the context positions ``m``
    with ``mask[n, m] == 1``; each query gets its own content lambda.

    Args:
        queries: ``[b, h, n, k]``.
        normalized_keys: ``[b, m, k]``, already normalised over each query's context (for a causal
            mask use :func:`causal_content_lambdas`, which normalises per query with cumulative sums).
        embeddings: ``[k, n, m]``.
        values: ``[b, m, v]``.
        mask: ``[n, m]`` of zeros and ones.

    Returns:
        ``[b, n, h * v]``.
    """
    s = _bind(
        queries=(queries, "b h n k"),
        normalized_keys=(normalized_keys, "b m k"),
        embeddings=(embeddings, "k n m"),
        values=(values, "b m v"),
        mask=(mask, "n m"),
    )
    mask = mask.to(values.dtype)
    content_mu = torch.einsum("bmk,bmv->bmkv", normalized_keys, values)  # b m k v
    content_lambdas = torch.einsum("bmkv,nm->bnkv", content_mu, mask)  # b n k v
    embeddings = torch.einsum("knm,nm->knm", embeddings, mask)  # k n m, masked
    position_lambdas = torch.einsum("knm,bmv->bnkv", embeddings, values)  # b n k v
    content_output = torch.einsum("bhnk,bnkv->bnhv", queries, content_lambdas)  # b n h v
    position_output = torch.einsum("bhnk,bnkv->bnhv", queries, position_lambdas)  # b n h v
    return (content_output + position_output).reshape(s["b"], s["n"], s["h"] * s["v"])  # b n d


def multihead_lambda_layer(queries: Tensor, keys: Tensor, embeddings: Tensor, values: Tensor) -> Tensor:
    """Multi-head lambda layer, Fig. 7: one lambda per head (``h`` times the cost of Fig. 3).

    Args:
        queries: ``[b, h, n, k]``.
        keys: ``[b, h, m, k]`` raw keys (softmax over ``m`` here).
        embeddings: ``[h, n, m, k]``.
        values: ``[b, h, m, v]``.

    Returns:
        ``[b, n, h * v]``.
    """
    s = _bind(
        queries=(queries, "b h n k"),
        keys=(keys, "b h m k"),
        embeddings=(embeddings, "h n m k"),
        values=(values, "b h m v"),
    )
    content_lambda = torch.einsum("bhmk,bhmv->bhkv", keys.softmax(dim=2), values)  # b h k v
    position_lambdas = torch.einsum("hnmk,bhmv->bnhkv", embeddings, values)  # b n h k v
    content_output = torch.einsum("bhnk,bhkv->bnhv", queries, content_lambda)  # b n h v
    position_output = torch.einsum("bhnk,bnhkv->bnhv", queries, position_lambdas)  # b n h v (Fig. 7 typo fixed)
    return (content_output + position_output).reshape(s["b"], s["n"], s["h"] * s["v"])  # b n d
