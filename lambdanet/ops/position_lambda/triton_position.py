"""Fused Triton kernels for the lambda layer's position output, queries first.

For queries ``q[b, n, h, k]``, normalised values ``V[b, m, v, u]`` and a relative table ``R[k, u, T0, T1]``
whose entry ``(c0, c1)`` is offset zero, the position output is (paper Eq. 2, contracted queries first)::

    y[b, n, h, v] = sum_{m, u} (sum_k q[b, n, h, k] R[k, u, c0 + dy(n, m), c1 + dx(n, m)]) V[b, m, v, u]

with ``(dy, dx)`` the 2-d offset from query ``n`` to context position ``m``, and ``R`` zero outside the table:
a local scope ``r`` is the banded case (``T = r``), a global context the full one (``T = 2 s - 1``), a causal
1-d table (``c = T - 1``) the lower-triangular one. The kernels read ``R`` inside the tile loop: no ``n x m``
(and no ``b x n x m``) tensor exists in memory. Sequences are maps of height 1.

Kernels (grid: query tiles x batch, or context tiles x batch):

* ``_forward``: for each query tile, loop over the context tiles in its band; per tile the logits-like
  ``S[(n, h), m] = sum_k q[n, h, k] R[k, u, off(n, m)]`` (k gathered rows of ``R``, CUDA-core FMAs, fp32), then
  ``y += S V_u`` (``tl.dot``, fp32 accumulation; half-precision ``V`` takes ``S`` rounded to its type and runs
  on the matrix units; fp32 ``V`` multiplies in full fp32 (FMAs), or in TF32 on the matrix units when
  ``torch.backends.cuda.matmul.allow_tf32`` is set, as PyTorch's own fp32 GEMMs do).
* ``_backward_q``: ``dS = dy V_u^T`` per tile, ``dq[n, h, k] += sum_m dS[(n, h), m] R[k, u, off(n, m)]``.
* ``_backward_kv``: per context tile, loop over the query tiles whose band holds it; ``dV_u += S^T dy``.
* ``_backward_table`` (in ``triton_table.py``; grid: table blocks x u x splits of the (batch, query tile)
  items): the table gradient ``dR[k, u, t] = sum_{n, h} q[n, h, k] dS[(n, h), m(n, t)]`` with ``m(n, t)`` the
  context position at offset ``t`` from ``n``. Per query tile, ``dS = dy V_u^T`` over the context span of the
  tile and the table block (matrix units), gathered into table coordinates in registers (``tl.gather`` along
  the context axis: the skew from ``(n, m)`` to ``(n, t)``), then ``dR += q^T dS`` as one matrix product. Each
  program owns its ``[k, T-block]`` partial sum (a split's rows of an fp32 buffer, summed over the splits after
  the launch): no atomics, and the table gradient is deterministic.

Multiply-adds per (query, context) pair in the band: ``h k u`` for ``S`` and ``h v u`` for ``S V`` (the
``einsum_qe`` count); bytes: ``q``, ``V`` and ``y`` once per tile pair from cache, ``R`` gathered from L1/L2.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) they run on CPU tensors: the tests' path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lambdanet.ops.position_lambda.triton_table import _backward_table

__all__ = ["launch_forward", "launch_backward", "table_splits", "BLOCK_N", "BLOCK_M", "BLOCK_T"]

BLOCK_N = 16  # query positions per program (times the heads: the rows of the dot products)
BLOCK_M = 32  # context positions per inner step
BLOCK_T = 64  # relative-table entries per program of the table gradient
TABLE_VC = 32  # value channels per slice of the table gradient's dS = dy V^T
TABLE_WARPS = 8  # its warps: with 4 it spills registers at fp32 or 8 heads (compile_report, sm_90)


@triton.jit
def _band(i_first, i_last, c0, T0, S0, W):
    """Flattened context range [lo, hi) whose rows are within reach of query rows i_first..i_last (rows
    ``i - c0 .. i + T0 - 1 - c0``); with ``c0`` mirrored to ``T0 - 1 - c0``, the query rows that reach
    context rows i_first..i_last."""
    lo = tl.maximum(i_first - c0, 0) * W
    hi = tl.minimum(i_last + T0 - c0, S0) * W
    return lo, hi


@triton.jit
def _pairs(offs_n, offs_m, n_ok, m_ok, W, T0, T1, c0, c1):
    """Table index of every (query n, context m) pair of a tile, and whether the pair is in the table."""
    di = offs_m[None, :] // W - offs_n[:, None] // W + c0  # n m
    dj = offs_m[None, :] % W - offs_n[:, None] % W + c1
    valid = (di >= 0) & (di < T0) & (dj >= 0) & (dj < T1) & n_ok[:, None] & m_ok[None, :]
    return di * T1 + dj, valid


@triton.jit
def _scores(
    q_ptr,
    r_ptr,
    offs_n,
    offs_h,
    n_ok,
    h_ok,
    idx,
    valid,
    u,
    K,
    U,
    T,
    s_qn,
    s_qh,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """S[n, h, m] = sum_k q[n, h, k] R[k, u, idx[n, m]] (fp32, zero where not valid)."""
    s = tl.zeros((BLOCK_N, BLOCK_H, BLOCK_M), dtype=tl.float32)
    qmask = n_ok[:, None] & h_ok[None, :]
    for k in range(K):
        qk = tl.load(q_ptr + offs_n[:, None] * s_qn + offs_h[None, :] * s_qh + k, mask=qmask, other=0.0)
        rk = tl.load(r_ptr + (k * U + u) * T + idx, mask=valid, other=0.0)  # n m
        s += qk.to(tl.float32)[:, :, None] * rk.to(tl.float32)[:, None, :]  # n h m
    return s


@triton.jit
def _forward(
    q_ptr,
    v_ptr,
    r_ptr,
    y_ptr,
    N,
    H,
    K,
    V,
    U,
    S0,
    W,
    T0,
    T1,
    c0,
    c1,
    s_qb,
    s_qn,
    s_qh,
    s_vb,
    s_vm,
    s_vv,
    s_yb,
    s_yn,
    s_yh,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HALF_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_n, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # b * stride past 2^31
    T = T0 * T1
    q_ptr, v_ptr = q_ptr + b * s_qb, v_ptr + b * s_vb
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h, offs_v = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_V)
    n_ok, h_ok, v_ok = offs_n < N, offs_h < H, offs_v < V
    lo, hi = _band(pid_n * BLOCK_N // W, (tl.minimum(pid_n * BLOCK_N + BLOCK_N, N) - 1) // W, c0, T0, S0, W)
    acc = tl.zeros((BLOCK_N * BLOCK_H, BLOCK_V), dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < hi
        idx, valid = _pairs(offs_n, offs_m, n_ok, m_ok, W, T0, T1, c0, c1)  # n m
        for u in range(U):
            s = _scores(
                q_ptr, r_ptr, offs_n, offs_h, n_ok, h_ok, idx, valid, u, K, U, T, s_qn, s_qh, BLOCK_N, BLOCK_H, BLOCK_M
            )
            vt = tl.load(
                v_ptr + offs_m[:, None] * s_vm + offs_v[None, :] * s_vv + u,
                mask=m_ok[:, None] & v_ok[None, :],
                other=0.0,
            )  # m v
            s2 = tl.reshape(s, (BLOCK_N * BLOCK_H, BLOCK_M))
            if HALF_DOT:  # half-precision operands, fp32 accumulation
                acc += tl.dot(s2.to(vt.dtype), vt)
            else:
                acc += tl.dot(s2, vt.to(tl.float32), input_precision=F32_DOT)
    out = tl.reshape(acc, (BLOCK_N, BLOCK_H, BLOCK_V))
    y_ptrs = y_ptr + b * s_yb + offs_n[:, None, None] * s_yn + offs_h[None, :, None] * s_yh + offs_v[None, None, :]
    tl.store(
        y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok[:, None, None] & h_ok[None, :, None] & v_ok[None, None, :]
    )


@triton.jit
def _backward_q(
    q_ptr,
    v_ptr,
    r_ptr,
    dy_ptr,
    dq_ptr,
    N,
    H,
    K,
    V,
    U,
    S0,
    W,
    T0,
    T1,
    c0,
    c1,
    s_qb,
    s_qn,
    s_qh,
    s_vb,
    s_vm,
    s_vv,
    s_yb,
    s_yn,
    s_yh,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HALF_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """dq[n, h, k] = sum_{m, u} (dy[n, h] . V[m, :, u]) R[k, u, off(n, m)]; dq (fp32, zeroed, q's strides)
    is owned by this program's rows: read-modify-write without atomics."""
    pid_n, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # b * stride past 2^31
    T = T0 * T1
    v_ptr, dq_ptr = v_ptr + b * s_vb, dq_ptr + b * s_qb
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h, offs_v = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_V)
    n_ok, h_ok, v_ok = offs_n < N, offs_h < H, offs_v < V
    row_ok = n_ok[:, None] & h_ok[None, :]
    dy_ptrs = dy_ptr + b * s_yb + offs_n[:, None, None] * s_yn + offs_h[None, :, None] * s_yh + offs_v[None, None, :]
    dy = tl.load(dy_ptrs, mask=row_ok[:, :, None] & v_ok[None, None, :], other=0.0)
    dy2 = tl.reshape(dy, (BLOCK_N * BLOCK_H, BLOCK_V))
    lo, hi = _band(pid_n * BLOCK_N // W, (tl.minimum(pid_n * BLOCK_N + BLOCK_N, N) - 1) // W, c0, T0, S0, W)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < hi
        idx, valid = _pairs(offs_n, offs_m, n_ok, m_ok, W, T0, T1, c0, c1)  # n m
        for u in range(U):
            vt = tl.load(
                v_ptr + offs_m[:, None] * s_vm + offs_v[None, :] * s_vv + u,
                mask=m_ok[:, None] & v_ok[None, :],
                other=0.0,
            )  # m v
            if HALF_DOT:
                ds = tl.dot(dy2.to(vt.dtype), tl.trans(vt))  # (n h) m
            else:
                ds = tl.dot(dy2.to(tl.float32), tl.trans(vt.to(tl.float32)), input_precision=F32_DOT)
            ds3 = tl.reshape(ds, (BLOCK_N, BLOCK_H, BLOCK_M))
            for k in range(K):
                rk = tl.load(r_ptr + (k * U + u) * T + idx, mask=valid, other=0.0).to(tl.float32)  # n m
                part = tl.sum(ds3 * rk[:, None, :], axis=2)  # n h
                ptrs = dq_ptr + offs_n[:, None] * s_qn + offs_h[None, :] * s_qh + k
                tl.store(ptrs, tl.load(ptrs, mask=row_ok, other=0.0) + part, mask=row_ok)


@triton.jit
def _backward_kv(
    q_ptr,
    v_ptr,
    r_ptr,
    dy_ptr,
    dv_ptr,
    N,
    H,
    K,
    V,
    U,
    S0,
    W,
    T0,
    T1,
    c0,
    c1,
    s_qb,
    s_qn,
    s_qh,
    s_vb,
    s_vm,
    s_vv,
    s_yb,
    s_yn,
    s_yh,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HALF_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Per context tile: dV[m, v, u] = sum_{n, h} S[(n, h), m] dy[n, h, v] (owned rows, fp32, V's strides)."""
    pid_m, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    T = T0 * T1
    q_ptr = q_ptr + b * s_qb
    dv_ptr, dy_ptr = dv_ptr + b * s_vb, dy_ptr + b * s_yb
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h, offs_v = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_V)
    m_ok, h_ok, v_ok = offs_m < N, offs_h < H, offs_v < V
    # the queries that reach this tile: the band of the mirrored table (offsets seen from the context side)
    lo, hi = _band(pid_m * BLOCK_M // W, (tl.minimum(pid_m * BLOCK_M + BLOCK_M, N) - 1) // W, T0 - 1 - c0, T0, S0, W)
    for u in range(U):
        dv = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = (offs_n < hi) & (offs_n < N)
            row_ok = n_ok[:, None] & h_ok[None, :]
            idx, valid = _pairs(offs_n, offs_m, n_ok, m_ok, W, T0, T1, c0, c1)  # n m
            s = _scores(
                q_ptr, r_ptr, offs_n, offs_h, n_ok, h_ok, idx, valid, u, K, U, T, s_qn, s_qh, BLOCK_N, BLOCK_H, BLOCK_M
            )
            dy = tl.load(
                dy_ptr + offs_n[:, None, None] * s_yn + offs_h[None, :, None] * s_yh + offs_v[None, None, :],
                mask=row_ok[:, :, None] & v_ok[None, None, :],
                other=0.0,
            )
            dy2 = tl.reshape(dy, (BLOCK_N * BLOCK_H, BLOCK_V))
            s2 = tl.trans(tl.reshape(s, (BLOCK_N * BLOCK_H, BLOCK_M)))  # m (n h)
            if HALF_DOT:
                dv += tl.dot(s2.to(v_ptr.dtype.element_ty), dy2.to(v_ptr.dtype.element_ty))
            else:
                dv += tl.dot(s2, dy2.to(tl.float32), input_precision=F32_DOT)
        tl.store(dv_ptr + offs_m[:, None] * s_vm + offs_v[None, :] * s_vv + u, dv, mask=m_ok[:, None] & v_ok[None, :])


def _launch_args(q, values, table, center, spatial, y):
    """The batch and the kernel arguments but pointers of a launch: shapes, strides (``y``: the output or its
    gradient) and block sizes (``spatial`` of 1 or 2 dims; 1-d is a map of height 1)."""
    b, n, h, k = q.shape
    v, u = values.shape[2], values.shape[3]
    s0, w = (1, spatial[0]) if len(spatial) == 1 else spatial
    t0, t1 = (1, table.shape[-1]) if len(spatial) == 1 else table.shape[-2:]
    c0, c1 = (0, center[0]) if len(spatial) == 1 else center
    return b, dict(
        N=n,
        H=h,
        K=k,
        V=v,
        U=u,
        S0=s0,
        W=w,
        T0=t0,
        T1=t1,
        c0=c0,
        c1=c1,
        s_qb=q.stride(0),
        s_qn=q.stride(1),
        s_qh=q.stride(2),
        s_vb=values.stride(0),
        s_vm=values.stride(1),
        s_vv=values.stride(2),
        s_yb=y.stride(0),
        s_yn=y.stride(1),
        s_yh=y.stride(2),
        BLOCK_N=BLOCK_N,
        BLOCK_M=BLOCK_M,
        BLOCK_H=max(triton.next_power_of_2(h), 1),
        BLOCK_V=max(triton.next_power_of_2(v), 16),
        HALF_DOT=_half_dot(values.dtype),
        F32_DOT="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
    )


def registers(half_dot: bool) -> dict:
    """``_backward_q``'s launch option in float32: every register a thread may have at its 4 warps. Left to
    itself, Triton 3.6's ptxas gave it 32 registers and 1,026 local-memory loads (sm_90; with the option 255 and
    73, half the instructions; Triton 3.8's takes 255 by itself). The other kernels get 208-242 registers by
    themselves, and half-precision operands 165-255, so they keep ptxas's own choice, as measured."""
    return {} if half_dot or torch.version.hip is not None else {"maxnreg": 255}  # an NVIDIA option


def _half_dot(dtype: torch.dtype) -> bool:
    """Dot products on half-precision operands (fp32 accumulation) for fp16/bf16 values; fp32 otherwise.
    Triton's interpreter computes bf16 dots wrongly (it has no bf16 arithmetic), so there bf16 operands are
    widened to fp32: the interpreter checks the bf16 loads and stores, the GPU the bf16 dot itself."""
    return dtype == torch.float16 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1")


def launch_forward(q, values, table, center, spatial, out):
    """``out[b, n, h, v]`` = the position output of ``q [b, n, h, k]``, ``values [b, n, v, u]`` (last dim
    contiguous strides as given) and ``table [k, u, *T]`` (contiguous); ``out`` contiguous."""
    b, args = _launch_args(q, values, table, center, spatial, out)
    _forward[(triton.cdiv(args["N"], BLOCK_N), b)](q, values, table, out, **args)
    return out


def launch_backward(grad, q, values, table, center, spatial, dq, dvalues, dtable):
    """Gradients into zeroed fp32 buffers ``dq`` (q's shape, contiguous), ``dvalues`` (values' shape,
    contiguous) and ``dtable`` (table's shape, contiguous)."""
    b, args = _launch_args(q, values, table, center, spatial, grad)
    assert dq.stride() == q.stride() and dvalues.stride() == values.stride()
    _backward_q[(triton.cdiv(args["N"], BLOCK_N), b)](q, values, table, grad, dq, **args, **registers(args["HALF_DOT"]))
    _backward_kv[(triton.cdiv(args["N"], BLOCK_M), b)](q, values, table, grad, dvalues, **args)
    k, u, t = args["K"], args["U"], args["T0"] * args["T1"]
    items, blocks = b * triton.cdiv(args["N"], BLOCK_N), triton.cdiv(t, BLOCK_T)
    splits = table_splits(items, blocks * u, q.device)
    part = torch.empty(splits, k, u, t, device=q.device, dtype=torch.float32)  # every entry written
    table_args = dict(ITEMS=items, PER_SPLIT=triton.cdiv(items, splits), BLOCK_K=max(triton.next_power_of_2(k), 16))
    _backward_table[(blocks, u, splits)](
        q, values, grad, part, **args, **table_args, BLOCK_T=BLOCK_T, BLOCK_VC=TABLE_VC, num_warps=TABLE_WARPS
    )
    dtable.copy_(part.sum(0).view(dtable.shape))


def table_splits(items: int, programs: int, device: torch.device) -> int:
    """How many parts the table gradient's ``items`` (batch x query tiles) are split into, for ``programs``
    (table blocks x u) per part: about four programs per multiprocessor on a GPU (each split adds one
    ``[k, u, T]`` fp32 partial sum to reduce: bounded by the programs, not the batch); three under the
    interpreter, so the tests run the reduction over uneven splits."""
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3
    return max(1, min(items, triton.cdiv(target, programs)))
