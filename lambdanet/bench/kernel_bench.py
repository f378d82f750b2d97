"""The roofline of the fused position kernels (:mod:`lambdanet.ops.position_lambda.fused`): how close each call comes
to what the GPU it runs on allows.

For one call the work is counted exactly and the fewest bytes it must move are counted (each input read once,
each output written once), then set against the device's ceilings measured in the same run
(:func:`ceilings`): device-to-device copy bandwidth, and matrix-product rates in bf16 (tensor cores), TF32 and
plain fp32 (CUDA-core FMAs). Per ``(query n, context m)`` pair inside the scope (``P`` pairs per example) the
kernels do (see :mod:`lambdanet.ops.position_lambda.triton_position`):

* forward: ``h k u`` multiply-adds for the scores ``S = q . R`` (CUDA cores, fp32) and ``h v u`` for ``S V``
  (matrix units; fp32 FMAs for fp32 values unless TF32 is allowed);
* backward: ``dS = dy V^T`` (twice: for ``dq`` and for the table) and ``dV += S^T dy`` (``3 h v u``) and the
  table's ``dR += q^T dS`` (``h k u``) on the matrix units; ``dq += dS R`` and the recomputed ``S``
  (``2 h k u``, CUDA cores).

Each part's time at its ceiling is a floor; the largest names the bound and ``fraction`` is that floor over
the measured time (1 = at the ceiling). CUDA only: the interpreter's timings mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["KERNEL_POINTS", "scope_pairs", "position_counts", "ceilings", "position_roofline"]

# (batch, side, channels, r): LambdaResNet-50's lambda stages at 224 px (c3 28x28 x 128, c4 14x14 x 256,
# c5 7x7 x 512; heads 4, k 16, u 1, v = channels / heads; r = 23, App. D / Table 3), a 7x7 scope and a
# global context (r = None: a (2 s - 1)^2 table)
KERNEL_POINTS: list[tuple[int, int, int, int | None]] = [
    (128, 28, 128, 23),
    (128, 28, 128, 7),
    (128, 14, 256, 23),
    (128, 14, 256, None),
    (128, 7, 512, 23),
]


def _axis_pairs(size: int, length: int, center: int) -> int:
    """Pairs ``(i, j)`` of ``range(size)`` with ``0 <= j - i + center < length``: one axis of the band."""
    return sum(max(0, min(size, i - center + length) - max(0, i - center)) for i in range(size))


def _table_side(side: int, r: int | None) -> int:
    """The relative table's side: ``r``, or ``2 side - 1`` for a global context (``r = None``)."""
    return 2 * side - 1 if r is None else r


def scope_pairs(side: int, r: int | None) -> int:
    """``(n, m)`` pairs of a ``side x side`` map whose offset lies inside the table (``r x r``, centred; a
    global context's ``(2 side - 1)`` table covers all ``side^4``)."""
    length = _table_side(side, r)
    per_axis = _axis_pairs(side, length, length // 2)
    return per_axis * per_axis


def position_counts(
    batch: int, side: int, r: int | None, *, heads: int, dim_k: int, dim_v: int, dim_u: int = 1, itemsize: int = 2
) -> dict[str, dict[str, int]]:
    """Multiply-adds on each unit and fewest bytes of one forward and one backward call.

    Returns ``{"fwd": {...}, "bwd": {...}}`` with ``scores_macs`` (CUDA cores), ``matrix_macs`` (matrix units)
    and ``bytes``; ``itemsize`` is the bytes per element of ``q``, ``V``, ``y`` and the table.
    """
    n = side * side
    t = _table_side(side, r) ** 2
    pairs = batch * scope_pairs(side, r)
    h_k_u, h_v_u = heads * dim_k * dim_u, heads * dim_v * dim_u
    q_el, v_el, y_el, r_el = (
        batch * n * heads * dim_k,
        batch * n * dim_v * dim_u,
        batch * n * heads * dim_v,
        dim_k * dim_u * t,
    )
    fwd = {"scores_macs": pairs * h_k_u, "matrix_macs": pairs * h_v_u, "bytes": (q_el + v_el + r_el + y_el) * itemsize}
    # reads dy, q, V, R; writes dq, dV, dR
    bwd_bytes = (y_el + 2 * (q_el + v_el + r_el)) * itemsize
    bwd = {"scores_macs": 2 * pairs * h_k_u, "matrix_macs": pairs * (3 * h_v_u + h_k_u), "bytes": bwd_bytes}
    return {"fwd": fwd, "bwd": bwd}


def _median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of ``fn`` on ``device`` by Triton's ``do_bench`` (CUDA events, the L2 cache flushed
    between calls), with ``device`` current: ``do_bench`` times, flushes and waits on the current GPU."""
    from triton.testing import do_bench

    with torch.cuda.device(device):
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _copy_rate(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_ms(lambda: dst.copy_(src), device) / 1e6


def ceilings(device: str | torch.device = "cuda") -> dict[str, float]:
    """The device's measured ceilings: ``copy_GBps`` (bytes read plus written per second, a 1 GiB copy) and
    ``bf16_TFLOPs``, ``tf32_TFLOPs``, ``fp32_TFLOPs`` (8192^3 products of random matrices, 2 FLOPs per
    multiply-add; fp32 with TF32 off runs on the CUDA cores)."""
    device = torch.device(device)
    out = {"copy_GBps": _copy_rate(device)}
    size = 8192
    allow = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, tf32 in (
            ("bf16", torch.bfloat16, False),
            ("tf32", torch.float32, True),
            ("fp32", torch.float32, False),
        ):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
            out[f"{name}_TFLOPs"] = 2 * size**3 / _median_ms(lambda: a @ b, device) / 1e9
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    return out


def _inputs(batch: int, side: int, channels: int, r: int | None, heads: int, dim_k: int, dtype, device):
    """Random ``q [b n h k]``, ``V [b n v 1]`` (normalised-value scale), table ``[k 1 T T]`` and its centre."""
    n, t = side * side, _table_side(side, r)
    q = torch.randn(batch, n, heads, dim_k, device=device, dtype=dtype)  # b n h k
    values = torch.randn(batch, n, channels // heads, 1, device=device, dtype=dtype) / n**0.5  # b n v u
    table = torch.randn(dim_k, 1, t, t, device=device, dtype=dtype) / dim_k**0.5  # k u T T
    return q, values, table, (t // 2, t // 2)


def position_roofline(
    points: Sequence[tuple[int, int, int, int | None]] = KERNEL_POINTS,
    *,
    device: str | torch.device = "cuda",
    dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float32),
    heads: int = 4,
    dim_k: int = 16,
    ceiling: dict[str, float] | None = None,
    log=print,
) -> list[dict]:
    """Time the forward and backward ops at each ``(batch, side, channels, r)`` point and dtype and set them
    against ``ceiling`` (measured by :func:`ceilings` when not given). One row per (point, dtype, pass)."""
    from lambdanet.ops.position_lambda.fused import _position_output, _position_output_backward

    ceiling = ceiling or ceilings(device)
    rows = []
    for batch, side, channels, r in points:
        for dtype in dtypes:
            q, values, table, center = _inputs(batch, side, channels, r, heads, dim_k, dtype, device)
            geometry = (center[0], center[1], side, side)
            y = _position_output(q, values, table, *geometry)
            dy = torch.randn_like(y)
            calls = {
                "fwd": lambda: _position_output(q, values, table, *geometry),
                "bwd": lambda: _position_output_backward(dy, q, values, table, *geometry),
            }
            counts = position_counts(
                batch, side, r, heads=heads, dim_k=dim_k, dim_v=channels // heads, itemsize=q.element_size()
            )
            matrix_rate = ceiling["bf16_TFLOPs"] if dtype != torch.float32 else ceiling["fp32_TFLOPs"]
            for name, fn in calls.items():
                ms, c = _median_ms(fn, torch.device(device)), counts[name]
                floors = {
                    "memory": c["bytes"] / ceiling["copy_GBps"] / 1e6,
                    "cuda_cores": 2 * c["scores_macs"] / ceiling["fp32_TFLOPs"] / 1e9,
                    "matrix": 2 * c["matrix_macs"] / matrix_rate / 1e9,
                }
                if dtype == torch.float32:  # both products on the CUDA cores: their times add
                    floors = {"memory": floors["memory"], "cuda_cores": floors["cuda_cores"] + floors["matrix"]}
                bound = max(floors, key=lambda k: floors[k])
                row = {
                    "batch": batch,
                    "side": side,
                    "channels": channels,
                    "scope": "global" if r is None else f"{r}x{r}",
                    "dtype": str(dtype).removeprefix("torch."),
                    "pass": name,
                    "ms": ms,
                    **{f"floor_{k}_ms": v for k, v in floors.items()},
                    "bound": bound,
                    "fraction": floors[bound] / ms,
                    "TFLOPs": 2 * (c["scores_macs"] + c["matrix_macs"]) / ms / 1e9,
                    "GBps": c["bytes"] / ms / 1e6,
                }
                rows.append(row)
                log(
                    f"  {name} {row['dtype']} b{batch} {side}x{side} c{channels} {row['scope']}: {ms:.3f} ms, "
                    f"{row['TFLOPs']:.1f} TFLOP/s, {bound}-bound, {row['fraction']:.0%} of its ceiling"
                )
    return rows
