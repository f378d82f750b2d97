"""Layer-level benchmarks: the spatial layers of LambdaNetworks Table 4 (and HaloNet) at matched
dimensions, across resolutions and batch sizes, and our ``LambdaLayer`` / attention against the peers.

``LAYER_SUITE`` names each configuration. :func:`layer_sweep` measures forward and forward+backward time,
peak memory and FLOPs across sizes and batches; :func:`scaling_slopes` fits the log-log slopes of its
rows against the number of positions (the complexity classes of Tables 2 and 4: 2 for global attention, 1
for local attention and the lambda convolution, and a per-example slope of at most 1 for the global lambda layer,
whose ``k n m`` term is shared by the batch). :func:`lambda_vs_peers` and :func:`attention_vs_peers`
time several implementations on one input round-robin (:func:`interleaved_fwd_bwd`, from
:mod:`lambdanet.bench.timing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lambdanet.bench.peers import peer_attention_layers, peer_lambda_layers
from lambdanet.bench.report import RowLog
from lambdanet.bench.timing import (  # re-exported: their old home
    MAX_TIMING_SPREAD,
    bench_layer,
    interleaved_fwd_bwd,
    timing_flags,
)
from lambdanet.layers import LambdaLayer, RelativePositionEmbedding, create_spatial_layer
from lambdanet.ops.position_lambda.tuning import auto_choice, impl_tuning_mode, isolated_tuning

__all__ = [
    "LayerConfig",
    "LAYER_SUITE",
    "TARGET_POINTS",
    "ATTENTION_POINTS",
    "IMPL_POINTS",
    "IMPLS_PART_POINTS",
    "lambda_impls",
    "triton_runs",
    "build_layer",
    "loglog_slope",
    "geomean",
    "bench_layer",
    "interleaved_fwd_bwd",
    "MAX_TIMING_SPREAD",
    "timing_flags",
    "layer_sweep",
    "scaling_slopes",
    "lambda_vs_peers",
    "attention_vs_peers",
]


@dataclass(frozen=True)
class LayerConfig:
    """A named spatial layer configuration: ``create_spatial_layer(layer, dim, dim, **kwargs)``."""

    name: str
    layer: str
    kwargs: dict = field(default_factory=dict)
    global_context: bool = False  # needs feat_size = the input size
    shared_embedding: bool = False  # lambda: one RelativePositionEmbedding for every instance
    paper: str = ""
    max_side: int = 128  # quadratic layers beyond this need tens of GB or minutes per call: skipped


LAYER_SUITE: dict[str, LayerConfig] = {
    c.name: c
    for c in [
        LayerConfig(
            "global_attention",
            "relative_self_attention",
            {"heads": 4},
            True,
            paper="Table 4 global self-attention",
            max_side=64,
        ),
        LayerConfig(
            "axial_attention", "axial_self_attention", {"heads": 4}, True, paper="Table 4 axial self-attention"
        ),
        LayerConfig(
            "local_attention_7x7",
            "local_self_attention",
            {"heads": 4, "kernel_size": 7},
            paper="Table 4 local self-attention (7x7)",
        ),
        LayerConfig(
            "halo_attention_b8_h3",
            "halo_attention",
            {"heads": 4, "block_size": 8, "halo_size": 3},
            paper="HaloNet blocked local attention",
        ),
        LayerConfig("lambda", "lambda", {}, True, paper="Table 4 lambda layer (global, k=16)", max_side=64),
        LayerConfig("lambda_k8", "lambda", {"dim_k": 8}, True, paper="Table 4 lambda layer |k|=8", max_side=64),
        LayerConfig(
            "lambda_shared",
            "lambda",
            {},
            True,
            shared_embedding=True,
            paper="Table 4 lambda layer, shared embeddings",
            max_side=64,
        ),
        LayerConfig("lambda_conv_7x7", "lambda_conv", {"r": 7}, paper="Table 4 lambda convolution (7x7)"),
        LayerConfig("conv_3x3", "conv", {}, paper="ResNet 3x3 convolution (Table 3)"),
        LayerConfig("conv_se", "conv_se", {}, paper="Table 3 squeeze-and-excitation"),
        LayerConfig("linear_attention", "linear_attention", {}, paper="Table 3 channel / linear attention"),
        LayerConfig("double_attention", "double_attention", {}, paper="Table 3 double attention (A^2-Nets)"),
        LayerConfig(
            "attention_augmented_conv",
            "attention_augmented_conv",
            {},
            True,
            paper="Table 3 attention augmentation (conv + global relative attention)",
            max_side=64,
        ),
    ]
}


def build_layer(
    config: LayerConfig, dim: int, side: int | tuple[int, int], shared: RelativePositionEmbedding | None = None
) -> nn.Module:
    """Instantiate ``config`` for ``dim`` channels on ``side x side`` inputs."""
    kwargs = {**config.kwargs, "embedding": shared} if config.shared_embedding else config.kwargs
    return create_spatial_layer(config.layer, dim, dim, feat_size=side if config.global_context else None, **kwargs)


def _shared_embedding(config: LayerConfig, side: int) -> RelativePositionEmbedding | None:
    dim_k = config.kwargs.get("dim_k", 16)
    return RelativePositionEmbedding.global_context(dim_k, side) if config.shared_embedding else None


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def geomean(values: Sequence[float]) -> float:
    """Geometric mean of the positive entries of ``values`` (``nan`` when there are none)."""
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


# (batch, channels, side, r) of the speed target (BENCHMARKS.md section 1): r=None is the global lambda layer
TARGET_POINTS = [(8, 256, 16, 9), (8, 256, 16, None), (32, 256, 14, 9), (8, 512, 8, 9), (8, 64, 56, 9)]


def lambda_vs_peers(
    points=TARGET_POINTS,
    *,
    device: str = "cpu",
    repeats: int = 5,
    dim_k: int = 16,
    heads: int = 4,
    amp: str = "none",
    log=print,
) -> list[dict]:
    """Forward+backward time and peak memory of our ``LambdaLayer`` and the peers' at each point.

    One row per (point, implementation) with ``ratio_vs_fastest_peer`` (peer time / ours, > 1 = we are
    faster) and ``memory_ratio`` (our peak / that peer's peak) on our rows.
    """
    rows = []
    for b, c, side, r in points:
        torch.manual_seed(0)
        x = torch.randn(b, c, side, side, device=device)
        impls: dict[str, nn.Module] = {"lambdanet": LambdaLayer(c, dim_k=dim_k, heads=heads, r=r, feat_size=side)}
        if triton_runs(device):  # the fused kernels, opt-in until measured: their own row
            impls["lambdanet-triton"] = LambdaLayer(c, dim_k=dim_k, heads=heads, r=r, feat_size=side, impl="triton")
        impls.update(peer_lambda_layers(c, side, r, dim_k=dim_k, heads=heads))
        point = {"batch": b, "channels": c, "side": side, "scope": "global" if r is None else f"{r}x{r}", "amp": amp}
        impls = {name: layer.to(device) for name, layer in impls.items()}
        results = interleaved_fwd_bwd(impls, x, repeats=repeats, amp=amp, log=log)
        rows += [{**point, "impl": name, **res} for name, res in results.items()]
        peers = {k: v for k, v in results.items() if not k.startswith("lambdanet")}
        if peers and "lambdanet" in results:
            fastest = min(peers, key=lambda k: peers[k]["median_ms"])
            for row in rows[-len(results) :]:
                if row["impl"].startswith("lambdanet"):
                    mine = results[row["impl"]]
                    row["fastest_peer"] = fastest
                    row["ratio_vs_fastest_peer"] = peers[fastest]["median_ms"] / mine["median_ms"]
                    row["memory_ratio"] = mine["peak_bytes"] / max(peers[fastest]["peak_bytes"], 1)
        log(_results_line(results, point))
    return rows


def _results_line(results: dict[str, dict], point: dict) -> str:
    """The log line of one comparison point: each implementation's time and peak memory."""
    timings = ", ".join(f"{k} {v['median_ms']:.1f} ms / {v['peak_bytes'] / 2**20:.0f} MiB" for k, v in results.items())
    return f"  {timings}  @ {point}"


def triton_runs(device: str | torch.device) -> bool:
    """Whether ``impl="triton"`` is benchmarked on ``device``: on CUDA only (Triton's CPU interpreter runs the
    kernels for tests; its timings mean nothing)."""
    from lambdanet.ops.position_lambda import kernels_available

    return torch.device(device).type == "cuda" and kernels_available(device)[0]


IMPL_POINTS = [(b, 256, side, r) for b in (64, 256) for side in (14, 28) for r in (7, 23, None)]
# what `lambdanet bench impls` measures: the grid above and the five speed-target points of section 1
IMPLS_PART_POINTS = IMPL_POINTS + [p for p in TARGET_POINTS if p not in IMPL_POINTS]


def lambda_impls(
    points=IMPL_POINTS,
    *,
    device: str = "cpu",
    repeats: int = 5,
    dim_k: int = 16,
    heads: int = 4,
    dim_u: int = 1,
    amp: str = "none",
    log=print,
    kept: RowLog | None = None,
) -> list[dict]:
    """Forward+backward time and peak memory of every position implementation of our ``LambdaLayer`` at each
    point (``(batch, channels, side, r)``; ``r=None`` global) and of ``impl="auto"`` itself, timed round-robin:
    the measurement an :class:`~lambdanet.layers.ImplPolicy` for the device is fitted to, and the guard of
    ``auto``. Its tuner starts afresh at every point (no winners, no cache file; the mode is the process's,
    :func:`~lambdanet.ops.position_lambda.tuning.impl_tuning_mode`), and its first call, where it times the
    candidates, is in the untimed warm-up. The ``"auto"`` row carries ``auto_impl`` (what it ran), ``static_impl`` (the
    static cost model's pick) and ``auto_over_fastest`` (its time over the fastest implementation's). With
    ``kept``, each point's rows are kept there as they are measured, and the points it holds are not measured again."""
    impls = ["einsum_qe", "einsum", "depthwise_conv", "conv"] + (["triton"] if triton_runs(device) else [])
    rows: list[dict] = []
    for b, c, side, r in points:
        point = {"batch": b, "channels": c, "side": side, "scope": "global" if r is None else f"{r}x{r}"}
        earlier = kept.done(**point) if kept is not None else []
        if earlier:
            rows += earlier
            log(f"  {(b, c, side, r)}: kept from an earlier run")
            continue
        torch.manual_seed(0)
        x = torch.randn(b, c, side, side, device=device)
        kwargs = dict(dim_k=dim_k, heads=heads, dim_u=dim_u, r=r, feat_size=side)
        layers: dict[str, nn.Module] = {impl: LambdaLayer(c, **kwargs, impl=impl).to(device) for impl in impls}
        auto = layers["auto"] = LambdaLayer(c, **kwargs).to(device)
        try:
            with isolated_tuning(impl_tuning_mode()):
                results = interleaved_fwd_bwd(layers, x, repeats=repeats, amp=amp, log=log)
                picked = auto_choice(auto, x, grad=True)
        except torch.OutOfMemoryError:
            log(f"  out of memory at {(b, c, side, r)}: skipped")
            continue
        static = auto.choose_impl((side, side), torch.device(device).type)
        rows += _impl_rows({**point, "dim_u": dim_u, "amp": amp}, results, picked, static)
        if kept is not None:
            kept.add(rows[-len(results) :])
        auto_row = next((row for row in rows[-len(results) :] if row["impl"] == "auto"), None)
        if auto_row is not None and "auto_over_fastest" in auto_row:
            log(
                f"  {(b, c, side, r)}: fastest {auto_row['fastest_impl']}, auto ran {picked} (static pick {static}): "
                f"{auto_row['auto_over_fastest']:.2f}x the fastest's time"
            )
    return rows


def _impl_rows(point: dict, results: dict[str, dict], picked: str, static: str) -> list[dict]:
    """One row per timed implementation of a :func:`lambda_impls` point, ``"auto"`` included."""
    explicit = {impl: res for impl, res in results.items() if impl != "auto"}
    if not explicit:
        return []
    fastest = min(explicit, key=lambda k: explicit[k]["median_ms"])
    rows = []
    for impl, res in results.items():
        row = {
            **point,
            "impl": impl,
            **res,
            "fastest": impl == fastest,
            "auto": impl == picked,
            "slowdown_vs_fastest": res["median_ms"] / explicit[fastest]["median_ms"],
        }
        if impl == "auto":
            row.update(fastest_impl=fastest, auto_impl=picked, static_impl=static)
            row["auto_over_fastest"] = row["slowdown_vs_fastest"]
        rows.append(row)
    return rows


def layer_sweep(
    names: Sequence[str],
    sides: Sequence[int],
    batches: Sequence[int],
    *,
    dim: int = 64,
    device: str = "cpu",
    repeats: int = 3,
    log=print,
) -> list[dict]:
    """Forward and forward+backward time, peak memory and FLOPs of each layer across sizes and batches.

    A point whose timings fail :func:`timing_flags` is measured once more with twice the rounds; if it still
    fails, its row carries the reasons under ``"flags"`` (and the log says so) instead of passing as clean."""
    rows = []
    for name in names:
        config = LAYER_SUITE[name]
        for side in sides:
            if side > config.max_side:
                log(f"  {name} {side}x{side}: skipped (quadratic in positions; capped at {config.max_side})")
                continue
            layer = build_layer(config, dim, side, _shared_embedding(config, side)).to(device)
            for b in batches:
                x = torch.randn(b, dim, side, side, device=device)
                try:
                    for rounds in (repeats, 2 * repeats):  # a second try when the first is not clean
                        fwd = bench_layer(layer, x, backward=False, repeats=rounds)
                        fb = bench_layer(layer, x, backward=True, repeats=rounds)
                        flags = timing_flags(fwd, fb)
                        if not flags:
                            break
                except RuntimeError as err:
                    log(f"  {name} {side}x{side} b{b}: failed ({str(err)[:60]})")
                    continue
                rows.append(
                    {
                        "layer": name,
                        "side": side,
                        "positions": side * side,
                        "batch": b,
                        "forward_ms": fwd["median_ms"],
                        "fwd_bwd_ms": fb["median_ms"],
                        "peak_bytes": fb["peak_bytes"],
                        "forward_peak_bytes": fwd["peak_bytes"],
                        "gflops_fwd_bwd": fb["flops"] / 1e9,
                        "flags": "; ".join(flags),
                    }
                )
                log(
                    f"  {name} {side}x{side} b{b}: fwd {fwd['median_ms']:.1f} ms, fwd+bwd {fb['median_ms']:.1f} ms, "
                    f"{fb['peak_bytes'] / 2**20:.1f} MiB" + (f"  [UNRELIABLE: {'; '.join(flags)}]" if flags else "")
                )
    return rows


def scaling_slopes(rows: Sequence[dict]) -> list[dict]:
    """Log-log slopes of :func:`layer_sweep` rows against the number of positions ``n = H W``, per layer.

    ``time_slope`` and ``memory_slope`` fit forward+backward time and peak memory at the smallest batch;
    with two batches ``b1 < b2``, ``per_example_slope`` fits the per-example memory
    ``(peak(b2) - peak(b1)) / (b2 - b1)`` (a term shared by the batch, like the global lambda layer's
    ``k n m`` embeddings, drops out of it). A layer measured at fewer than two sizes has no row. A time slope
    fitted to flagged points (:func:`timing_flags`), or negative (time falling as the positions grow), carries
    ``"flags"``: it is no measurement of the layer's scaling.
    """
    out = []
    for layer in dict.fromkeys(r["layer"] for r in rows):
        mine = [r for r in rows if r["layer"] == layer]
        batches = sorted({r["batch"] for r in mine})
        small = sorted((r for r in mine if r["batch"] == batches[0]), key=lambda r: r["positions"])
        if len(small) < 2:
            continue
        n = [r["positions"] for r in small]
        row = {
            "layer": layer,
            "batch": batches[0],
            "sides": len(small),
            "time_slope": loglog_slope(n, [r["fwd_bwd_ms"] for r in small]),
            "memory_slope": loglog_slope(n, [r["peak_bytes"] for r in small]),
        }
        flagged = [str(r["side"]) for r in small if r.get("flags")]
        flags = [f"unreliable timings at side {', '.join(flagged)}"] if flagged else []
        if row["time_slope"] < 0:
            flags.append("time falls as positions grow")
        row["flags"] = "; ".join(flags)
        if len(batches) >= 2:
            b1, b2 = batches[0], batches[-1]
            peaks = {(r["batch"], r["positions"]): r["peak_bytes"] for r in mine}
            pairs = [(p, (peaks[b2, p] - peaks[b1, p]) / (b2 - b1)) for p in n if (b2, p) in peaks]
            if len(pairs) >= 2 and all(v > 0 for _, v in pairs):
                row["per_example_slope"] = loglog_slope([p for p, _ in pairs], [v for _, v in pairs])
        out.append(row)
    return out


# (batch, channels, side) for the attention peers
ATTENTION_POINTS = [(8, 256, 16), (8, 128, 32), (32, 256, 14)]


def attention_vs_peers(
    points=ATTENTION_POINTS, *, device: str = "cpu", repeats: int = 5, heads: int = 4, amp: str = "none", log=print
) -> list[dict]:
    """Our HaloNet attention and global relative attention against timm's HaloAttn and BottleneckAttn at
    matched sizes (heads, block 8, halo 3), forward+backward, timed round-robin."""
    rows = []
    for b, c, side in points:
        torch.manual_seed(0)
        x = torch.randn(b, c, side, side, device=device)
        peers = peer_attention_layers(c, side, heads=heads)
        pairs = {
            "halo": (
                "lambdanet.halo_attention",
                create_spatial_layer("halo_attention", c, c, heads=heads, block_size=8, halo_size=3),
                "timm.HaloAttn",
            ),
            "global": (
                "lambdanet.relative_self_attention",
                create_spatial_layer("relative_self_attention", c, c, feat_size=side, heads=heads),
                "timm.BottleneckAttn",
            ),
        }
        for kind, (ours_name, ours, peer_name) in pairs.items():
            impls = {ours_name: ours.to(device)}
            if peer_name in peers:
                impls[peer_name] = peers[peer_name].to(device)
            res = interleaved_fwd_bwd(impls, x, repeats=repeats, amp=amp, log=log)
            point = {"kind": kind, "batch": b, "channels": c, "side": side, "amp": amp}
            for name, r in res.items():
                row = {**point, "impl": name, **r}
                if name == ours_name and peer_name in res:
                    row["ratio_vs_peer"] = res[peer_name]["median_ms"] / r["median_ms"]
                    row["memory_ratio"] = r["peak_bytes"] / max(res[peer_name]["peak_bytes"], 1)
                rows.append(row)
            log(_results_line(res, point))
    return rows
