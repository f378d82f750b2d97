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
  position terms are one exact masked ``C x (r - 1 + C)`` product over the chunk and the ``r - 1`` values
  before it; across chunks the content summary is carried as the state ``(S [b, u, k, v], z [b, u, k],
  c [b, u, k])``. Every chunk is computed at once except that state, a scan over the ``n / C`` chunks. Time and
  memory grow linearly with ``n`` (no ``n x n`` and no ``b x n x k x v`` tensor); backward recomputes the
  states and products instead of storing them.
* :func:`causal_lambda_step`: one position at a time with the same state plus the last ``r - 1`` values,
  whose size does not depend on how long the context is (streaming generation).

Numerics: the softmax over a growing context is kept relative to the running maximum ``c`` of each key
channel (``S = sum_m exp(K[m] - c) V[m]^T``, ``z = sum_m exp(K[m] - c)``); every exponent is ``<= 0`` and
``z >= 1`` for every query, so nothing overflows and no division by a vanishing sum occurs, whatever the
keys' range. The maximum is a constant of the computation (the result does not depend on it), so no
gradient flows through it. Computed in :func:`~lambdanet.helpers.compute_dtype` (float32 for half inputs).
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from lambdanet.helpers import compute_dtype, functorch_active, host_readable, in_graph, leave_autocast, no_autocast

__all__ = [
    "causal_lambda_reference",
    "causal_lambda",
    "causal_lambda_step",
    "init_causal_lambda_state",
    "check_state",
    "check_state_shapes",
    "DEFAULT_CHUNK",
]

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
    dtype = q.dtype
    for t in (keys, values) + (() if emb is None else (emb,)):
        dtype = torch.promote_types(dtype, t.dtype)  # mixed inputs: promoted, as the other modes do
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    emb = None if emb is None else emb.to(dtype)
    out = []
    for n in range(q.shape[1]):
        w = torch.softmax(keys[:, : n + 1], dim=1)  # b m k u
        lam = torch.einsum("bmku,bmvu->bkv", w, values[:, : n + 1])  # b k v
        if emb is not None:
            for j in range(min(emb.shape[0], n + 1)):
                lam = lam + torch.einsum("ku,bvu->bkv", emb[j], values[:, n - j])  # b k v
        out.append(torch.einsum("bhk,bkv->bhv", q[:, n], lam))  # b h v
    if not out:  # an empty sequence
        link = sum((t.sum() for t in (q, keys, values) + (() if emb is None else (emb,))), q.new_zeros(()))
        return q.new_zeros(q.shape[0], 0, q.shape[2], values.shape[2]) + 0 * link  # b 0 h v, in the graph
    return torch.stack(out, dim=1)  # b n h v


def init_causal_lambda_state(
    batch_size: int,
    dim_k: int,
    dim_v: int,
    dim_u: int = 1,
    r: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict[str, Tensor]:
    """The empty context's state: ``S [b, u, k, v]``, ``z [b, u, k]`` (zeros), the running key maximum
    ``c [b, u, k]`` (``-inf``) and ``window [b, u, r - 1, v]``, the last ``r - 1`` values (zeros: positions
    before the sequence contribute nothing). Its size does not depend on the context's length."""
    b, k, v, u = batch_size, dim_k, dim_v, dim_u
    kw = {"dtype": dtype, "device": device}
    return {
        "S": torch.zeros(b, u, k, v, **kw),
        "z": torch.zeros(b, u, k, **kw),
        "c": torch.full((b, u, k), float("-inf"), **kw),
        "window": torch.zeros(b, u, max(r - 1, 0), v, **kw),
    }


def check_state(state: dict[str, Tensor], q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None) -> None:
    """A one-line ``ValueError`` unless ``state`` (:func:`init_causal_lambda_state`'s keys) is the context of a
    call on ``q [b, n, h, k]``, ``keys [b, n, k, u]``, ``values [b, n, v, u]`` and ``emb [r, k, u]`` (shapes only:
    nothing is read from the device)."""
    (b, _, _, k), u, v = q.shape, keys.shape[3], values.shape[2]
    r = 0 if emb is None else emb.shape[0]
    want = {"S": (b, u, k, v), "z": (b, u, k), "c": (b, u, k), "window": (b, u, max(r - 1, 0), v)}
    check_state_shapes(state, want, "initial_state must be a dict with keys {keys} (a returned state)",
                       "initial_state does not fit this call (b={b}, u={u}, k={k}, v={v}, r={r})",
                       device=q.device, b=b, u=u, k=k, v=v, r=r)  # fmt: skip


def check_state_shapes(state: dict[str, Tensor], want: dict[str, tuple[int, ...]], missing: str, misfit: str,
                       device: torch.device | None = None, **fields: object) -> None:  # fmt: skip
    """A one-line ``ValueError`` unless ``state`` is a dict with ``want``'s keys and shapes, each a floating-point
    tensor (on ``device`` where given): ``missing`` (with ``{keys}``, the keys wanted) or ``misfit`` (formatted with
    ``fields``, what differs follows), formatted only when raised (generation checks its state every step)."""
    if not isinstance(state, dict) or set(want) - set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{missing.format(keys=sorted(want), **fields)}, got {got}")
    for key in want:
        t = state[key]
        if not isinstance(t, Tensor) or not t.is_floating_point() or device is not None and t.device != device:
            found = f"a {t.dtype} tensor on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            where = f" on {device}" if device is not None else ""
            raise ValueError(f"{misfit.format(**fields)}: {key} must be a floating-point tensor{where}, got {found}")
    bad = [f"{key} {tuple(state[key].shape)} (expected {want[key]})" for key in want
           if tuple(state[key].shape) != want[key]]  # fmt: skip
    if bad:
        raise ValueError(f"{misfit.format(**fields)}: " + ", ".join(bad))


def _band(scores: Tensor | None, qe: Tensor) -> Tensor:
    """Content scores ``[..., C, C]`` and offset scores ``qe [..., C, r]`` (``qe[n, j]`` for context ``n - j``) ->
    one ``[..., C, r - 1 + C]`` matrix over the window ``[r - 1 earlier values, C chunk values]``: the content
    scores fill the last ``C`` columns, ``qe[n, j]`` is added at column ``n + r - 1 - j``; ``scores=None``: the
    offset scores alone (position lambdas without content)."""
    *lead, c, r = qe.shape
    padded = torch.nn.functional.pad(qe.flip(-1), (0, c))  # ... C (C + r): the skew trick, row n shifted by n
    band = padded.flatten(-2)[..., : c * (c + r - 1)].unflatten(-1, (c, c + r - 1))  # ... C (r - 1 + C)
    if scores is None:
        return band
    return torch.cat([band[..., : r - 1], band[..., r - 1 :] + scores], dim=-1)  # ... C (r - 1 + C)


class _Scan(torch.autograd.Function):
    """``T_{i+1} = d_i T_i + B_i`` over the chunk axis ``i`` (``d`` a constant): ``(d [..., N, k, 1],
    B [..., N, k, w], T_0 [..., k, w])`` -> ``(T_0..T_{N-1} [..., N, k, w], T_N)``; one fused op per chunk forward
    and backward, and the reverse scan ``g_i = dT_i + d_i g_{i+1}`` for the gradient."""

    @staticmethod
    def forward(ctx, d, B, T):
        out = torch.empty_like(B)  # ... N k w
        for i in range(B.shape[-3]):
            out[..., i, :, :] = T
            T = torch.addcmul(B[..., i, :, :], d[..., i, :, :], T)  # ... k w
        ctx.save_for_backward(d)
        return out, T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, g):
        (d,) = ctx.saved_tensors
        dB = torch.empty_like(dout)  # ... N k w
        for i in reversed(range(dout.shape[-3])):
            dB[..., i, :, :] = g
            g = torch.addcmul(dout[..., i, :, :], d[..., i, :, :], g)  # ... k w
        return None, dB, g


def _scan_plain(d: Tensor, B: Tensor, T: Tensor) -> tuple[Tensor, Tensor]:
    """:class:`_Scan` in plain differentiable ops (for traces and ``torch.func`` transforms, which take no Python
    Function without ``setup_context``): the same recurrence, its gradient by autograd."""
    out = []
    for i in range(B.shape[-3]):
        out.append(T)
        T = torch.addcmul(B[..., i, :, :], d[..., i, :, :], T)  # ... k w
    return torch.stack(out, dim=-3) if out else torch.empty_like(B), T


def _chunks(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    emb: Tensor | None,
    state: dict[str, Tensor],
    chunk: int,
):
    """``N = n / C`` chunks of ``C`` positions at once after the context ``state`` summarises: ``(y [b, n, h, v],
    state)``; ``n`` a multiple of ``C``.

    Internal layout: ``q [b, h, n, k]``, ``keys [b, u, n, k]``, ``values [b, u, n, v]``, ``emb [u, r, k]``; per
    chunk ``i``: ``c_i`` the running key maximum before it, ``a_i`` its own maximum. The weight of context ``m``
    for query ``n`` is ``exp(K[m] - cm[n])`` (``cm[n]`` the running maximum). Only the states before each chunk
    (``S_i, z_i`` relative to ``c_i``) are a scan over chunks; everything else is batched over them. Inside a chunk
    the fast form factors the weight as ``exp(K[m] - a_i) * exp(a_i - cm[n])``, a GEMM, valid while
    ``a_i - cm[n] <= MAX_SPREAD``; beyond that (any chunk), the exact form builds the ``C x C x k`` weights. The
    choice depends on the inputs only, so the backward pass's recomputation makes the same one."""
    S, z, c, window = state["S"], state["z"], state["c"], state["window"]
    (b, h, n, k), u, v, C = q.shape, keys.shape[1], values.shape[3], chunk
    N = n // C
    cm = torch.maximum(keys.detach().cummax(dim=2).values, c.unsqueeze(2)).unflatten(2, (N, C))  # b u N C k
    keys, vals = keys.unflatten(2, (N, C)), values.unflatten(2, (N, C))  # b u N C k, b u N C v
    qc = q.unflatten(2, (N, C)).transpose(1, 2).unsqueeze(1)  # b 1 N h C k
    before = torch.cat([c.unsqueeze(2), cm[:, :, :-1, -1]], dim=2)  # b u N k: c_i
    after = cm[:, :, :, -1]  # b u N k: c_{i+1}
    top = keys.detach().amax(dim=3)  # b u N k: a_i
    kw = torch.exp(keys - top.unsqueeze(3))  # b u N C k, <= 1
    decay = torch.exp(before.unsqueeze(3) - cm)  # b u N C k: the carried sums' rescaling, <= 1
    # the scan: S_{i+1} = exp(c_i - c_{i+1}) S_i + exp(a_i - c_{i+1}) sum_{m in i} exp(K[m] - a_i) V[m]^T
    shrink, grow = torch.exp(before - after), torch.exp(top - after)  # b u N k, <= 1
    local = kw.transpose(3, 4) @ vals  # b u N k v
    local = torch.cat([local, kw.sum(dim=3).unsqueeze(-1)], dim=-1)  # b u N k (v + 1): [S | z] of the chunk
    carried = torch.cat([S, z.unsqueeze(-1)], dim=-1)  # b u k (v + 1)
    # a trace saves no Python Function and torch.func takes none without setup_context; torch.compile takes it
    scan = _scan_plain if torch.jit.is_tracing() or functorch_active() else _Scan.apply
    Sz, last = scan(shrink.unsqueeze(-1), grow.unsqueeze(-1) * local, carried)  # b u N k (v+1), b u k (v+1)
    Ss, zs, S, z = Sz[..., :v], Sz[..., v], last[..., :v], last[..., v]  # the states before each chunk; after all
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # C C
    # exact where exp(a_i - cm[n]) could overflow, and always in a graph, a torch.func transform or on meta / fake
    # tensors (no host read)
    if in_graph() or not host_readable(top) or (top.unsqueeze(3) - cm).amax().item() > MAX_SPREAD:
        a = torch.exp((keys.unsqueeze(3) - cm.unsqueeze(4)).masked_fill(~causal[..., None], float("-inf")))
        zn = decay * zs.unsqueeze(3) + a.sum(dim=4)  # b u N C k, >= 1 (the maximum's own term); a: b u N C C k
        qz = qc / zn.unsqueeze(3)  # b u N h C k
        scores = torch.einsum("buihnk,buinmk->buihnm", qz, a)  # b u N h C C
    else:
        lift = torch.exp(top.unsqueeze(3) - cm)  # b u N C k, <= exp(MAX_SPREAD)
        zn = decay * zs.unsqueeze(3) + lift * kw.cumsum(dim=3)  # b u N C k, >= 1
        qz = qc / zn.unsqueeze(3)  # b u N h C k
        scores = ((qz * lift.unsqueeze(3)) @ kw.unsqueeze(3).transpose(4, 5)).masked_fill(~causal, 0.0)  # b u N h C C
    y = (qz * decay.unsqueeze(3)).flatten(3, 4) @ Ss  # b u N (h C) v: the earlier chunks
    full = torch.cat([window, values], dim=2)  # b u (r - 1 + n) v
    if emb is None:
        y = y + scores.flatten(3, 4) @ vals  # b u N (h C) v: within the chunk
    else:
        r = emb.shape[1]
        qe = (qc.reshape(-1, k) @ emb.permute(2, 0, 1).reshape(k, u * r)).unflatten(-1, (u, r))  # (b N h C) u r
        qe = qe.unflatten(0, (b, N, h, C)).permute(0, 4, 1, 2, 3, 5)  # b u N h C r
        scores = _band(scores, qe)  # b u N h C (r - 1 + C)
        windows = full.unfold(2, C + r - 1, C).transpose(3, 4)  # b u N (r - 1 + C) v
        y = y + scores.flatten(3, 4) @ windows  # b u N (h C) v: within the chunk and the local scope
    y = y.sum(dim=1).unflatten(2, (h, C)).transpose(2, 3).reshape(b, n, h, v)  # b n h v
    window = full[:, :, full.shape[2] - window.shape[2] :]  # b u (r - 1) v
    return y, {"S": S, "z": z, "c": cm[:, :, -1, -1], "window": window}


def _run(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, state: dict[str, Tensor], chunk: int):
    """The whole sequence: its full chunks at once, then the shorter last chunk (if any)."""
    n = q.shape[2]
    if n == 0 or q.shape[0] == 0:  # nothing to attend (and no maximum to read): the state is unchanged
        return q.new_zeros(q.shape[0], n, q.shape[1], values.shape[3]), state
    body, ys = n - n % chunk, []
    for s, e, c in ((0, body, chunk), (body, n, n - body)):
        if e > s:
            y, state = _chunks(q[:, :, s:e], keys[:, :, s:e], values[:, :, s:e], emb, state, c)
            ys.append(y)
    return (torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]), state


def _prepare(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None):
    """Token-major inputs -> the internal layout of :func:`_chunks`, in the compute dtype."""
    dtype = compute_dtype(q.dtype, keys.dtype, values.dtype, *(() if emb is None else (emb.dtype,)))
    q = q.to(dtype).transpose(1, 2)  # b h n k
    keys = keys.to(dtype).permute(0, 3, 1, 2)  # b u n k
    values = values.to(dtype).permute(0, 3, 1, 2)  # b u n v
    if emb is not None:  # u r k; for u = 1 a reshape, whose backward gives the parameter's own strides (a permute's
        # put a stride on the size-1 axis: DistributedDataParallel warned on every step)
        emb = emb.to(dtype)
        emb = emb.reshape(1, *emb.shape[:2]) if emb.shape[2] == 1 else emb.permute(2, 0, 1)  # u r k
    return q, keys, values, emb


def _check(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None) -> None:
    for name, t in (("q", q), ("k", keys), ("v", values), ("emb", emb)):
        if t is None and name == "emb":
            continue
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating-point tensor{' or None' if name == 'emb' else ''}, got {got}")
    if q.dim() != 4 or keys.dim() != 4 or values.dim() != 4:
        raise ValueError(
            f"q, k and v must be [b, n, h, k], [b, n, k, u] and [b, n, v, u], got shapes "
            f"{tuple(q.shape)}, {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    (b, n, _, k), u = q.shape, keys.shape[3]
    if keys.shape[:3] != (b, n, k) or values.shape[:2] != (b, n) or values.shape[3] != u:
        raise ValueError(
            f"q [b, n, h, k], k [b, n, k, u] and v [b, n, v, u] disagree: "
            f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if emb is not None and (emb.dim() != 3 or emb.shape[1:] != (k, u) or emb.shape[0] < 1):
        raise ValueError(f"emb must be [r, k={k}, u={u}] with r >= 1, got {tuple(emb.shape)}")


class _ChunkedCausalLambda(torch.autograd.Function):
    """The chunked form; forward keeps only its inputs, backward recomputes the chunk states and products."""

    @staticmethod
    def forward(ctx, q, keys, values, emb, chunk, state):
        ctx.chunk, ctx.state = chunk, state
        ctx.save_for_backward(q, keys, values, emb)
        y, state = _run(q, keys, values, emb, state, chunk)
        final = tuple(state[key] for key in _STATE_KEYS)
        ctx.mark_non_differentiable(*final)
        return (y,) + final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, *_):
        inputs = [None if t is None else t.detach().requires_grad_() for t in ctx.saved_tensors]
        if dy.numel() == 0:  # an empty sequence or batch: no term, no gradient
            return (*(None if t is None else torch.zeros_like(t) for t in inputs), None, None)
        with torch.enable_grad(), no_autocast(dy.device.type):  # float32 (the compute dtype) as the forward
            y, _ = _run(*inputs, ctx.state, ctx.chunk)
            wrt = [t for t in inputs if t is not None]
            grads = iter(torch.autograd.grad(y, wrt, dy, allow_unused=True))
        return (*(None if t is None else next(grads) for t in inputs), None, None)


@overload
def causal_lambda(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    emb: Tensor | None = None,
    *,
    chunk: int = ...,
    state: dict[str, Tensor] | None = None,
    return_state: Literal[False] = False,
) -> Tensor: ...


@overload
def causal_lambda(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    emb: Tensor | None = None,
    *,
    chunk: int = ...,
    state: dict[str, Tensor] | None = None,
    return_state: Literal[True],
) -> tuple[Tensor, dict[str, Tensor]]: ...


def causal_lambda(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    emb: Tensor | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    state: dict[str, Tensor] | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
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
    if state is not None:
        check_state(state, q, keys, values, emb)
    with leave_autocast(q.device.type):  # the compute dtype's products, also under autocast (fp16 would overflow)
        return _causal_lambda(q, keys, values, emb, chunk, state, return_state)


def _causal_lambda(
    q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, chunk: int, state: dict[str, Tensor] | None,
    return_state: bool,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    q, keys, values, emb = _prepare(q, keys, values, emb)
    if state is None:
        state = init_causal_lambda_state(
            q.shape[0],
            q.shape[3],
            values.shape[3],
            keys.shape[1],
            0 if emb is None else emb.shape[1],
            dtype=q.dtype,
            device=q.device,
        )
    state = {key: t.detach().to(q.dtype) for key, t in state.items()}
    if in_graph():  # the graph's own autograd (the Function's recomputing
        # backward calls autograd.grad; torch.func takes no Function without setup_context, a trace saves none)
        y, out = _run(q, keys, values, emb, state, chunk)
        final = [out[key].detach() for key in _STATE_KEYS]
    else:
        y, *final = _ChunkedCausalLambda.apply(q, keys, values, emb, chunk, state)
    return (y, dict(zip(_STATE_KEYS, final))) if return_state else y


def causal_lambda_step(
    q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, state: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """One position after the context ``state`` summarises: ``q [b, h, k]``, ``keys [b, k, u]``,
    ``values [b, v, u]`` -> ``(y [b, h, v], new state)``; the state's size never changes (the recurrence the
    chunked form carries between chunks, one position at a time)."""
    q, keys, values, emb = _prepare(q.unsqueeze(1), keys.unsqueeze(1), values.unsqueeze(1), emb)
    q, keys, values = q[:, :, 0].unsqueeze(1), keys[:, :, 0], values[:, :, 0]  # b 1 h k, b u k, b u v
    S, z, c, window = state["S"], state["z"], state["c"], state["window"]
    top = torch.maximum(c, keys)  # b u k: the new running maximum
    shrink, w = torch.exp(c - top), torch.exp(keys - top)  # b u k, <= 1
    S = shrink.unsqueeze(-1) * S + w.unsqueeze(-1) * values.unsqueeze(2)  # b u k v
    z = shrink * z + w  # b u k, >= 1
    y = (q / z.unsqueeze(2)) @ S  # b u h v
    full = torch.cat([window, values.unsqueeze(2)], dim=2)  # b u r v: oldest first, this position last
    if emb is not None:
        y = y + (q @ emb.flip(1).transpose(1, 2)) @ full  # b u h v
    return y.sum(dim=1), {"S": S, "z": z, "c": top, "window": full[:, :, 1:]}  # b h v
