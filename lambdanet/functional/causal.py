"""Causal (masked, App. B.2) lambdas over sequences: a naive reference, the chunked form and the recurrent step.

Symbols: ``b`` batch, ``n`` positions, ``h`` query heads (multi-query: one lambda serves every head), ``k`` key
depth, ``v`` value depth, ``u`` intra-depth, ``r`` causal local scope (offsets ``j = n - m`` in ``0..r-1``).
Layouts are token-major: ``q [b, n, h, k]``, ``keys [b, n, k, u]``, ``values [b, n, v, u]``, position
embeddings ``emb [r, k, u]`` (``emb[j]`` is the offset ``n - m = j``), output ``[b, n, h, v]``.

Query ``n`` sees the context ``m <= n``; its keys are softmax-normalised over that context only (per key
channel ``(k, u)``), so ``y_n = q_n^T (lambda^c_n + lambda^p_n)`` with

* ``lambda^c_n = sum_u sum_{m<=n} softmax_{m<=n}(K)[m] V[m]^T``, a running ``k x v`` summary per ``u``;
* ``lambda^p_n = sum_u sum_{j<r, j<=n} emb[j] V[n-j]^T``, the last ``r`` values only.

Three forms, equal up to rounding:

* :func:`causal_lambda_reference`: the definition, position by position (tests, float64).
* :func:`causal_lambda`: the chunked form training uses. Inside a chunk of ``C`` positions the content and
  position terms are exact masked ``C x C`` / ``C x (C + r - 1)`` products; across chunks the content summary
  is carried as the state ``(S [b, u, k, v], z [b, u, k], c [b, u, k])``. Time and memory grow linearly
  with ``n`` (no ``n x n`` and no ``b x n x k x v`` tensor); backward recomputes the states chunk by chunk
  instead of storing them.
* :func:`causal_lambda_step`: one position at a time with the same state plus the last ``r - 1`` values,
  whose size does not depend on how long the context is (streaming generation).

Numerics: the softmax over a growing context is kept relative to the running maximum ``c`` of each key
channel (``S = sum_m exp(K[m] - c) V[m]^T``, ``z = sum_m exp(K[m] - c)``); every exponent is ``<= 0`` and
``z >= 1`` for every query, so nothing overflows and no division by a vanishing sum occurs, whatever the
keys' range. The maximum is a constant of the computation (the result does not depend on it), so no
gradient flows through it. Computed in :func:`~lambdanet.helpers.compute_dtype` (float32 for half inputs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lambdanet.helpers import compute_dtype

__all__ = ["causal_lambda_reference", "causal_lambda", "causal_lambda_step", "init_causal_lambda_state",
           "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 64  # positions per chunk of the chunked form (the exact C x C products inside a chunk)
_STATE_KEYS = ("S", "z", "c", "window")
MAX_SPREAD = 30.0  # the fast chunk form's bound on exp(a - cm[n]) (e^30 ~ 1e13, far inside float32's range)


def causal_lambda_reference(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None = None) -> Tensor:
    """App. B.2's masked lambdas as defined, one query position at a time (``Theta(n^2)``; for tests).

    Args:
        q: ``[b, n, h, k]`` queries.
        keys: ``[b, n, k, u]`` raw keys (softmax over positions ``m <= n`` per channel).
        values: ``[b, n, v, u]``.
        emb: ``[r, k, u]`` causal position embeddings (``emb[j]`` for offset ``n - m = j``), or ``None`` for
            content lambdas only.

    Returns:
        ``[b, n, h, v]``.
    """
    out = []
    for n in range(q.shape[1]):
        w = torch.softmax(keys[:, : n + 1], dim=1)  # b m k u
        lam = torch.einsum("bmku,bmvu->bkv", w, values[:, : n + 1])  # b k v
        if emb is not None:
            for j in range(min(emb.shape[0], n + 1)):
                lam = lam + torch.einsum("ku,bvu->bkv", emb[j], values[:, n - j])  # b k v
        out.append(torch.einsum("bhk,bkv->bhv", q[:, n], lam))  # b h v
    return torch.stack(out, dim=1)  # b n h v


def init_causal_lambda_state(batch_size: int, dim_k: int, dim_v: int, dim_u: int = 1, r: int = 0, *,
                             dtype: torch.dtype = torch.float32, device=None) -> dict[str, Tensor]:
    """The empty context's state: ``S [b, u, k, v]``, ``z [b, u, k]`` (zeros), the running key maximum
    ``c [b, u, k]`` (``-inf``) and ``window [b, u, r - 1, v]``, the last ``r - 1`` values (zeros: positions
    before the sequence contribute nothing). Its size does not depend on the context's length."""
    b, k, v, u = batch_size, dim_k, dim_v, dim_u
    kw = {"dtype": dtype, "device": device}
    return {"S": torch.zeros(b, u, k, v, **kw), "z": torch.zeros(b, u, k, **kw),
            "c": torch.full((b, u, k), float("-inf"), **kw), "window": torch.zeros(b, u, max(r - 1, 0), v, **kw)}


def _band(qe: Tensor) -> Tensor:
    """``[..., C, r]`` offset scores (``qe[n, j]`` for context ``n - j``) -> ``[..., C, C + r - 1]`` band matrix
    over the window ``[r - 1 earlier values, C chunk values]``: row ``n`` holds ``qe[n, r-1..0]`` at columns
    ``n..n + r - 1`` (the skew trick: pad each row to ``C + r``, flatten, drop ``C``, re-read as ``C + r - 1``)."""
    *lead, c, r = qe.shape
    padded = torch.nn.functional.pad(qe.flip(-1), (0, c))  # ... C (C + r)
    return padded.flatten(-2)[..., : c * (c + r - 1)].unflatten(-1, (c, c + r - 1))  # ... C (C + r - 1)


def _chunk(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, state: dict[str, Tensor],
           exact: bool = False):
    """One chunk of ``C`` positions after the context summarised by ``state``: ``(y [b, C, h, v], state)``.

    Internal layout: ``q [b, h, C, k]``, ``keys [b, u, C, k]``, ``values [b, u, C, v]``, ``emb [u, r, k]``.
    The weight of context ``m`` for query ``n`` is ``exp(K[m] - cm[n])`` (``cm[n]`` the running maximum);
    the fast form factors it as ``exp(K[m] - a) * exp(a - cm[n])`` with ``a`` the chunk's maximum, a GEMM,
    valid while ``a - cm[n] <= MAX_SPREAD`` (:func:`_spread`); ``exact`` forms the ``C x C x k`` weights."""
    S, z, c, window = state["S"], state["z"], state["c"], state["window"]
    cm = torch.maximum(keys.detach().cummax(dim=2).values, c.unsqueeze(2))  # b u C k: max over m <= n
    causal = torch.ones(keys.shape[2], keys.shape[2], dtype=torch.bool, device=keys.device).tril()  # C C
    decay = torch.exp(c.unsqueeze(2) - cm)  # b u C k: the carried sums' rescaling, <= 1
    if exact:
        logits = keys.unsqueeze(2) - cm.unsqueeze(3)  # b u C(n) C(m) k
        a = torch.exp(logits.masked_fill(~causal[..., None], float("-inf")))  # b u C C k, in [0, 1]
        zn = decay * z.unsqueeze(2) + a.sum(dim=3)  # b u C k, >= 1 (the maximum's own term)
        qz = q.unsqueeze(1) / zn.unsqueeze(2)  # b u h C k
        scores = torch.einsum("buhnk,bunmk->buhnm", qz, a)  # b u h C C
    else:
        top = keys.detach().amax(dim=2, keepdim=True)  # b u 1 k: the chunk's maximum
        kw = torch.exp(keys - top)  # b u C k, <= 1
        lift = torch.exp(top - cm)  # b u C k, <= exp(MAX_SPREAD)
        zn = decay * z.unsqueeze(2) + lift * kw.cumsum(dim=2)  # b u C k, >= 1
        qz = q.unsqueeze(1) / zn.unsqueeze(2)  # b u h C k
        scores = ((qz * lift.unsqueeze(2)) @ kw.unsqueeze(2).transpose(3, 4)).masked_fill(~causal, 0.0)  # b u h C C
    y = scores @ values.unsqueeze(2)  # b u h C v: within the chunk
    y = y + (qz * decay.unsqueeze(2)) @ S.unsqueeze(2)  # b u h C v: the earlier context
    full = torch.cat([window, values], dim=2)  # b u (r - 1 + C) v
    if emb is not None:
        qe = torch.einsum("bhnk,urk->buhnr", q, emb)  # b u h C r
        y = y + _band(qe) @ full.unsqueeze(2)  # b u h C v: the local causal scope
    last = cm[:, :, -1]  # b u k: the new running maximum
    w = torch.exp(keys - last.unsqueeze(2))  # b u C k
    shrink = torch.exp(c - last)  # b u k
    S = shrink.unsqueeze(-1) * S + w.transpose(2, 3) @ values  # b u k v
    z = shrink * z + w.sum(dim=2)  # b u k
    window = full[:, :, full.shape[2] - window.shape[2]:]  # b u (r - 1) v
    return y.sum(dim=1).transpose(1, 2), {"S": S, "z": z, "c": last, "window": window}  # b C h v


def _spread(keys: Tensor, c: Tensor, chunk: int) -> float:
    """The largest ``a - cm[n]`` of any chunk (``a`` the chunk's key maximum, ``cm[n]`` the running one)."""
    n = keys.shape[2]
    cm = torch.maximum(keys.cummax(dim=2).values, c.unsqueeze(2))  # b u n k
    pad = -n % chunk
    top = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf"))  # b u (n + pad) k
    top = top.unflatten(2, (-1, chunk)).amax(dim=3).repeat_interleave(chunk, dim=2)[:, :, :n]  # b u n k
    return (top - cm).amax().item() if n else 0.0


def _prepare(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None):
    """Token-major inputs -> the internal layout of :func:`_chunk`, in the compute dtype."""
    dtype = compute_dtype(q.dtype, keys.dtype, values.dtype, *(() if emb is None else (emb.dtype,)))
    q = q.to(dtype).transpose(1, 2)  # b h n k
    keys = keys.to(dtype).permute(0, 3, 1, 2)  # b u n k
    values = values.to(dtype).permute(0, 3, 1, 2)  # b u n v
    emb = None if emb is None else emb.to(dtype).permute(2, 0, 1)  # u r k
    return q, keys, values, emb


def _check(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None) -> None:
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"q, keys and values must be [b, n, h, k], [b, n, k, u] and [b, n, v, u], got shapes "
                         f"{tuple(q.shape)}, {tuple(keys.shape)} and {tuple(values.shape)}")
    (b, n, _, k), u = q.shape, keys.shape[3]
    if keys.shape[:3] != (b, n, k) or values.shape[:2] != (b, n) or values.shape[3] != u:
        raise ValueError(f"q [b, n, h, k], keys [b, n, k, u] and values [b, n, v, u] disagree: "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if emb is not None and (emb.dim() != 3 or emb.shape[1:] != (k, u) or emb.shape[0] < 1):
        raise ValueError(f"emb must be [r, k={k}, u={u}] with r >= 1, got {tuple(emb.shape)}")


class _ChunkedCausalLambda(torch.autograd.Function):
    """The chunked form; forward keeps only its inputs, backward recomputes each chunk's state."""

    @staticmethod
    def forward(ctx, q, keys, values, emb, chunk, state):
        exact = _spread(keys, state["c"], chunk) > MAX_SPREAD
        ctx.chunk, ctx.state, ctx.exact = chunk, state, exact
        ctx.save_for_backward(q, keys, values, emb)
        ys = []
        for s in range(0, q.shape[2], chunk):
            y, state = _chunk(q[:, :, s:s + chunk], keys[:, :, s:s + chunk], values[:, :, s:s + chunk], emb, state,
                              exact)
            ys.append(y)
        final = tuple(state[key] for key in _STATE_KEYS)
        ctx.mark_non_differentiable(*final)
        return (torch.cat(ys, dim=1),) + final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, *_):
        q, keys, values, emb = ctx.saved_tensors
        chunk, n = ctx.chunk, q.shape[2]
        starts = list(range(0, n, chunk))
        states = [ctx.state]  # the state before each chunk, recomputed (not kept from the forward pass)
        with torch.no_grad():
            for s in starts[:-1]:
                states.append(_chunk(q[:, :, s:s + chunk], keys[:, :, s:s + chunk], values[:, :, s:s + chunk],
                                     emb, states[-1], ctx.exact)[1])
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        demb = None if emb is None else torch.zeros_like(emb)
        dstate = None  # gradient reaching the state after the chunk (from the later chunks)
        for s, before in zip(reversed(starts), reversed(states)):
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (q[:, :, s:s + chunk], keys[:, :, s:s + chunk],
                                                                 values[:, :, s:s + chunk])]
                e = None if emb is None else emb.detach().requires_grad_()
                carried = {key: t.detach().requires_grad_(key != "c") for key, t in before.items()}
                y, after = _chunk(*inputs, e, carried, ctx.exact)
                outs, grads = [y], [dy[:, s:s + chunk]]
                if dstate is not None:
                    for key in ("S", "z", "window"):
                        outs.append(after[key])
                        grads.append(dstate[key])
                wrt = inputs + [carried["S"], carried["z"], carried["window"]] + ([] if e is None else [e])
                g = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
            for acc, gi in zip((dq, dk, dv), g[:3]):
                if gi is not None:
                    acc[:, :, s:s + chunk] += gi
            dstate = {key: torch.zeros_like(carried[key]) if gi is None else gi
                      for key, gi in zip(("S", "z", "window"), g[3:6])}
            if e is not None and g[6] is not None:
                demb += g[6]
        return dq, dk, dv, demb, None, None


def causal_lambda(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None = None, *,
                  chunk: int = DEFAULT_CHUNK, state: dict[str, Tensor] | None = None,
                  return_state: bool = False):
    """Causal lambdas over a sequence in the chunked form (linear in ``n``; see the module docstring).

    Args:
        q: ``[b, n, h, k]`` queries.
        keys: ``[b, n, k, u]`` raw keys.
        values: ``[b, n, v, u]``.
        emb: ``[r, k, u]`` causal position embeddings (offset ``n - m = j`` at ``emb[j]``), or ``None``.
        chunk: positions per chunk (the last chunk may be shorter).
        state: the context before ``q[:, 0]`` (:func:`init_causal_lambda_state`, or a returned state); ``None``:
            an empty context. The state itself receives no gradient.
        return_state: also return the state after the last position (to continue with
            :func:`causal_lambda_step` or another call).

    Returns:
        ``[b, n, h, v]`` in the compute dtype (float32 for half inputs), and the state if ``return_state``.
    """
    _check(q, keys, values, emb)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    q, keys, values, emb = _prepare(q, keys, values, emb)
    if state is None:
        state = init_causal_lambda_state(q.shape[0], q.shape[3], values.shape[3], keys.shape[1],
                                         0 if emb is None else emb.shape[1], dtype=q.dtype, device=q.device)
    state = {key: t.detach().to(q.dtype) for key, t in state.items()}
    y, *final = _ChunkedCausalLambda.apply(q, keys, values, emb, chunk, state)
    return (y, dict(zip(_STATE_KEYS, final))) if return_state else y


def causal_lambda_step(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None,
                       state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One position after the context ``state`` summarises: ``q [b, h, k]``, ``keys [b, k, u]``,
    ``values [b, v, u]`` -> ``(y [b, h, v], new state)``; the state's size never changes."""
    y, state = _chunk(*_prepare(q.unsqueeze(1), keys.unsqueeze(1), values.unsqueeze(1), emb), state)
    return y[:, 0], state
