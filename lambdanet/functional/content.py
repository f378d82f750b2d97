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
    """Per-query content lambdas of a causal (masked, App. B.2) layer.

    Query ``n`` sees context ``m <= n``; its keys are normalised over that context only:
    ``lambda^c_n = sum_u (sum_{m<=n} w[m] V[m]^T) / Z_n`` with ``w = exp(K)`` and ``Z_n = sum_{m<=n} w[m]`` for the
    softmax (``w = K``, ``Z_n = ||K[:n+1]||_2`` for L2; ``w = K``, no ``Z`` for none). The softmax is taken
    against each query's own running maximum ``c_n = max_{m<=n} K[m]`` (:func:`_prefix_softmax_sums`), never a
    later key: a key far above the earlier ones cannot underflow their weights (nor reach them). No ``n x m``
    tensor is formed: memory ``Theta(b n g k u (v + C))`` for chunks of ``C >= 32`` positions (``C ~ (2 n)^(1/3)``
    beyond 16k), computed in float32 or wider.

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
    z: Tensor | None
    if method == "softmax":
        num, z = _prefix_softmax_sums(keys, values)  # b n g k u v, b n g k u
        z = z.clamp_min(torch.finfo(dtype).tiny)  # 0 only before any finite key: those lambdas are 0
    else:
        num = torch.einsum("bngku,bngvu->bngkuv", keys, values).cumsum(dim=1)  # b n g k u v
        z = keys.square().cumsum(dim=1).sqrt().clamp_min(1e-12) if method == "l2" else None  # b n g k u
    if z is not None:
        num = num / z.unsqueeze(-1)
    return num.sum(dim=4)  # b n g k v


def _prefix_softmax_sums(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum_{m<=n} exp(K[m] - c_n) V[m]^T, sum_{m<=n} exp(K[m] - c_n))`` (``[b, n, g, k, u, v]``,
    ``[b, n, g, k, u]``) with ``c_n`` the running maximum of the keys (detached: the shift cancels in the ratio).
    Every exponent is <= 0 and ``Z_n >= 1``, whatever the keys' spread. Chunks of ``C`` positions: within one, the
    ``C x C`` masked weights ``exp(K[m] - c_n)``; across them, each chunk's sums relative to the maximum at its
    end, carried to a later chunk by the ``N x N`` masked factors between those maxima (``N = n / C``), then to
    each query by ``exp(c_before - c_n)``."""
    b, n, g, k, u = (int(d) for d in keys.shape)  # ints also where a tracer hands over 0-d tensors
    v = int(values.shape[3])
    C = 32  # positions per chunk: the C x C weights take n C, the N x N factors (n / C)^2: C ~ (2 n)^(1/3) at long n
    while C**3 < 2 * n:
        C *= 2
    C = min(C, 1 << max(n - 1, 0).bit_length())  # a short input: one chunk of its own length (a power of two)
    N, pad = -(-n // C), -n % C
    c = keys.detach().cummax(dim=1).values  # b n g k u
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # a prefix of -inf keys (masked padding): weight 0
    if pad:  # padded keys weigh nothing; the maximum stays the last one
        keys = torch.cat([keys, keys.new_full((b, pad, g, k, u), float("-inf"))], dim=1)
        values = torch.cat([values, values.new_zeros(b, pad, g, v, u)], dim=1)
        c = torch.cat([c, c[:, -1:].expand(b, pad, g, k, u)], dim=1)
    K, cc = keys.view(b, N, C, g, k, u), c.view(b, N, C, g, k, u)  # b N C g k u
    V1 = torch.cat([values, values.new_ones(b, N * C, g, 1, u)], dim=3).view(b, N, C, g, v + 1, u)  # Z: the 1s
    later = torch.ones(C, C, dtype=torch.bool, device=keys.device).triu(1)  # [n, m]: m > n
    arg = K[:, :, None] - cc[:, :, :, None]  # b N C(n) C(m) g k u
    intra = torch.einsum("bNnmgku,bNmgvu->bNngkuv", arg.masked_fill(later[:, :, None, None, None], -torch.inf).exp(),
                         V1)  # b N C g k u (v+1)  # fmt: skip
    end = cc[:, :, -1]  # b N g k u: the maximum at each chunk's end
    sums = torch.einsum("bNmgku,bNmgvu->bNgkuv", (K - end[:, :, None]).exp(), V1)  # b N g k u (v+1)
    before = torch.cat([end.new_full(end[:, :1].shape, float("-inf")), end[:, :-1]], dim=1)  # b N g k u
    arg = end[:, None] - before[:, :, None]  # b N(j) N(i) g k u: chunk i's sums carried to chunk j
    carry = torch.ones(N, N, dtype=torch.bool, device=keys.device).tril(-1).logical_not()  # i >= j: none
    carried = torch.einsum("bjigku,bigkuv->bjgkuv", arg.masked_fill(carry[:, :, None, None, None], -torch.inf).exp(),
                           sums)  # b N g k u (v+1)  # fmt: skip
    total = intra + (before[:, :, None] - cc).exp().unsqueeze(-1) * carried[:, :, None]  # b N C g k u (v+1)
    total = total.reshape(b, N * C, g, k, u, v + 1)[:, :n]  # b n g k u (v+1)
    return total[..., :v], total[..., v]


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
