"""The Triton kernel of the position lambdas' table gradient (no atomics: each program owns a block of table
entries; see :mod:`lambdanet.ops.position_lambda.triton_position`, whose ``launch_backward`` launches it)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__: list[str] = []


@triton.jit
def _backward_table(q_ptr, v_ptr, dy_ptr, part_ptr, N, H, K, V, U, S0, W, T0, T1, c0, c1, s_qb, s_qn, s_qh, s_vb,
                    s_vm, s_vv, s_yb, s_yn, s_yh, ITEMS, PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_VC: tl.constexpr, HALF_DOT: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    """part[s, k, u, t] = sum over the items (batch, query tile) of split s of sum_{n, h} q[n, h, k]
    dS[(n, h), m(n, t)], dS = dy V_u^T; m(n, t) is the context position at table entry t from query n (none
    outside the map). The program owns its rows of ``part`` (fp32, contiguous ``[splits, K, U, T]``)."""
    pid_t, u, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    T = T0 * T1
    tiles = tl.cdiv(N, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h, offs_k = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_K)
    t_ok, h_ok, k_ok = offs_t < T, offs_h < H, offs_k < K
    di, dj = offs_t // T1 - c0, offs_t % T1 - c1  # the 2-d offset of each table entry
    acc = tl.zeros((BLOCK_K, BLOCK_T), dtype=tl.float32)
    for item in range(split * PER_SPLIT, tl.minimum(split * PER_SPLIT + PER_SPLIT, ITEMS)):
        b = (item // tiles).to(tl.int64)  # b * stride past 2^31 elements: int64 offsets
        offs_n = (item % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        row_ok = n_ok[:, None] & h_ok[None, :]
        mi = (offs_n // W)[:, None] + di[None, :]  # n t: the context row and column at each entry
        mj = (offs_n % W)[:, None] + dj[None, :]
        valid = (mi >= 0) & (mi < S0) & (mj >= 0) & (mj < W) & n_ok[:, None] & t_ok[None, :]
        m = mi * W + mj  # n t
        lo = tl.min(tl.min(tl.where(valid, m, N), axis=1), axis=0)  # the context span of this tile and block
        hi = tl.max(tl.max(tl.where(valid, m, -1), axis=1), axis=0) + 1
        m2 = tl.reshape(tl.broadcast_to(m[:, None, :], (BLOCK_N, BLOCK_H, BLOCK_T)), (BLOCK_N * BLOCK_H, BLOCK_T))
        ok2 = tl.reshape(valid[:, None, :] & h_ok[None, :, None], (BLOCK_N * BLOCK_H, BLOCK_T))  # (n h) t
        dst = tl.zeros((BLOCK_N * BLOCK_H, BLOCK_T), dtype=tl.float32)  # dS in table coordinates: (n h) t
        dy_rows = dy_ptr + b * s_yb + offs_n[:, None, None] * s_yn + offs_h[None, :, None] * s_yh  # n h 1
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < hi
            ds = tl.zeros((BLOCK_N * BLOCK_H, BLOCK_M), dtype=tl.float32)  # (n h) m
            for v0 in range(0, V, BLOCK_VC):  # v in slices: registers and shared memory stay small at any v
                offs_v = v0 + tl.arange(0, BLOCK_VC)
                v_ok = offs_v < V
                dy = tl.load(dy_rows + offs_v[None, None, :], mask=row_ok[:, :, None] & v_ok[None, None, :], other=0.0)
                dy2 = tl.reshape(dy, (BLOCK_N * BLOCK_H, BLOCK_VC))  # (n h) v
                vt = tl.load(
                    v_ptr + b * s_vb + offs_m[:, None] * s_vm + offs_v[None, :] * s_vv + u,
                    mask=m_ok[:, None] & v_ok[None, :],
                    other=0.0,
                )  # m v
                if HALF_DOT:
                    ds += tl.dot(dy2.to(vt.dtype), tl.trans(vt))
                else:
                    ds += tl.dot(dy2.to(tl.float32), tl.trans(vt.to(tl.float32)), input_precision=F32_DOT)
            rel = m2 - m0
            inside = ok2 & (rel >= 0) & (rel < BLOCK_M)
            dst += tl.where(inside, tl.gather(ds, tl.where(inside, rel, 0), 1), 0.0)  # the skew (n, m) -> (n, t)
        qt = tl.load(
            q_ptr + b * s_qb + offs_n[:, None, None] * s_qn + offs_h[None, :, None] * s_qh + offs_k[None, None, :],
            mask=row_ok[:, :, None] & k_ok[None, None, :],
            other=0.0,
        )
        qt = tl.trans(tl.reshape(qt, (BLOCK_N * BLOCK_H, BLOCK_K)))  # k (n h)
        if HALF_DOT and v_ptr.dtype.element_ty == tl.bfloat16:  # bf16 has float32's range: dS fits
            acc += tl.dot(qt.to(tl.bfloat16), dst.to(tl.bfloat16))  # k t
        elif HALF_DOT:  # dS ~ v |dy| |V| can overflow fp16 (65504) under a loss scale: TF32 keeps float32's range
            acc += tl.dot(qt.to(tl.float32), dst, input_precision="tf32")
        else:
            acc += tl.dot(qt.to(tl.float32), dst, input_precision=F32_DOT)
    part = part_ptr + ((split * K + offs_k[:, None]) * U + u) * T + offs_t[None, :]
    tl.store(part, acc, mask=k_ok[:, None] & t_ok[None, :])
