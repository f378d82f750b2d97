"""Timing a layer for the benchmarks (:mod:`lambdanet.bench.layer_bench` re-exports it): one forward or
forward+backward pass (the forward optionally under autocast), several layers timed round-robin on one input
(:func:`interleaved_fwd_bwd`) so that a drifting machine speed affects them alike, then the peak memory and FLOPs
of each; and when a pair of timings is no clean number (:func:`timing_flags`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lambdanet.runtime import autocast_context, count_flops, peak_memory, time_round_robin

__all__ = ["bench_layer", "interleaved_fwd_bwd", "MAX_TIMING_SPREAD", "timing_flags"]


def _step(layer: nn.Module, x: torch.Tensor, backward: bool, amp: str = "none") -> Callable[[], None]:
    """One forward (``backward=False``) or forward+backward (``layer(x).sum().backward()``) pass, the forward
    under ``amp`` autocast (:func:`~lambdanet.runtime.autocast_context`)."""

    def step():
        with autocast_context(x.device, amp):
            y = layer(x)
        if backward:
            y.float().sum().backward()

    return step


def _measure(
    layers: dict[str, nn.Module],
    steps: dict[str, Callable[[], None]],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    max_seconds: float | None = None,
) -> dict[str, dict]:
    """Round-robin time, then peak memory and FLOPs of each step. The memory is that of a step that starts
    without parameter gradients (like a training step after ``zero_grad(set_to_none=True)``), so the
    gradients it creates are counted; they are dropped again afterwards."""
    timings = time_round_robin(steps, device, warmup=warmup, repeats=repeats, max_seconds=max_seconds)
    out = {}
    for name, step in steps.items():
        layers[name].zero_grad(set_to_none=True)
        out[name] = {
            "median_ms": timings[name].median_s * 1e3,
            "iqr_ms": timings[name].iqr_s * 1e3,
            "repeats": timings[name].repeats,
            "peak_bytes": peak_memory(step, device),
            "flops": count_flops(step),
        }
        layers[name].zero_grad(set_to_none=True)
    return out


def bench_layer(
    layer: nn.Module,
    x: torch.Tensor,
    *,
    backward: bool = True,
    repeats: int = 7,
    warmup: int = 2,
    max_seconds: float | None = 20.0,
) -> dict:
    """Median time, peak memory and FLOPs of one forward (or forward+backward) pass of ``layer`` on ``x``."""
    x = x.detach().requires_grad_(backward)
    return _measure(
        {"layer": layer},
        {"layer": _step(layer, x, backward)},
        x.device,
        repeats=repeats,
        warmup=warmup,
        max_seconds=max_seconds,
    )["layer"]


def interleaved_fwd_bwd(
    impls: dict[str, nn.Module],
    x: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 2,
    amp: str = "none",
    log=print,
) -> dict[str, dict]:
    """Forward+backward of several layers on the same input, timed round-robin (one call of each per round,
    the order shuffled) so that drifting machine speed affects them alike; then peak memory and FLOPs.
    ``amp`` autocasts the forwards. A layer whose warm-up fails (out of memory, unsupported input) is logged
    and left out."""
    xs = x.detach().requires_grad_(True)
    steps = {}
    for name, layer in impls.items():
        step = _step(layer, xs, backward=True, amp=amp)
        try:
            for _ in range(warmup):
                step()
        except RuntimeError as err:
            log(f"  {name}: failed ({str(err)[:80]})")
            continue
        steps[name] = step
    return _measure(impls, steps, x.device, repeats=repeats, warmup=0) if steps else {}


# a timing whose rounds spread (interquartile range) by more than this fraction of its median is not a clean
# number: on a 2-core VM, steal and other jobs easily move single rounds by 2x
MAX_TIMING_SPREAD = 0.25


def timing_flags(fwd: dict, fwd_bwd: dict, spread: float = MAX_TIMING_SPREAD) -> list[str]:
    """Why a (forward, forward+backward) pair of :func:`bench_layer` results cannot be trusted: rounds that
    disagree (``iqr / median > spread``, or a single round, which states no spread) or a forward+backward pass
    faster than the forward it contains. Empty when the pair is clean."""
    flags = []
    for name, res in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        if res.get("repeats", 0) < 3:
            flags.append(f"{name}: {res.get('repeats', 0)} round(s), no spread")
        elif res["iqr_ms"] > spread * res["median_ms"]:
            flags.append(f"{name}: rounds spread {res['iqr_ms'] / res['median_ms']:.0%} > {spread:.0%}")
    if fwd_bwd["median_ms"] < fwd["median_ms"]:
        flags.append("fwd+bwd faster than fwd")
    return flags
