"""The recurrent causal lambda as one Triton launch for a whole call (generation: one launch per layer and token).

One program per ``(b, u)`` stream and value block walks the positions in order with the content state in registers:
``c' = max(c, K_t)``, ``S' = exp(c - c') S + exp(K_t - c') V_t^T``, ``z'`` likewise (every exponent ``<= 0``),
``y_t = (q_t / z') S' + sum_j (q_t . E[j]) V[t - j]`` with ``V[t - j]`` from the sequence or, before it, from the
window state. Forward only (no autograd: a call that needs gradients takes the PyTorch step instead). Float32
states and arithmetic; the output in the inputs' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from lambdanet.ops.causal_lambda.fused_chunk import _pow2
from lambdanet.ops.causal_lambda.triton_chunk import _block_values
from lambdanet.ops.position_lambda.fused import on_device

__all__ = ["fused_recurrent_causal_lambda"]


@triton.jit
def _recurrent(q, keys, values, emb, win, S, z, c, z_out, c_out, y, n, r, H: tl.constexpr, HP: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, U: tl.constexpr, KP: tl.constexpr, JB: tl.constexpr, BV: tl.constexpr,
               HAS_EMB: tl.constexpr):  # fmt: skip
    bu = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    b, u = bu // U, bu % U
    hs, ks, js, vr = tl.arange(0, HP), tl.arange(0, KP), tl.arange(0, JB), tl.arange(0, BV)
    v0 = pv * BV
    hok, kok, vok = hs < H, ks < K, (v0 + vr) < V
    smask = kok[:, None] & vok[None, :]
    St = tl.load(S + (bu * K + ks[:, None]) * V + v0 + vr[None, :], mask=smask, other=0.0)  # KP BV
    zt = tl.load(z + bu * K + ks, mask=kok, other=1.0)
    ct = tl.load(c + bu * K + ks, mask=kok, other=0.0)
    for t in range(n):
        kt = tl.load(keys + ((b * n + t) * K + ks) * U + u, mask=kok, other=0.0).to(tl.float32)  # KP
        vt = tl.load(values + ((b * n + t) * V + v0 + vr) * U + u, mask=vok, other=0.0).to(tl.float32)  # BV
        cn = tl.maximum(ct, kt)
        shrink, w = tl.exp(ct - cn), tl.exp(kt - cn)
        St = shrink[:, None] * St + w[:, None] * vt[None, :]
        zt = shrink * zt + w
        ct = cn
        qt = tl.load(q + ((b * n + t) * H + hs[:, None]) * K + ks[None, :], mask=hok[:, None] & kok[None, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        acc = tl.sum((qt / zt[None, :])[:, :, None] * St[None, :, :], axis=1)  # HP BV
        if HAS_EMB:
            for j0 in range(0, r, JB):  # the position scope in blocks of JB offsets
                jj = j0 + js
                e = tl.load(emb + (jj[:, None] * K + ks[None, :]) * U + u, mask=(jj < r)[:, None] & kok[None, :],
                            other=0.0).to(tl.float32)  # fmt: skip
                qe = tl.sum(qt[:, None, :] * e[None, :, :], axis=2)  # HP JB: q_t . E[j]
                x = _block_values(values, win, b, u, t - jj, 0, v0, vr, n, r, U, V).to(tl.float32)  # JB BV
                acc += tl.sum(qe[:, :, None] * x[None, :, :], axis=1)
        tl.store(y + ((bu * n + t) * H + hs[:, None]) * V + v0 + vr[None, :], acc, mask=hok[:, None] & vok[None, :])
    tl.store(S + (bu * K + ks[:, None]) * V + v0 + vr[None, :], St, mask=smask)
    tl.store(z_out + bu * K + ks, zt, mask=kok & (pv == 0))  # not over z, c: every value block reads them first
    tl.store(c_out + bu * K + ks, ct, mask=kok & (pv == 0))


def fused_recurrent_causal_lambda(
    q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, state: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """``q [b, n, h, k]``, ``keys [b, n, k, u]``, ``values [b, n, v, u]``, ``emb [r, k, u]`` or ``None``, the state
    before (float32) -> ``(y [b, n, h, v]`` in the inputs' dtype, the state after); no autograd."""
    (B, n, H, K), U, V = q.shape, keys.shape[3], values.shape[2]
    r = 0 if emb is None else emb.shape[0]
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    S = state["S"].detach().float().clone().contiguous()  # updated in place, each value block its own columns
    z, c = (state[key].detach().float().contiguous() for key in ("z", "c"))
    z_out, c_out = torch.empty_like(z), torch.empty_like(c)
    win = state["window"].detach().to(values.dtype).contiguous()
    y = torch.empty(B, U, n, H, V, device=q.device, dtype=q.dtype if U == 1 else torch.float32)
    BV = min(32, _pow2(V, 16))
    meta: dict[str, Any] = dict(H=H, HP=_pow2(H), K=K, V=V, U=U, KP=_pow2(K), JB=16, BV=BV, HAS_EMB=r > 0)
    e, w = q if emb is None else emb.contiguous(), win if win.numel() else q
    with on_device(q.device):  # the tensors' GPU and stream, whichever is current
        _recurrent[(B * U, -(-V // BV))](q, keys, values, e, w, S, z, c, z_out, c_out, y, n, r, **meta)
    full = torch.cat([win, values.permute(0, 3, 1, 2)], dim=2)  # b u (r - 1 + n) v
    window = full[:, :, full.shape[2] - win.shape[2] :].float()
    return (y.sum(1).to(q.dtype) if U > 1 else y[:, 0]), {"S": S, "z": z_out, "c": c_out, "window": window}
