"""The two terms of the causal lambda apart, chunked, in PyTorch ops (see the package docstring).

Inside a chunk of ``C`` positions each term is one exact masked product; across chunks the content term carries
``(S, ss)`` and the position term the last ``r - 1`` values. The chunks run in a Python loop (``n / C``
iterations, static shapes: ``torch.compile`` unrolls it), and autograd differentiates the ops as they are.
Computed in :func:`~lambdanet.helpers.compute_dtype` (float32 for half inputs), the dtype of the outputs and
states (a layer adds the two terms before it rounds to its own dtype)."""

from __future__ import annotations

import torch
from torch import Tensor

from lambdanet.functional.causal import _band, _check, check_state_shapes
from lambdanet.helpers import check_choice, compute_dtype
from lambdanet.ops.lambda_terms.naive import L2_EPS

__all__ = ["KEY_NORMS", "content_lambda", "position_lambda", "init_content_state", "init_position_state"]

KEY_NORMS = ("softmax", "l2", "none")  # "softmax": the fused op's (lambdanet.ops.causal_lambda); the others here
DEFAULT_CHUNK = 64


def init_content_state(batch_size: int, dim_k: int, dim_v: int, dim_u: int = 1, *, dtype=torch.float32,
                       device=None) -> dict[str, Tensor]:  # fmt: skip
    """The empty context's content state: ``S [b, u, k, v]`` and ``ss [b, u, k]``, zeros."""
    kw = {"dtype": dtype, "device": device}
    return {"S": torch.zeros(batch_size, dim_u, dim_k, dim_v, **kw), "ss": torch.zeros(batch_size, dim_u, dim_k, **kw)}


def init_position_state(batch_size: int, dim_v: int, dim_u: int, r: int, *, dtype=torch.float32,
                        device=None) -> dict[str, Tensor]:  # fmt: skip
    """The empty context's position state: ``window [b, u, r - 1, v]``, zeros (nothing before the sequence)."""
    return {"window": torch.zeros(batch_size, dim_u, max(r - 1, 0), dim_v, dtype=dtype, device=device)}


def _chunk_size(chunk_size: int | None) -> int:
    chunk = DEFAULT_CHUNK if chunk_size is None else chunk_size
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk


def content_lambda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_norm: str = "l2",
    chunk_size: int | None = None,
    initial_state: dict[str, Tensor] | None = None,
    output_final_state: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """The content term with the keys normalised over the prefix by ``key_norm`` ``"l2"`` or ``"none"``
    (:func:`~lambdanet.ops.lambda_terms.naive.naive_content_lambda` is its definition): ``q [b, n, h, k]``, raw
    ``k [b, n, k, u]``, ``v [b, n, v, u]`` -> ``[b, n, h, v]`` (and the final state).

    Both normalisations divide channel ``(k, u)`` by a number of the prefix alone (``||K[:n+1]||_2``, or 1), so
    the division moves onto the query, ``o_n = sum_u (q_n / d_n) (sum_{m<=n} K[m] V[m]^T)``: causal linear
    attention with per-channel scaled queries, carried as ``S = sum K V^T`` and ``ss = sum K^2``."""
    check_choice(key_norm, "key_norm", KEY_NORMS[1:])
    _check(q, k, v, None)
    C = _chunk_size(chunk_size)
    dtype = compute_dtype(q.dtype, k.dtype, v.dtype)
    (b, n, h, dk), u, dv = q.shape, k.shape[3], v.shape[2]
    if initial_state is not None:
        check_state_shapes(initial_state, {"S": (b, u, dk, dv), "ss": (b, u, dk)},
                           "initial_state must be a dict with keys {keys} (init_content_state, or a returned state)",
                           "initial_state does not fit this call (b={b}, u={u}, k={k}, v={v})", device=q.device,
                           b=b, u=u, k=dk, v=dv)  # fmt: skip
    q = q.to(dtype).transpose(1, 2)  # b h n k
    keys, values = k.to(dtype).permute(0, 3, 1, 2), v.to(dtype).permute(0, 3, 1, 2)  # b u n k, b u n v
    state = initial_state or init_content_state(b, dk, dv, u, dtype=dtype, device=q.device)
    S, ss = state["S"].detach().to(dtype), state["ss"].detach().to(dtype)  # b u k v, b u k
    ys = []
    for s in range(0, n, C):
        qc, kc, vc = q[:, :, s : s + C].unsqueeze(1), keys[:, :, s : s + C], values[:, :, s : s + C]  # b 1 h c k, ..
        sq = ss.unsqueeze(2) + (kc * kc).cumsum(dim=2)  # b u c k: the prefix's sum of squares at each position
        if key_norm == "l2":  # clamped before the root: a zero prefix divides by eps, with a zero gradient
            qc = qc * sq.clamp_min(L2_EPS**2).rsqrt().unsqueeze(2)  # b u h c k
        causal = torch.ones(kc.shape[2], kc.shape[2], dtype=torch.bool, device=q.device).tril()  # c c
        scores = (qc @ kc.unsqueeze(2).transpose(-1, -2)).masked_fill(~causal, 0.0)  # b u h c c
        y = qc @ S.unsqueeze(2) + scores @ vc.unsqueeze(2)  # b u h c v: the earlier chunks, this chunk
        ys.append(y.sum(dim=1))  # b h c v
        S, ss = S + kc.transpose(-1, -2) @ vc, sq[:, :, -1]  # b u k v, b u k
    o = torch.cat(ys, dim=2).transpose(1, 2) if ys else q.new_zeros(b, 0, h, dv)  # b n h v
    return (o, {"S": S, "ss": ss}) if output_final_state else o


def position_lambda(
    q: Tensor,
    v: Tensor,
    emb: Tensor,
    *,
    chunk_size: int | None = None,
    initial_state: dict[str, Tensor] | None = None,
    output_final_state: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """The position lambdas alone (:func:`~lambdanet.ops.lambda_terms.naive.naive_position_lambda` is their
    definition): ``q [b, n, h, k]``, ``v [b, n, v, u]``, ``emb [r, k, u]`` -> ``[b, n, h, v]`` (and the final
    state). Per chunk, one banded ``C x (r - 1 + C)`` product over the chunk's values and the ``r - 1`` before."""
    if q.dim() != 4 or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q and v must be [b, n, h, k] and [b, n, v, u], got {tuple(q.shape)} and {tuple(v.shape)}")
    (b, n, h, dk), dv = q.shape, v.shape[2]
    if emb is None or emb.dim() != 3 or emb.shape[0] < 1 or emb.shape[1:] != (dk, v.shape[3]):
        got = None if emb is None else tuple(emb.shape)
        raise ValueError(f"emb must be [r, k={dk}, u={v.shape[3]}] with r >= 1, got {got}")
    C = _chunk_size(chunk_size)
    dtype = compute_dtype(q.dtype, v.dtype, emb.dtype)
    r, u = emb.shape[0], emb.shape[2]
    if initial_state is not None:
        check_state_shapes(initial_state, {"window": (b, u, max(r - 1, 0), dv)},
                           "initial_state must be a dict with keys {keys} (init_position_state, or a returned state)",
                           "initial_state does not fit this call (b={b}, u={u}, v={v}, r={r})", device=q.device,
                           b=b, u=u, v=dv, r=r)  # fmt: skip
    q, values, e = q.to(dtype).transpose(1, 2), v.to(dtype).permute(0, 3, 1, 2), emb.to(dtype).permute(2, 0, 1)
    window = (initial_state or init_position_state(b, dv, u, r, dtype=dtype, device=q.device))["window"]
    full = torch.cat([window.detach().to(dtype), values], dim=2)  # b u (r - 1 + n) v
    ys = []
    for s in range(0, n, C):
        qc = q[:, :, s : s + C]  # b h c k
        qe = torch.einsum("bhck,urk->buhcr", qc, e)  # b u h c r: qe[n, j] for the value at offset j
        band = _band(None, qe)  # b u h c (r - 1 + c)
        ys.append((band @ full[:, :, s : s + qc.shape[2] + r - 1].unsqueeze(2)).sum(dim=1))  # b h c v
    o = torch.cat(ys, dim=2).transpose(1, 2) if ys else q.new_zeros(b, 0, h, dv)  # b n h v
    return (o, {"window": full[:, :, full.shape[2] - (r - 1) :]}) if output_final_state else o
