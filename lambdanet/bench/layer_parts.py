"""The layer parts of ``lambdanet bench`` (:mod:`lambdanet.bench.runner`), measured by
:mod:`lambdanet.bench.layer_bench`: ``targets`` (our ``LambdaLayer`` against the peers), ``impls`` (every position
implementation and ``impl="auto"``), ``attention`` (halo and global relative attention against timm) and
``scaling`` (the spatial layers across resolutions and batches)."""

from __future__ import annotations

from pathlib import Path

from lambdanet.bench import layer_bench
from lambdanet.bench.part import BenchSettings, Log, PartResult
from lambdanet.bench.report import RowLog, markdown, plot_scaling
from lambdanet.ops.position_lambda.tuning import impl_tuning_mode

__all__ = ["AUTO_TARGET", "targets", "impls", "attention", "scaling"]


def targets(s: BenchSettings, out: Path, log: Log) -> PartResult:
    """``targets``: our ``LambdaLayer`` against timm's and lucidrains' at ``layer_bench.TARGET_POINTS``."""
    log("== targets: LambdaLayer against the peers (forward+backward)")
    points = [(2, 32, 8, 5), (2, 32, 8, None)] if s.quick else layer_bench.TARGET_POINTS
    rows = layer_bench.lambda_vs_peers(points, device=s.device, repeats=s.value("repeats", 2), amp=s.amp, log=log)
    report = [
        "## LambdaLayer against the peers (forward+backward)",
        "",
        markdown(
            rows,
            [
                ("batch", "B"),
                ("channels", "C"),
                ("side", "size"),
                ("scope", "scope"),
                ("impl", "implementation"),
                ("median_ms", "ms"),
                ("iqr_ms", "IQR ms"),
                ("peak_bytes", "peak bytes"),
                ("ratio_vs_fastest_peer", "speed-up vs fastest peer"),
                ("memory_ratio", "memory vs that peer"),
            ],
        ),
        "",
    ]
    ours = [r for r in rows if r["impl"] == "lambdanet" and "ratio_vs_fastest_peer" in r]
    if ours:
        gm = layer_bench.geomean([r["ratio_vs_fastest_peer"] for r in ours])
        report += [
            f"Geometric-mean speed-up against the fastest peer: {gm:.2f}x; slowest point "
            f"{min(r['ratio_vs_fastest_peer'] for r in ours):.2f}x; largest memory "
            f"ratio {max(r['memory_ratio'] for r in ours):.2f}.",
            "",
        ]
    return {"targets": rows}, report


AUTO_TARGET = 1.2  # impl="auto" within this factor of the fastest implementation at every point (issue 39)


def impls(s: BenchSettings, out: Path, log: Log) -> PartResult:
    """``impls``: every position implementation of ``LambdaLayer`` and ``impl="auto"`` (its guard: within
    :data:`AUTO_TARGET` of the fastest)."""
    log("== impls: every LambdaLayer position implementation and auto (forward+backward)")
    points = [(2, 32, 8, 5), (2, 32, 8, None)] if s.quick else layer_bench.IMPLS_PART_POINTS
    repeats = s.value("repeats", 2)
    kept = RowLog(out, "impls", {"points": points, "repeats": repeats, "amp": s.amp, "device": s.device})
    rows = layer_bench.lambda_impls(points, device=s.device, repeats=repeats, amp=s.amp, log=log, kept=kept)
    return {"impls": rows}, [
        "## LambdaLayer implementations (forward+backward)",
        "",
        markdown(
            [r for r in rows if r["impl"] != "auto"],
            [
                ("batch", "B"),
                ("channels", "C"),
                ("side", "size"),
                ("scope", "scope"),
                ("impl", "impl"),
                ("median_ms", "ms"),
                ("peak_bytes", "peak bytes"),
                ("slowdown_vs_fastest", "x fastest"),
                ("auto", "auto's pick"),
                ("fastest", "fastest"),
            ],
        ),
        "",
        *_auto_report([r for r in rows if r["impl"] == "auto"]),
    ]


def _auto_report(autos: list[dict]) -> list[str]:
    """The ``impls`` part's guard of ``impl="auto"``: its time over the fastest implementation's at every point."""
    if not autos:
        return []
    within = [r for r in autos if r["auto_over_fastest"] <= AUTO_TARGET]
    worst = max(autos, key=lambda r: r["auto_over_fastest"])
    return [
        f"### `auto` against the fastest implementation (tuning mode: {impl_tuning_mode()})",
        "",
        markdown(
            autos,
            [
                ("batch", "B"),
                ("channels", "C"),
                ("side", "size"),
                ("scope", "scope"),
                ("fastest_impl", "fastest"),
                ("auto_impl", "auto ran"),
                ("static_impl", "static pick"),
                ("median_ms", "auto ms"),
                ("auto_over_fastest", "auto/fastest"),
            ],
        ),
        "",
        f"`auto` within {AUTO_TARGET}x of the fastest implementation at {len(within)} of {len(autos)} points; "
        f"worst {worst['auto_over_fastest']:.2f}x (B={worst['batch']} C={worst['channels']} "
        f"{worst['side']}x{worst['side']} {worst['scope']}).",
        "",
    ]


def attention(s: BenchSettings, out: Path, log: Log) -> PartResult:
    """``attention``: our halo and global relative attention against timm's HaloAttn and BottleneckAttn."""
    log("== attention: halo and global relative attention against timm")
    points = [(2, 32, 16)] if s.quick else layer_bench.ATTENTION_POINTS
    rows = layer_bench.attention_vs_peers(points, device=s.device, repeats=s.value("repeats", 2), amp=s.amp, log=log)
    return {"attention": rows}, [
        "## Attention layers against timm (forward+backward)",
        "",
        markdown(
            rows,
            [
                ("kind", "layer"),
                ("batch", "B"),
                ("channels", "C"),
                ("side", "size"),
                ("impl", "implementation"),
                ("median_ms", "ms"),
                ("peak_bytes", "peak bytes"),
                ("ratio_vs_peer", "speed-up vs timm"),
                ("memory_ratio", "memory vs timm"),
            ],
        ),
        "",
    ]


def scaling(s: BenchSettings, out: Path, log: Log) -> PartResult:
    """``scaling``: the spatial layers across resolutions and batches, their log-log slopes and plots."""
    log("== scaling: spatial layers across resolutions and batches")
    quick_layers = ["global_attention", "local_attention_7x7", "lambda_conv_7x7", "lambda"]
    names = list(s.layers) if s.layers else (quick_layers if s.quick else list(layer_bench.LAYER_SUITE))
    sides = [8, 12] if s.quick else [14, 16, 24, 32, 48, 64, 96, 128]
    batches = [1] if s.quick else [1, 4]
    rows = layer_bench.layer_sweep(
        names, sides, batches, dim=16 if s.quick else 64, device=s.device, repeats=3, log=log
    )
    slopes = layer_bench.scaling_slopes(rows)
    plots = plot_scaling(rows, out)
    flagged = [r for r in rows + slopes if r.get("flags")]
    warning = (
        [
            f"**Warning: {len(flagged)} row(s) below are flagged unreliable** (timing rounds spreading by more "
            f"than {layer_bench.MAX_TIMING_SPREAD:.0%} of the median after a re-measurement, fwd+bwd faster than "
            "fwd, or a negative time slope): rerun on a quiet machine before quoting them.",
            "",
        ]
        if flagged
        else []
    )
    if flagged:
        log(f"warning: {len(flagged)} scaling row(s) flagged unreliable (see 'flags' in the report)")
    report = [
        "## Spatial layers across resolutions",
        "",
        *warning,
        markdown(
            rows,
            [
                ("layer", "layer"),
                ("side", "size"),
                ("batch", "B"),
                ("forward_ms", "fwd ms"),
                ("fwd_bwd_ms", "fwd+bwd ms"),
                ("peak_bytes", "peak bytes"),
                ("gflops_fwd_bwd", "GFLOPs"),
                ("flags", "flags"),
            ],
        ),
        "",
        "Log-log slopes against the number of positions (per example: growth of the peak with the batch).",
        "",
        markdown(
            slopes,
            [
                ("layer", "layer"),
                ("time_slope", "time slope"),
                ("memory_slope", "memory slope"),
                ("per_example_slope", "per-example memory slope"),
                ("flags", "flags"),
            ],
        ),
        "",
    ]
    report += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return {"scaling": rows, "scaling_slopes": slopes}, report
