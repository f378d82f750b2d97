"""Triton kernels of the chunked causal lambda (:mod:`lambdanet.ops.causal_lambda.fused_chunk`).

Symbols as in :mod:`lambdanet.functional.causal`: ``b`` batch, ``n`` positions, ``h`` query heads, ``k`` key depth,
``v`` value depth, ``u`` intra-depth, ``r`` causal scope, ``C`` positions per chunk, ``N = ceil(n / C)`` chunks.
One program serves one chunk of one ``(b, u)`` stream; the ``h`` heads are stacked into the rows of its tiles
(``row = head * C + position``), so the one ``k x v`` state of the stream serves every head without being expanded.

Forward (three launches whatever ``n`` is):

1. ``_chunk_sums`` (chunk-parallel): the chunk's key maximum ``a_i`` and its sums
   ``L_i = sum_m exp(K[m] - a_i) V[m]^T``, ``l_i = sum_m exp(K[m] - a_i)``.
2. ``_state_scan`` (a scan over chunks, parallel over ``(b, u)`` and value blocks): the states before each chunk,
   ``S_i, z_i`` relative to the running maximum ``c_i`` (every exponent ``<= 0``), written over ``L_i``.
3. ``_chunk_output`` (chunk-parallel): ``y = (q / Z) (delta S_i) + A V + B V_window``. The intra-chunk content
   scores ``A[n, m] = sum_k q[n, k] exp(K[m, k] - cm[n, k]) / Z[n, k]`` (``cm[n]``: each query's own running
   maximum) factor against one reference per channel, the chunk's largest key: ``A = (q / Za) Eh^T``, one product
   (:mod:`.triton_weights`). A chunk whose keys rise too far for that (more than ``SAFE`` = 30 nats, where the
   factored weights would near float32's range) builds them channel by channel instead, exactly. The position
   scores ``B[n, m] = q[n] . E[n - m]`` come from one ``q E^T`` product gathered along the band, once per program:
   the chunk's own band, and the ``WP >= r - 1`` positions before the chunk as one ``[h C, WP]`` block, so the
   scope before the chunk is one product with their values.

Backward (three launches): ``_grad_local`` (``dq``, the position table's gradient per chunk, each chunk's
contribution to the state gradient, and ``rho[n, k] = sum_h q~ dq_content``, the normaliser's gradient),
``_grad_scan`` (the state gradient, a reverse scan over chunks) and ``_grad_keys_values`` (``dK`` and ``dV``;
``dV`` transposed, ``[BV, C]``, so the value block is the long side of its products, and the later positions'
queries that reach the chunk through their scope taken head by head over the ``WP`` positions after it).
Products run on the tensor cores with the inputs' dtype as operands (bf16/fp16) and float32 accumulation;
float32 inputs keep float32 products (``input_precision="ieee"``); states, maxima, normalisers and every exponent
are float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lambdanet.ops.causal_lambda.triton_weights import (
    NEG_INF,
    _chunk_keys,
    _content_exact,
    _factored_scores,
    _grad_exact,
    _keys_exact,
)


@triton.jit
def _rows(i, n, H: tl.constexpr, HP: tl.constexpr, C: tl.constexpr):
    """Row indices of a chunk's tile: position in chunk ``nr``, head ``hh``, absolute position, validity."""
    rows = tl.arange(0, HP * C)
    nr = rows % C
    hh = rows // C
    pos = i * C + nr
    return nr, hh, pos, (hh < H) & (pos < n)


@triton.jit
def _band(QE, nr, cols, shift: tl.constexpr, r, RP: tl.constexpr):
    """Position scores of rows at positions ``nr`` against columns ``cols`` that lie ``shift`` positions further
    back (``j = n - m = nr + shift - col``), zero outside ``0 <= j < r``: ``QE [R, RP]`` (``q . E[j]``) ->
    ``[R, len(cols)]``. The chunk's own band is ``shift`` 0; the ``WP`` positions before it, ``shift = WP``."""
    j = nr[:, None] + shift - cols[None, :]
    ok = (j >= 0) & (j < r)
    return tl.where(ok, tl.gather(QE, tl.minimum(tl.maximum(j, 0), RP - 1), axis=1), 0.0)


@triton.jit
def _block_values(values, win, b, u, start, cols, v0, vs, n, r, U: tl.constexpr, V: tl.constexpr):
    """Values of positions ``start + cols`` (``[C, BV]``, value block at ``v0``); positions before the sequence
    come from the window state ``win [b, u, r - 1, v]``, positions past its end are zero."""
    m = start + cols
    vok = (v0 + vs) < V
    seq = (m >= 0) & (m < n)
    x = tl.load(
        values + ((b * n + m[:, None]) * V + v0 + vs[None, :]) * U + u, mask=seq[:, None] & vok[None, :], other=0.0
    )
    old = (m < 0) & (m >= 1 - r)
    t = r - 1 + m
    w = tl.load(
        win + ((b * U + u) * (r - 1) + t[:, None]) * V + v0 + vs[None, :], mask=old[:, None] & vok[None, :], other=0.0
    )
    return x + w


@triton.jit
def _unband(D, nr, js, shift: tl.constexpr, W: tl.constexpr, r):
    """The transpose of :func:`_band`: ``D [R, W]`` over columns ``shift`` positions back -> ``[R, RP]`` at
    ``j = n - m`` (column ``nr + shift - j``)."""
    c = nr[:, None] + shift - js[None, :]
    ok = (c >= 0) & (c < W) & (js < r)[None, :]
    return tl.where(ok, tl.gather(D, tl.minimum(tl.maximum(c, 0), W - 1), axis=1), 0.0)


@triton.jit
def _heads(i, n, H: tl.constexpr, HP: tl.constexpr, C: tl.constexpr):
    """The chunk's rows as ``[HP, C]`` (head, position in chunk): head and absolute position indices, validity."""
    h3 = tl.arange(0, HP)[:, None]
    pos3 = i * C + tl.arange(0, C)[None, :]
    return h3, pos3, (h3 < H) & (pos3 < n)


@triton.jit
def _pid(U: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    bu = tl.program_id(1).to(tl.int64)
    return i, bu, bu // U, bu % U


@triton.jit
def _chunk_sums(keys, values, amax, lsum, Sb, n, N1, K: tl.constexpr, V: tl.constexpr, U: tl.constexpr,
                C: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    i, bu, b, u = _pid(U)
    cols, ks, vr = tl.arange(0, C), tl.arange(0, KP), tl.arange(0, BV)
    m = i * C + cols
    mok, kok = m < n, ks < K
    kt = tl.load(keys + ((b * n + m[:, None]) * K + ks[None, :]) * U + u, mask=mok[:, None] & kok[None, :],
                 other=NEG_INF).to(tl.float32)  # fmt: skip
    a = tl.where(kok, tl.max(kt, axis=0), 0.0)  # KP: the chunk's maximum a_i
    e = tl.exp(kt - a[None, :])  # C KP, <= 1
    base = bu * N1 + i
    tl.store(amax + base * K + ks, a, mask=kok)
    tl.store(lsum + base * K + ks, tl.sum(e, axis=0), mask=kok)
    et = tl.trans(e.to(DT))  # KP C
    for v0 in range(0, V, BV):
        vok = (v0 + vr) < V
        x = tl.load(values + ((b * n + m[:, None]) * V + v0 + vr[None, :]) * U + u, mask=mok[:, None] & vok[None, :],
                    other=0.0)  # fmt: skip
        L = tl.dot(et, x.to(DT), input_precision=PREC)  # KP BV
        tl.store(Sb + (base * K + ks[:, None]) * V + v0 + vr[None, :], L, mask=kok[:, None] & vok[None, :])


@triton.jit
def _scan_tile(K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr):
    """A scan program's ``k x v`` tile: its stream ``bu``, channel and value indices, their masks, and whether it
    is the first value block (the one that writes the per-channel maxima and normalisers)."""
    bu = tl.program_id(0).to(tl.int64)
    pv = tl.program_id(1)
    ks = tl.arange(0, KP)
    vs = pv * BV + tl.arange(0, BV)
    kok = ks < K
    return bu, ks, vs, kok, kok[:, None] & (vs < V)[None, :], kok & (pv == 0)


@triton.jit
def _state_scan(amax, lsum, cb, zb, Sb, S0, z0, c0, N, N1, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
                BV: tl.constexpr, SCAN_STAGES: tl.constexpr):  # fmt: skip
    """``S_{i+1} = exp(c_i - c_{i+1}) S_i + exp(a_i - c_{i+1}) L_i`` (``z`` likewise, ``c_{i+1} = max(c_i, a_i)``);
    the state before chunk ``i`` overwrites ``L_i``, the final one goes to index ``N``. The loop is software-pipelined
    (``SCAN_STAGES``: the loads of the next ``SCAN_STAGES - 1`` chunks are in flight while one is combined; they do
    not depend on the carried state), else every one of the ``N`` steps waits a full memory latency."""
    bu, ks, vs, kok, mask, first = _scan_tile(K, V, KP, BV)
    c = tl.load(c0 + bu * K + ks, mask=kok, other=0.0)
    z = tl.load(z0 + bu * K + ks, mask=kok, other=0.0)
    S = tl.load(S0 + (bu * K + ks[:, None]) * V + vs[None, :], mask=mask, other=0.0)
    for i in tl.range(N, num_stages=SCAN_STAGES):
        base = bu * N1 + i
        a = tl.load(amax + base * K + ks, mask=kok, other=0.0)
        l = tl.load(lsum + base * K + ks, mask=kok, other=0.0)  # noqa: E741
        L = tl.load(Sb + (base * K + ks[:, None]) * V + vs[None, :], mask=mask, other=0.0)
        tl.store(Sb + (base * K + ks[:, None]) * V + vs[None, :], S, mask=mask)
        tl.store(cb + base * K + ks, c, mask=first)
        tl.store(zb + base * K + ks, z, mask=first)
        cn = tl.maximum(c, a)
        shrink, grow = tl.exp(c - cn), tl.exp(a - cn)  # <= 1
        S = shrink[:, None] * S + grow[:, None] * L
        z = shrink * z + grow * l
        c = cn
    base = bu * N1 + N
    tl.store(Sb + (base * K + ks[:, None]) * V + vs[None, :], S, mask=mask)
    tl.store(cb + base * K + ks, c, mask=first)
    tl.store(zb + base * K + ks, z, mask=first)


@triton.jit
def _chunk_output(q, keys, values, emb, win, cb, zb, Sb, y, n, r, N1, H: tl.constexpr, HP: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, U: tl.constexpr, C: tl.constexpr, KP: tl.constexpr,
                  RP: tl.constexpr, P: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr, HAS_EMB: tl.constexpr,
                  DT: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr):  # fmt: skip
    i, bu, b, u = _pid(U)
    nr, hh, pos, ok = _rows(i, n, H, HP, C)
    cols, ks, vr = tl.arange(0, C), tl.arange(0, KP), tl.arange(0, BV)
    kok = ks < K
    base = bu * N1 + i
    h3, pos3, ok3 = _heads(i, n, H, HP, C)  # HP C
    q3 = tl.load(q + ((b * n + pos3[:, :, None]) * H + h3[:, :, None]) * K + ks[None, None, :],
                 mask=ok3[:, :, None] & kok[None, None, :], other=0.0)  # fmt: skip
    Eh, Za, _, dl, spread = _chunk_keys(keys, cb, zb, b, u, base, i, n, cols, ks, kok, K, U, C)
    if spread > SAFE:  # a key rises too far inside the chunk for one reference: each query's own maximum
        A, DZ = _content_exact(q, keys, cb, zb, b, u, base, i, n, cols, ks, h3, pos3, ok3, H, HP, K, U, C, KP)
    else:  # A[n, m] = sum_k (q~[n, k] / Za[n, k]) Eh[m, k] for m <= n: one product
        DZ = dl[None, :] / Za  # C KP: delta / Z
        A, Qz = _factored_scores(q3.to(tl.float32), Za, Eh, nr, cols, HP, C, KP)
    Qd = tl.reshape(q3.to(tl.float32) * DZ[None, :, :], [HP * C, KP])  # q~ delta: against the carried state
    if HAS_EMB:
        js = tl.arange(0, RP)
        qtile = tl.reshape(q3, [HP * C, KP])
        et = tl.load(emb + (js[:, None] * K + ks[None, :]) * U + u, mask=(js < r)[:, None] & kok[None, :], other=0.0)
        QE = tl.dot(qtile.to(DT), tl.trans(et.to(DT)), input_precision=PREC)  # R RP: q . E[j]
        A += _band(QE, nr, cols, 0, r, RP)
        BW = _band(QE, nr, tl.arange(0, WP), WP, r, RP).to(DT)  # R WP: the scope before the chunk, built once
    Ad, Qdd = A.to(DT), Qd.to(DT)
    tw = tl.arange(0, WP)
    for v0 in range(0, V, BV):
        vok = (v0 + vr) < V
        S = tl.load(Sb + (base * K + ks[:, None]) * V + v0 + vr[None, :], mask=kok[:, None] & vok[None, :], other=0.0)
        acc = tl.dot(Qdd, S.to(DT), input_precision=PREC)  # R BV: the earlier chunks
        x = _block_values(values, win, b, u, i * C, cols, v0, vr, n, r, U, V)
        acc = tl.dot(Ad, x.to(DT), acc, input_precision=PREC)  # the chunk itself
        if HAS_EMB and P > 0:  # the position scope before the chunk: one product over its WP positions
            xw = _block_values(values, win, b, u, i * C - WP, tw, v0, vr, n, r, U, V)  # WP BV
            acc = tl.dot(BW, xw.to(DT), acc, input_precision=PREC)
        tl.store(y + ((bu * n + pos[:, None]) * H + hh[:, None]) * V + v0 + vr[None, :], acc,
                 mask=ok[:, None] & vok[None, :])  # fmt: skip


@triton.jit
def _grad_local(q, keys, values, emb, win, cb, zb, Sb, dy, dq, rho, G, g, demb, n, r, N, N1, H: tl.constexpr,
                HP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, U: tl.constexpr, C: tl.constexpr,
                KP: tl.constexpr, RP: tl.constexpr, P: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                HAS_EMB: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr):  # fmt: skip
    """``dq``, ``rho = sum_h q~ dq_content``, the chunk's contribution ``G_i`` (``g_i``) to the gradient of the state
    before it, and the position table's gradient of the chunk's queries."""
    i, bu, b, u = _pid(U)
    nr, hh, pos, ok = _rows(i, n, H, HP, C)
    cols, ks, vr, js = tl.arange(0, C), tl.arange(0, KP), tl.arange(0, BV), tl.arange(0, RP)
    kok = ks < K
    base = bu * N1 + i
    D0 = tl.zeros([HP * C, C], tl.float32)  # dy . V[m] over the chunk
    DS = tl.zeros([HP * C, KP], tl.float32)  # dy . S_i[k]
    DW = tl.zeros([HP * C, WP], tl.float32)  # dy . V[m] over the WP positions before the chunk
    tw = tl.arange(0, WP)
    for v0 in range(0, V, BV):
        vok = (v0 + vr) < V
        dyt = tl.load(dy + ((b * n + pos[:, None]) * H + hh[:, None]) * V + v0 + vr[None, :],
                      mask=ok[:, None] & vok[None, :], other=0.0).to(DT)  # fmt: skip
        S = tl.load(Sb + (base * K + ks[:, None]) * V + v0 + vr[None, :], mask=kok[:, None] & vok[None, :], other=0.0)
        DS = tl.dot(dyt, tl.trans(S.to(DT)), DS, input_precision=PREC)
        x = _block_values(values, win, b, u, i * C, cols, v0, vr, n, r, U, V)
        D0 = tl.dot(dyt, tl.trans(x.to(DT)), D0, input_precision=PREC)  # R C
        if HAS_EMB and P > 0:
            xw = _block_values(values, win, b, u, i * C - WP, tw, v0, vr, n, r, U, V)  # WP BV
            DW = tl.dot(dyt, tl.trans(xw.to(DT)), DW, input_precision=PREC)
    dqt = tl.zeros([HP * C, KP], tl.float32)
    if HAS_EMB:
        Dd = _unband(D0, nr, js, 0, C, r)  # R RP: dy . V[n - j] over the position scope, gathered once
        if P > 0:
            Dd += _unband(DW, nr, js, WP, WP, r)
        qtile = tl.load(q + ((b * n + pos[:, None]) * H + hh[:, None]) * K + ks[None, :],
                        mask=ok[:, None] & kok[None, :], other=0.0)  # fmt: skip
        et = tl.load(emb + (js[:, None] * K + ks[None, :]) * U + u, mask=(js < r)[:, None] & kok[None, :], other=0.0)
        dqt = tl.dot(Dd, et.to(tl.float32), input_precision="ieee")  # R KP
        de = tl.dot(tl.trans(qtile.to(tl.float32)), Dd, input_precision="ieee")  # KP RP
        tl.store(demb + ((bu * N + i) * K + ks[:, None]) * RP + js[None, :], de, mask=kok[:, None])
    h3, pos3, ok3 = _heads(i, n, H, HP, C)  # HP C
    q3 = tl.load(q + ((b * n + pos3[:, :, None]) * H + h3[:, :, None]) * K + ks[None, None, :],
                 mask=ok3[:, :, None] & kok[None, None, :], other=0.0).to(tl.float32)  # fmt: skip
    Eh, Za, Zc, dl, spread = _chunk_keys(keys, cb, zb, b, u, base, i, n, cols, ks, kok, K, U, C)
    if spread > SAFE:  # as in _chunk_output: each query's own maximum
        Tz, DZ, Zi = _grad_exact(keys, cb, zb, D0, b, u, base, i, n, cols, ks, kok, HP, K, U, C, KP)
    else:  # sum_m E[n, m] D0[n, m] / Z[n] = (D0 Eh)[n] / Za[n] over m <= n: one product
        D0m = tl.where(cols[None, :] <= nr[:, None], D0, 0.0)  # R C
        Tz = tl.reshape(tl.dot(D0m, Eh, input_precision="ieee"), [HP, C, KP]) / Za[None, :, :]
        DZ, Zi = dl[None, :] / Za, Zc / Za  # C KP: delta / Z, 1 / Z
    dqc = DZ[None, :, :] * tl.reshape(DS, [HP, C, KP]) + Tz  # HP C KP: the content's dq
    rr = q3 * Zi[None, :, :] * dqc  # q~ dq_content
    m = i * C + cols
    tl.store(rho + (bu * n + m[:, None]) * K + ks[None, :], tl.sum(rr, axis=0), mask=(m < n)[:, None] & kok[None, :])
    tl.store(g + base * K + ks, -tl.sum(tl.sum(DZ[None, :, :] * q3 * dqc, axis=0), axis=0), mask=kok)  # -delta rr
    dqt += tl.reshape(dqc, [HP * C, KP])
    tl.store(dq + ((bu * n + pos[:, None]) * H + hh[:, None]) * K + ks[None, :], dqt, mask=ok[:, None] & kok[None, :])
    Qd = tl.reshape(q3 * DZ[None, :, :], [HP * C, KP])  # q~ delta
    Qdd = Qd.to(DT)  # R KP
    for v0 in range(0, V, BV):
        vok = (v0 + vr) < V
        dyt = tl.load(dy + ((b * n + pos[:, None]) * H + hh[:, None]) * V + v0 + vr[None, :],
                      mask=ok[:, None] & vok[None, :], other=0.0).to(DT)  # fmt: skip
        Gt = tl.dot(tl.trans(dyt), Qdd, input_precision=PREC)  # BV KP: G_i transposed (the long side as the rows)
        tl.store(G + (base * K + ks[None, :]) * V + v0 + vr[:, None], Gt, mask=kok[None, :] & vok[:, None])


@triton.jit
def _grad_scan(cb, G, g, dzb, N, N1, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
               SCAN_STAGES: tl.constexpr):  # fmt: skip
    """The reverse scan ``dS_{i-1} = exp(c_{i-1} - c_i) dS_i + G_i``: the gradient of the state after chunk ``i``
    overwrites ``G_i`` (``dz`` goes to ``dzb``); the final state receives no gradient. Pipelined as
    :func:`_state_scan`."""
    bu, ks, vs, kok, mask, first = _scan_tile(K, V, KP, BV)
    dS = tl.zeros([KP, BV], tl.float32)
    dz = tl.zeros([KP], tl.float32)
    for t in tl.range(N, num_stages=SCAN_STAGES):
        base = bu * N1 + N - 1 - t
        Gi = tl.load(G + (base * K + ks[:, None]) * V + vs[None, :], mask=mask, other=0.0)
        gi = tl.load(g + base * K + ks, mask=kok, other=0.0)
        tl.store(G + (base * K + ks[:, None]) * V + vs[None, :], dS, mask=mask)
        tl.store(dzb + base * K + ks, dz, mask=first)
        shrink = tl.exp(tl.load(cb + base * K + ks, mask=kok, other=0.0) - tl.load(cb + (base + 1) * K + ks, mask=kok,
                                                                                      other=0.0))  # fmt: skip
        dS = shrink[:, None] * dS + Gi
        dz = shrink * dz + gi


@triton.jit
def _dv_later(q, dy, ett, dv, b, n, r, later, tw, cols, ks, kok, v0, vr, vok, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, C: tl.constexpr, RP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``dv [BV, C]`` plus the position term of the queries at the positions ``later = i C + C + tw`` after the
    chunk (offsets ``C + tw - m`` to its positions), each head's ``[WP, RP]`` scores in turn."""
    okl = later < n
    for h in range(H):
        ql = tl.load(q + ((b * n + later[:, None]) * H + h) * K + ks[None, :], mask=okl[:, None] & kok[None, :],
                     other=0.0)  # fmt: skip
        QL = tl.dot(ql.to(DT), ett, input_precision=PREC)  # WP RP
        BL = _band(QL, tw, cols, C, r, RP)  # WP C
        dyl = tl.load(dy + ((b * n + later[:, None]) * H + h) * V + v0 + vr[None, :],
                      mask=okl[:, None] & vok[None, :], other=0.0).to(DT)  # fmt: skip
        dv = tl.dot(tl.trans(dyl), BL.to(DT), dv, input_precision=PREC)  # BV C
    return dv


@triton.jit
def _grad_keys_values(q, keys, values, emb, win, cb, zb, dy, rho, G, dzb, dkeys, dvalues, n, r, N1, H: tl.constexpr,
                      HP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, U: tl.constexpr, C: tl.constexpr,
                      KP: tl.constexpr, RP: tl.constexpr, P: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                      HAS_EMB: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SAFE: tl.constexpr):  # fmt: skip
    """``dK`` (intra-chunk softmax terms and the carried state's) and ``dV`` (content, position, state)."""
    i, bu, b, u = _pid(U)
    nr, hh, pos, ok = _rows(i, n, H, HP, C)
    cols, ks, vr = tl.arange(0, C), tl.arange(0, KP), tl.arange(0, BV)
    kok = ks < K
    base = bu * N1 + i
    m = i * C + cols
    mok = m < n
    D0 = tl.zeros([HP * C, C], tl.float32)
    VdS = tl.zeros([C, KP], tl.float32)  # V[m] . dS_i[k]
    for v0 in range(0, V, BV):
        vok = (v0 + vr) < V
        dyt = tl.load(dy + ((b * n + pos[:, None]) * H + hh[:, None]) * V + v0 + vr[None, :],
                      mask=ok[:, None] & vok[None, :], other=0.0).to(DT)  # fmt: skip
        x = _block_values(values, win, b, u, i * C, cols, v0, vr, n, r, U, V).to(DT)
        dS = tl.load(G + (base * K + ks[:, None]) * V + v0 + vr[None, :], mask=kok[:, None] & vok[None, :], other=0.0)
        D0 = tl.dot(dyt, tl.trans(x), D0, input_precision=PREC)
        VdS = tl.dot(x, tl.trans(dS.to(DT)), VdS, input_precision=PREC)
    h3, pos3, ok3 = _heads(i, n, H, HP, C)  # HP C
    dzi = tl.load(dzb + base * K + ks, mask=kok, other=0.0)
    rr = tl.load(rho + (bu * n + m[:, None]) * K + ks[None, :], mask=mok[:, None] & kok[None, :], other=0.0)  # C KP
    # Eh = exp(K[m] - a): the chunk's reference a is the running maximum after it (c_{i+1} = max(c_i, a_i), as the
    # state scan made it), so Eh is also the chunk's keys in the state after it
    Eh, Za, Zc, _, spread = _chunk_keys(keys, cb, zb, b, u, base, i, n, cols, ks, kok, K, U, C)
    if spread > SAFE:  # as in _chunk_output: each query's own maximum
        A, dk = _keys_exact(q, keys, cb, zb, D0, rr, b, u, base, i, n, cols, ks, h3, pos3, ok3, H, HP, K, U, C, KP)
    else:  # the weights E[n, m] / Z[n] = Eh[m] / Za[n] (m <= n): products over the chunk's queries
        q3 = tl.load(q + ((b * n + pos3[:, :, None]) * H + h3[:, :, None]) * K + ks[None, None, :],
                     mask=ok3[:, :, None] & kok[None, None, :], other=0.0).to(tl.float32)  # fmt: skip
        A, Qz = _factored_scores(q3, Za, Eh, nr, cols, HP, C, KP)
        D0m = tl.where(cols[None, :] <= nr[:, None], D0, 0.0)
        later = tl.cumsum(rr / Zc, axis=0, reverse=True)  # C KP: sum_{n >= m} exp(a - cm[n]) rho[n]
        dk = Eh * (tl.dot(tl.trans(D0m), Qz, input_precision="ieee") - later)  # C KP
    dk += Eh * (VdS + dzi[None, :])  # the state after the chunk
    tl.store(dkeys + ((b * n + m[:, None]) * K + ks[None, :]) * U + u, dk, mask=mok[:, None] & kok[None, :])
    if HAS_EMB:
        js = tl.arange(0, RP)
        et = tl.load(emb + (js[:, None] * K + ks[None, :]) * U + u, mask=(js < r)[:, None] & kok[None, :], other=0.0)
        ett = tl.trans(et.to(DT))  # KP RP
        qtile = tl.load(q + ((b * n + pos[:, None]) * H + hh[:, None]) * K + ks[None, :],
                        mask=ok[:, None] & kok[None, :], other=0.0)  # fmt: skip
        A += _band(tl.dot(qtile.to(DT), ett, input_precision=PREC), nr, cols, 0, r, RP)
    Ad, Khd = A.to(DT), tl.trans(Eh.to(DT))  # R C, KP C
    tw = tl.arange(0, WP)
    later = i * C + C + tw  # WP: the positions after the chunk whose scope reaches into it
    for v0 in range(0, V, BV):  # dV transposed, [BV, C]: the value block as the rows of every product
        vok = (v0 + vr) < V
        dyt = tl.load(dy + ((b * n + pos[:, None]) * H + hh[:, None]) * V + v0 + vr[None, :],
                      mask=ok[:, None] & vok[None, :], other=0.0).to(DT)  # fmt: skip
        dS = tl.load(G + (base * K + ks[None, :]) * V + v0 + vr[:, None], mask=kok[None, :] & vok[:, None], other=0.0)
        dv = tl.dot(tl.trans(dyt), Ad, input_precision=PREC)  # BV C: the chunk's own queries
        dv = tl.dot(dS.to(DT), Khd, dv, input_precision=PREC)  # the state after the chunk
        if HAS_EMB and P > 0:
            dv = _dv_later(q, dy, ett, dv, b, n, r, later, tw, cols, ks, kok, v0, vr, vok, H, K, V, C, RP, DT, PREC)
        tl.store(dvalues + ((b * n + m[None, :]) * V + v0 + vr[:, None]) * U + u, dv, mask=mok[None, :] & vok[:, None])
