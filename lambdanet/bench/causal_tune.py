"""Launch settings of the fused causal lambda's six kernels for this GPU (``lambdanet bench causal_tune --device
cuda``): the sweep that chose ``lambdanet.ops.causal_lambda.fused_chunk.SETTINGS`` on an H100, for any other card.

Each variant sets every product kernel to one ``(warps, block_v, stages)`` and both scans to another; the kernels are
independent, so one profile of a forward + backward per variant gives each kernel's CUDA time under each of its
settings. The composition takes each kernel's fastest setting (summed over the points) and is timed against the
defaults as a whole; ``export LAMBDANET_CAUSAL_TUNE='...'`` (printed) applies it to later processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from lambdanet.ops.causal_lambda import fused_chunk as FC
from lambdanet.runtime import timed_call

__all__ = ["PRODUCTS", "SCANS", "POINTS", "variants", "compose", "tune_env", "kernel_times", "sweep", "agreement",
           "cuda_median_ms", "compare", "bench_part"]  # fmt: skip

# the settings tried (warps, block_v, stages): the product kernels' and the scans', paired into variants
PRODUCTS = [(0, 64, 1), (8, 64, 1), (8, 128, 1), (4, 128, 1), (8, 256, 1), (4, 32, 1), (4, 256, 1), (4, 64, 2),
            (16, 128, 1), (8, 128, 2), (4, 128, 2)]  # fmt: skip
SCANS = [(4, 64, 4), (4, 32, 4), (4, 16, 4), (2, 16, 4), (1, 16, 4), (2, 32, 4), (4, 16, 8), (2, 16, 8), (1, 16, 8),
         (4, 32, 8), (1, 16, 16), (2, 16, 16), (1, 8, 8), (2, 8, 8), (4, 16, 16)]  # fmt: skip
POINTS = ((2048, 32), (32768, 2))  # n x b: many short sequences, few long ones (65,536 tokens each)


def variants() -> list[dict[str, tuple[int, int, int]]]:
    """Every kernel's setting per variant: the longer list of settings walked once, the shorter one cycled."""
    count = max(len(PRODUCTS), len(SCANS))
    return [{k: SCANS[i % len(SCANS)] if k in FC.SCANS else PRODUCTS[i % len(PRODUCTS)] for k in FC.KERNELS}
            for i in range(count)]  # fmt: skip


def compose(rows: Sequence[dict], tried: Sequence[dict], default: dict) -> dict[str, tuple[int, int, int]]:
    """Each kernel's setting with the least time summed over the points: ``rows[i]`` maps ``"nxb"`` to
    ``{kernel: ms}`` (or ``{"error": ...}``) for variant ``tried[i]``; a kernel no variant timed at every point keeps
    ``default``'s setting."""
    best = dict(default)
    for kernel in FC.KERNELS:
        timed = []
        for row, tune in zip(rows, tried):
            times = [row[key].get(kernel) for key in row]
            if times and all(isinstance(t, float) for t in times):
                timed.append((sum(times), tune[kernel]))
        if timed:
            best[kernel] = min(timed)[1]
    return best


def tune_env(settings: dict[str, tuple[int, int, int]]) -> str:
    """``settings`` as ``LAMBDANET_CAUSAL_TUNE`` spells them (read by ``fused_chunk`` at its first launch)."""
    return ";".join(f"{k}={w},{bv},{st}" for k, (w, bv, st) in settings.items())


def _inputs(n: int, b: int, device, heads=8, dim_k=16, dim_v=208, r=64, dtype=torch.bfloat16) -> Callable[[], None]:
    """One forward + backward of the op at ``lambda_lm_base``'s layer (by default) on ``n x b`` tokens: bf16
    queries and values, float32 keys (the decayed models' keys with their offsets, as ``lambda_lm_*`` pass them)."""
    from lambdanet.ops import causal_lambda

    q = torch.randn(b, n, heads, dim_k, device=device, dtype=dtype, requires_grad=True)
    keys = torch.randn(b, n, dim_k, 1, device=device, dtype=torch.float32, requires_grad=True)
    values = torch.randn(b, n, dim_v, 1, device=device, dtype=dtype, requires_grad=True)
    emb = (torch.randn(r, dim_k, 1, device=device) / 32).requires_grad_()
    dy = torch.randn(b, n, heads, dim_v, device=device, dtype=dtype)
    chunk = FC.default_chunk(heads)

    def run() -> None:
        out = causal_lambda(q, keys, values, emb, mode="fused_chunk", chunk_size=chunk)
        cast(torch.Tensor, out).backward(dy)

    return run


def kernel_times(fn: Callable[[], None], reps: int = 3, device=None) -> dict[str, float]:
    """Mean CUDA ms of each of the six kernels in one call of ``fn`` (after one call that compiles) on ``device``
    (default: the current CUDA device), the GPU its work is waited for on."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    per: dict[str, float] = {}
    for e in prof.events():
        name = e.name.lstrip("_")
        if e.device_type == torch.autograd.DeviceType.CUDA and name in FC.KERNELS:
            per[name] = per.get(name, 0.0) + e.device_time / 1e3 / reps
    return per


def _with(settings: dict, fn: Callable):
    saved = dict(FC.tune())
    FC.TUNE.update(settings)
    try:
        return fn()
    finally:
        FC.TUNE.clear()
        FC.TUNE.update(saved)


def sweep(
    device, points=POINTS, count: int | None = None, log: Callable[[str], None] = print
) -> tuple[list[dict], list[dict]]:
    """``(rows, tried)``: each variant's (the first ``count``) per-kernel times at each point, compiling each
    variant first (about 10-30 s each on a first run, Triton's cache after)."""
    rows, tried = [], variants()[:count]
    for i, tune in enumerate(tried):
        row: dict = {}
        for n, b in points:
            try:
                row[f"{n}x{b}"] = _with(tune, lambda n=n, b=b: kernel_times(_inputs(n, b, device), device=device))
            except Exception as e:  # noqa: BLE001 - a setting the card cannot launch (shared memory) is left out
                if "CUDA error" in str(e) or "illegal" in str(e):  # a fault poisons the context: stop, say so
                    raise
                row[f"{n}x{b}"] = {"error": repr(e)[:200]}
        rows.append(row)
        times = (f"{p} {sum(t.values()):.3f} ms" if "error" not in t else f"{p} failed" for p, t in row.items())
        log(f"  variant {i + 1}/{len(tried)}: products {tune['chunk_output']}, scans {tune['state_scan']}: "
            + ", ".join(times))  # fmt: skip
    return rows, tried


def agreement(settings: dict, device, n: int = 300, b: int = 2) -> dict[str, float]:
    """Relative differences of the output and each gradient under ``settings`` against the defaults (same inputs;
    the settings change the tiling, so only the accumulation order: ~1e-3 in bf16)."""
    from lambdanet.ops import causal_lambda

    g = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn(b, n, 8, 16, generator=g), 3 * torch.randn(b, n, 16, 1, generator=g),
          torch.randn(b, n, 208, 1, generator=g), torch.randn(64, 16, 1, generator=g) / 4]  # fmt: skip
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16, torch.float32)
    xs = [x.to(device, dt) for x, dt in zip(xs, dtypes)]
    dy = torch.randn(b, n, 8, 208, generator=g).to(device, torch.bfloat16)

    def run():
        ins = [x.clone().requires_grad_() for x in xs]
        out = causal_lambda(*ins, mode="fused_chunk", chunk_size=FC.default_chunk(8))
        out.backward(dy)
        return [out.detach()] + [t.grad for t in ins]

    ref, got = _with({}, run), _with(settings, run)
    return {name: float((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
            for name, a, r in zip(("out", "dq", "dkeys", "dvalues", "demb"), got, ref)}  # fmt: skip


def cuda_median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10, device=None) -> float:
    """Median ms of ``fn`` on ``device``'s current CUDA stream (default: the current device's; CUDA events, after
    ``warmup`` calls): the GPU ``fn``'s tensors are on, whichever is current (events on another GPU's stream time
    none of its work)."""
    for _ in range(warmup):
        fn()
    device = torch.device("cuda") if device is None else torch.device(device)
    times = sorted(timed_call(fn, device) * 1e3 for _ in range(reps))  # each call waited for, as ms
    return times[len(times) // 2]


def compare(settings: dict, device, points=POINTS + ((8192, 8),), reps: int = 10) -> list[dict]:
    """Forward + backward ms (CUDA events, median) at the defaults and under ``settings``, side by side."""
    out = []
    for n, b in points:
        for label, tune in (("default", dict(FC.tune())), ("tuned", settings)):
            ms = _with(tune, lambda n=n, b=b: cuda_median_ms(_inputs(n, b, device), warmup=1, reps=reps, device=device))
            out.append({"n": n, "b": b, "settings": label, "ms": ms, "tokens_per_s": n * b / ms * 1e3})
    return out


def bench_part(s, out, log):
    """The ``causal_tune`` part of ``lambdanet bench`` (settings ``s``: device, quick)."""
    from lambdanet.bench.report import markdown

    log("== causal_tune: the fused causal lambda's launch settings for this GPU")
    if torch.device(s.device).type != "cuda" or not FC.available(s.device)[0]:
        log("  skipped: the kernels' launch settings are tuned on a CUDA device with Triton (--device cuda)")
        return {}, ["## Causal lambda: launch settings", "", "Skipped: needs a CUDA device with Triton.", ""]
    points = ((1024, 4),) if s.quick else POINTS
    rows, tried = sweep(s.device, points, count=2 if s.quick else None, log=log)
    best = compose(rows, tried, dict(FC.tune()))
    never = [k for k in FC.KERNELS if not any(k in t for row in rows for t in row.values())]
    agree = agreement(best, s.device)
    log("  tuned against the defaults (relative): " + ", ".join(f"{k} {v:.1e}" for k, v in agree.items()))
    timed = compare(best, s.device, points if s.quick else POINTS + ((8192, 8),), reps=3 if s.quick else 10)
    env = tune_env(best)
    log(f"  export LAMBDANET_CAUSAL_TUNE='{env}'")
    settings = [{"kernel": k, "default": str(FC.tune()[k]), "tuned": str(v)} for k, v in best.items()]
    note = f" Never timed (kept at the default): {', '.join(never)}." if never else ""
    return {"causal_tune": timed, "causal_tune_settings": settings, "causal_tune_agreement": [agree]}, [
        "## Causal lambda: launch settings for this GPU",
        "",
        "Each kernel's fastest (warps, block_v, stages) over the sweep; apply them with",
        f"`export LAMBDANET_CAUSAL_TUNE='{env}'`. Output and gradients against the defaults' (relative): "
        + ", ".join(f"{k} {v:.1e}" for k, v in agree.items())
        + "."
        + note,
        "",
        markdown(settings, [("kernel", "kernel"), ("default", "default"), ("tuned", "tuned")]),
        "",
        markdown(
            timed,
            [("n", "n"), ("b", "b"), ("settings", "settings"), ("ms", "fwd+bwd ms"), ("tokens_per_s", "tokens/s")],
        ),  # fmt: skip
        "",
    ]
