"""``lambdanet bench``: run the benchmark parts and write CSV/JSON, plots and ``bench.md`` into one folder.

Parts:

* ``targets``: our ``LambdaLayer`` against the peers at the issue's five points (forward+backward time,
  peak memory, ratio to the fastest peer, geometric mean).
* ``attention``: our HaloNet and global relative attention against timm's HaloAttn and BottleneckAttn.
* ``scaling``: every Table 4 layer (and HaloNet's) across resolutions and batches: forward and
  forward+backward time, peak memory and FLOPs, with log-log plots against the number of positions.
* ``models``: model suites (Table 13 hybrids, Table 14, HaloNet, MobileNet, the 26-layer hybrid).
* ``table4``: Table 4's memory column from the complexity formulas on each variant's layer shapes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from lambdanet.bench import layers as L
from lambdanet.bench import models as M
from lambdanet.bench.report import environment, markdown, plot_scaling, write_rows

__all__ = ["PARTS", "run_benchmarks"]

PARTS = ("targets", "attention", "scaling", "models", "table4")


def run_benchmarks(parts: Sequence[str] = PARTS, *, device: str = "cpu", out: str | Path = "bench_results",
                   quick: bool = False, suites: Sequence[str] = ("table13", "hybrid26", "mobilenet", "halonet"),
                   img_size: int = 224, batch_size: int = 8, repeats: int = 5, amp: str = "none",
                   channels_last: bool = False, compile: bool = False, layers: Sequence[str] | None = None,
                   log=print) -> dict:
    """Run ``parts``; returns ``{part: rows}`` and writes ``<out>/<part>.{json,csv}``, plots and ``bench.md``.
    ``amp``, ``channels_last`` and ``compile`` apply to the models part (see ``models.bench_model``);
    ``layers`` picks the scaling part's layers among ``layers.LAYER_SUITE`` (default: all)."""
    if amp not in ("none", "bf16", "fp16"):
        raise ValueError(f"amp must be one of none, bf16, fp16; got {amp!r}")
    if amp == "fp16" and device != "cuda":
        raise ValueError("amp='fp16' needs device='cuda'; use amp='bf16' on CPU")
    unknown_layers = sorted(set(layers or ()) - set(L.LAYER_SUITE))
    if unknown_layers:
        raise ValueError(f"unknown bench layer(s) {unknown_layers}; valid: {', '.join(L.LAYER_SUITE)}")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown bench part(s) {unknown}; valid: {', '.join(PARTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    results: dict[str, list[dict]] = {}
    report = [f"# lambdanet bench ({time.strftime('%Y-%m-%d')})", "",
              "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    if "targets" in parts:
        log("== targets: LambdaLayer against the peers (forward+backward)")
        points = [(2, 32, 8, 5), (2, 32, 8, None)] if quick else L.TARGET_POINTS
        rows = L.lambda_vs_peers(points, device=device, repeats=2 if quick else repeats, log=log)
        results["targets"] = rows
        ours = [r for r in rows if r["impl"] == "lambdanet"]
        report += ["## LambdaLayer against the peers (forward+backward)", "",
                   markdown(rows, [("batch", "B"), ("channels", "C"), ("side", "size"), ("scope", "scope"),
                                   ("impl", "implementation"), ("median_ms", "ms"), ("iqr_ms", "IQR ms"),
                                   ("peak_bytes", "peak bytes"), ("ratio_vs_fastest_peer", "speed-up vs fastest peer"),
                                   ("memory_ratio", "memory vs that peer")]), ""]
        if ours and any("ratio_vs_fastest_peer" in r for r in ours):
            gm = L.geomean([r.get("ratio_vs_fastest_peer") for r in ours])
            report += [f"Geometric-mean speed-up against the fastest peer: {gm:.2f}x; slowest point "
                       f"{min(r.get('ratio_vs_fastest_peer', float('inf')) for r in ours):.2f}x; largest memory "
                       f"ratio {max(r.get('memory_ratio', 0) for r in ours):.2f}.", ""]
    if "attention" in parts:
        log("== attention: halo and global relative attention against timm")
        points = [(2, 32, 16)] if quick else L.ATTENTION_POINTS
        rows = L.attention_vs_peers(points, device=device, repeats=2 if quick else repeats, log=log)
        results["attention"] = rows
        report += ["## Attention layers against timm (forward+backward)", "",
                   markdown(rows, [("kind", "layer"), ("batch", "B"), ("channels", "C"), ("side", "size"),
                                   ("impl", "implementation"), ("median_ms", "ms"), ("peak_bytes", "peak bytes"),
                                   ("ratio_vs_peer", "speed-up vs timm"), ("memory_ratio", "memory vs timm")]), ""]
    if "scaling" in parts:
        log("== scaling: spatial layers across resolutions and batches")
        names = list(layers) if layers else (
            ["global_attention", "local_attention_7x7", "lambda_conv_7x7", "lambda"] if quick else list(L.LAYER_SUITE))
        sides = [8, 12] if quick else [14, 16, 24, 32, 48, 64, 96, 128]
        batches = [1] if quick else [1, 4]
        rows = L.layer_sweep(names, sides, batches, dim=16 if quick else 64, device=device,
                             repeats=1 if quick else 3, log=log)
        results["scaling"] = rows
        plots = plot_scaling(rows, out)
        report += ["## Spatial layers across resolutions", "",
                   markdown(rows, [("layer", "layer"), ("side", "size"), ("batch", "B"), ("forward_ms", "fwd ms"),
                                   ("fwd_bwd_ms", "fwd+bwd ms"), ("peak_bytes", "peak bytes"),
                                   ("gflops_fwd_bwd", "GFLOPs")]), ""]
        report += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    if "models" in parts:
        rows = []
        for suite in (["hybrid26"] if quick else suites):
            log(f"== models: {suite}")
            rows += M.run_model_suite(suite, img=32 if quick else img_size, batch=2 if quick else batch_size,
                                      device=device, repeats=1 if quick else 3, amp=amp,
                                      channels_last=channels_last, compile=compile, log=log)
        results["models"] = rows
        report += ["## Models", "", f"Precision {'fp32' if amp == 'none' else amp + ' autocast'}, "
                   f"{'channels_last' if channels_last else 'NCHW'}, {'torch.compile' if compile else 'eager'}.", "",
                   markdown(rows, [("suite", "suite"), ("model", "model"), ("params", "params"), ("gflops", "GFLOPs"),
                                   ("train_images_per_s", "train img/s"), ("train_relative", "train rel."),
                                   ("infer_images_per_s", "infer img/s"), ("infer_relative", "infer rel."),
                                   ("train_peak_bytes", "train peak bytes")]
                            + ([("error", "failed")] if any("error" in r for r in rows) else [])), ""]
    if "table4" in parts:
        log("== table4: memory column")
        rows = M.table4_memory()
        check = M.validate_quadratic_memory()
        results["table4"] = rows
        results["table4_check"] = check
        report += ["## Table 4 memory (batch 128, 224x224, fp32)", "",
                   markdown(rows, [("variant", "variant"), ("ours_gb", "ours (GB)"), ("paper_gb", "paper (GB)")]), "",
                   markdown(check, [("layer", "layer"), ("side", "size"), ("batch", "B"),
                                    ("measured_bytes", "measured peak"), ("formula_bytes", "formula tensor")]), ""]
    for part, rows in results.items():
        write_rows(rows, out, part)
    (out / "bench.md").write_text("\n".join(report) + "\n")
    log(f"-> {out / 'bench.md'}")
    return results
