"""``lambdanet bench``: run the benchmark parts and write CSV/JSON, plots and ``bench.md`` into one folder.

Parts (:data:`PARTS`, each a function of the :class:`BenchSettings` that returns its rows and its section
of ``bench.md``):

* ``targets``: our ``LambdaLayer`` against timm's and lucidrains' at the points of ``layer_bench.TARGET_POINTS``
  (forward+backward time, peak memory, ratio to the fastest peer, geometric mean).
* ``impls``: every position implementation of ``LambdaLayer`` and ``impl="auto"`` at the grid of
  ``layer_bench.IMPL_POINTS`` and the five target points (forward+backward time, peak memory, the fastest, what
  ``auto`` ran and its time over the fastest's: the guard of the measuring tuner, target within 1.2x).
* ``attention``: our HaloNet and global relative attention against timm's HaloAttn and BottleneckAttn.
* ``scaling``: every Table 4 layer (and HaloNet's) across resolutions and batches: forward and
  forward+backward time, peak memory and FLOPs, log-log slopes and plots against the number of positions.
* ``models``: model suites (Table 13 hybrids, Table 14, HaloNet, MobileNet, the 26-layer hybrid).
* ``detection``: the detection study's backbones (ResNet-26, +SE, lambda and halo hybrids) alone at 512,
  768 and 1024 px, batch 1 and 2: forward and training time, peak memory, memory's slope against image area.
* ``kernels``: the fused Triton position kernels' roofline on a CUDA device (``kernel_bench``): the device's
  copy and matrix-product ceilings, then each kernel call's time, rate, bound and fraction of its ceiling.
* ``table4``: Table 4's memory column from the complexity formulas on each variant's layer shapes.
* ``lm``: the language models (``lambda_lm_tiny`` against the same-size transformer and linear-attention LMs):
  training tokens/s and peak memory at contexts 256 to 8192, generation latency and state size at 1k to 16k.
* ``lm_recall``: associative recall (key-value pairs, then queries) of the LM families of one size against the
  number of pairs, trained under a curriculum over the pairs, three seeds: where a constant-size state stops being
  enough (:mod:`lambdanet.bench.recall_bench`).
* ``lm_quality``: the same three trained at context 512 on the standard library for equal time and for equal
  steps, three seeds each (about 35 minutes on 2 CPU cores): validation bits per byte, mean and spread.
* ``lm_ablation``: the lambda layer's knobs and options at the transformer's parameter budget, 1,200 steps at
  context 256, three seeds (:mod:`lambdanet.bench.lm_ablation`: hours on 2 CPU cores; resumable in ``--out``).
* ``causal_tune``: the fused causal lambda's launch settings for this GPU (:mod:`lambdanet.bench.causal_tune`;
  ``--device cuda``): each kernel's fastest setting, timed against the defaults, and the line to export.

A missing peer package leaves out its rows; a line on stderr and in ``bench.md`` says so and how to install it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lambdanet.bench import (
    causal_tune,
    detection_bench,
    kernel_bench,
    layer_bench,
    lm_ablation,
    lm_bench,
    model_bench,
    recall_bench,
)
from lambdanet.bench.layer_parts import attention, impls, scaling, targets
from lambdanet.bench.part import DEFAULT_SUITES, BenchSettings, Log, Part, PartResult
from lambdanet.bench.peers import missing_peers_warning
from lambdanet.bench.report import environment, markdown, write_rows
from lambdanet.files import check_output_dir
from lambdanet.helpers import check_positive_int, require
from lambdanet.runtime import check_amp

__all__ = ["BenchSettings", "Part", "PARTS", "DEFAULT_PARTS", "DEFAULT_SUITES", "run_benchmarks"]

DEFAULT_PARTS = ("targets", "scaling", "table4")  # what ``lambdanet bench`` runs without part names


def _models(s: BenchSettings, out: Path, log: Log) -> PartResult:
    rows = []
    for suite in s.model_suites:
        log(f"== models: {suite}")
        rows += model_bench.run_model_suite(
            suite,
            img=32 if s.quick else s.img_size,
            batch=2 if s.quick else s.batch_size,
            device=s.device,
            repeats=1 if s.quick else 3,
            amp=s.amp,
            channels_last=s.channels_last,
            compile=s.compile,
            log=log,
        )
    precision = "fp32" if s.amp == "none" else s.amp + " autocast"
    return {"models": rows}, [
        "## Models",
        "",
        f"Precision {precision}, {'channels_last' if s.channels_last else 'NCHW'}, "
        f"{'torch.compile' if s.compile else 'eager'}.",
        "",
        markdown(
            rows,
            [
                ("suite", "suite"),
                ("model", "model"),
                ("params", "params"),
                ("gflops", "GFLOPs"),
                ("train_images_per_s", "train img/s"),
                ("train_relative", "train rel."),
                ("infer_images_per_s", "infer img/s"),
                ("infer_relative", "infer rel."),
                ("train_peak_bytes", "train peak bytes"),
            ]
            + ([("error", "failed")] if any("error" in r for r in rows) else []),
        ),
        "",
    ]


def _detection(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== detection: backbone-only time and peak memory at detection sizes")
    sizes, batches = (
        ((64, 96, 128), (1,)) if s.quick else (detection_bench.DETECTION_SIZES, detection_bench.DETECTION_BATCHES)
    )
    rows = detection_bench.backbone_costs(
        sizes=sizes, batches=batches, device=s.device, repeats=1 if s.quick else 3, log=log
    )
    slopes = detection_bench.memory_slopes(rows)
    return {"detection": rows, "detection_slopes": slopes}, [
        "## Detection backbones (backbone only, quick-recipe width)",
        "",
        markdown(
            rows,
            [
                ("label", "backbone"),
                ("params", "params"),
                ("size", "size"),
                ("batch", "B"),
                ("forward_ms", "forward ms"),
                ("forward_peak_bytes", "forward peak bytes"),
                ("train_ms", "fwd+bwd ms"),
                ("train_peak_bytes", "fwd+bwd peak bytes"),
            ],
        ),
        "",
        "Log-log slope of peak memory against image area (1: linear, 2: quadratic).",
        "",
        markdown(
            slopes,
            [
                ("backbone", "backbone"),
                ("batch", "B"),
                ("sizes", "sizes"),
                ("forward_memory_slope", "forward slope"),
                ("train_memory_slope", "fwd+bwd slope"),
                ("area_ratio", "area ratio"),
                ("train_peak_ratio", "fwd+bwd peak ratio"),
            ],
        ),
        "",
    ]


def _table4(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== table4: memory column")
    rows = model_bench.table4_memory()
    check = model_bench.validate_quadratic_memory()
    return {"table4": rows, "table4_check": check}, [
        "## Table 4 memory (batch 128, 224x224, fp32)",
        "",
        markdown(rows, [("variant", "variant"), ("ours_gb", "ours (GB)"), ("paper_gb", "paper (GB)")]),
        "",
        markdown(
            check,
            [
                ("layer", "layer"),
                ("side", "size"),
                ("batch", "B"),
                ("measured_bytes", "measured peak"),
                ("formula_bytes", "formula tensor"),
            ],
        ),
        "",
    ]


def _kernels(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== kernels: the position kernels against the device's ceilings")
    if not layer_bench.triton_runs(s.device):
        log("  skipped: the kernels' roofline is measured on a CUDA device with Triton (--device cuda)")
        return {}, ["## Position kernels' roofline", "", "Skipped: needs a CUDA device with Triton.", ""]
    ceiling = kernel_bench.ceilings(s.device)
    log("  ceilings: " + ", ".join(f"{k} {v:,.0f}" for k, v in ceiling.items()))
    points = [(8, 14, 256, 23), (8, 14, 256, None)] if s.quick else kernel_bench.KERNEL_POINTS
    rows = kernel_bench.position_roofline(points, device=s.device, ceiling=ceiling, log=log)
    return {"kernels": rows, "ceilings": [ceiling]}, [
        "## Position kernels' roofline",
        "",
        "Ceilings measured in this run: " + ", ".join(f"{k} {v:,.0f}" for k, v in ceiling.items()) + ".",
        "",
        markdown(
            rows,
            [
                ("batch", "B"),
                ("side", "size"),
                ("channels", "C"),
                ("scope", "scope"),
                ("dtype", "dtype"),
                ("pass", "pass"),
                ("ms", "ms"),
                ("TFLOPs", "TFLOP/s"),
                ("GBps", "GB/s"),
                ("bound", "bound"),
                ("fraction", "fraction of ceiling"),
            ],
        ),
        "",
    ]


def _lm(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== lm: training throughput and memory against context, generation latency and state")
    size, contexts, gen_contexts = (
        ("nano", (64, 128), (64, 256))
        if s.quick
        else ("tiny", (256, 512, 1024, 2048, 4096, 8192), (1024, 2048, 4096, 8192, 16384))
    )
    train = lm_bench.throughput(
        size, contexts, tokens_per_step=256 if s.quick else 4096, device=s.device, repeats=1 if s.quick else 3, log=log
    )
    gen = lm_bench.generation(size, gen_contexts, device=s.device, steps=3 if s.quick else 20, log=log)
    slopes = lm_bench.memory_slopes(train, lo=contexts[0] if s.quick else 1024, hi=contexts[-1])
    plots = lm_bench.plot_lm_study(train, gen, [], out)
    return {"lm_train": train, "lm_memory_slopes": slopes, "lm_generation": gen}, [
        f"## Language models: {size} (lambda, the plain lambda layer of before 0.2.0, transformer, linear attention)",
        "",
        "Training (forward+backward), `max(1, 4096 // context)` sequences per step; peak memory of one sequence.",
        "",
        markdown(
            train,
            [
                ("mixer", "mixer"),
                ("context", "context"),
                ("batch", "B"),
                ("tokens_per_s", "tokens/s"),
                ("speed_vs_transformer", "x transformer"),
                ("peak_bytes_one_sequence", "peak bytes (1 seq)"),
            ],
        ),
        "",
        markdown(
            slopes,
            [
                ("mixer", "mixer"),
                ("contexts", "contexts"),
                ("memory_slope", "log-log memory slope"),
                ("mib_per_1k_tokens", "MiB per 1k tokens"),
            ],
        ),
        "",
        "Generation, batch 1: one step after a context of n tokens.",
        "",
        markdown(
            gen,
            [
                ("mixer", "mixer"),
                ("context", "context"),
                ("ms_per_token", "ms/token"),
                ("speed_vs_transformer", "x transformer"),
                ("state_bytes", "state bytes"),
                ("step_peak_bytes", "step peak bytes"),
            ],
        ),
        "",
    ] + [f"![{p.stem}]({p.name})" for p in plots] + [""]


def _lm_quality(s: BenchSettings, out: Path, log: Log) -> PartResult:
    from lambdanet.tasks.lm.data import load_corpus

    log("== lm_quality: validation bits per byte at equal time and equal steps")
    kw = (
        dict(size="nano", context=64, batch=2, steps=3, seconds=0.5, seeds=(0, 1), eval_bytes=2048)
        if s.quick
        else dict(size="tiny")
    )
    rows = lm_bench.quality(load_corpus("stdlib"), device=s.device, log=log, **kw)
    lm_bench.check_finite(rows)
    summary = lm_bench.quality_summary(rows)
    plots = lm_bench.plot_lm_study([], [], rows, out)
    first = rows[0]
    return {"lm_quality": rows, "lm_quality_summary": summary}, [
        f"## Language models: bits per byte at equal time and equal steps ({first['model'].rsplit('_', 1)[1]}, "
        f"context {first['context']}, batch {first['batch']}, stdlib)",
        "",
        markdown(
            summary,
            [
                ("budget", "budget"),
                ("mixer", "mixer"),
                ("seeds", "seeds"),
                ("mean_bits_per_byte", "mean bits/byte"),
                ("std_bits_per_byte", "std"),
                ("min_bits_per_byte", "min"),
                ("max_bits_per_byte", "max"),
                ("vs_transformer", "/ transformer"),
                ("mean_steps", "steps"),
                ("mean_train_s", "train s"),
            ],
        ),
        "",
    ] + [f"![{p.stem}]({p.name})" for p in plots] + [""]


def _lm_recall(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== lm_recall: associative recall against the number of key-value pairs (2 learning rates x 3 seeds)")
    rows = (
        recall_bench.recall(
            pairs=(2,), steps=2, batch=4, eval_batches=1, device=s.device, seeds=(0,), lrs=(1e-3,), log=log
        )
        if s.quick
        else recall_bench.recall(device=s.device, log=log)
    )
    cols = [("model", "model"), ("lr", "best lr"), ("pairs", "pairs"), ("sequence", "tokens"),
            ("mean", "mean accuracy"), ("best", "best"), ("learnt", "seeds >= 90%"),
            ("reached", "trained up to pairs")]  # fmt: skip
    size, summary = rows[0]["model"].rsplit("_", 1)[1], recall_bench.summarize_recall(rows)
    return {"lm_recall": rows, "lm_recall_summary": summary}, [
        f"## Language models: associative recall ({size}, {rows[0]['steps']} steps, chance {rows[0]['chance']:.3f})",
        "",
        markdown(summary, cols),
        "",
    ]


def _lm_ablation(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== lm_ablation: the lambda layer's knobs and options at one parameter budget (resumable in --out)")
    if s.quick:
        rows = lm_ablation.study(("transformer", "lambda"), size="nano", seeds=(0,), steps=2, context=32, batch=2,
                                 out=out, eval_bytes=256, device=s.device, log=log)  # fmt: skip
    else:
        rows = lm_ablation.study(out=out, device=s.device, log=log)
    return {"lm_ablation_summary": lm_ablation.summarize(rows)}, [
        f"## Language models: ablations ({rows[0]['size']}, {rows[0]['steps']} steps, context {rows[0]['context']})",
        "",
        lm_ablation.summary_table(rows),
        "",
    ]


PARTS: dict[str, Part] = {
    "targets": Part(targets, lambda s: ("timm", "lambda_networks")),
    "impls": Part(impls, lambda s: ()),
    "attention": Part(attention, lambda s: ("timm",)),
    "scaling": Part(scaling, lambda s: ()),
    "models": Part(_models, lambda s: model_bench.suite_peers(s.model_suites)),
    "table4": Part(_table4, lambda s: ()),
    "detection": Part(_detection, lambda s: ()),
    "lm": Part(_lm, lambda s: ()),
    "lm_quality": Part(_lm_quality, lambda s: ()),
    "lm_recall": Part(_lm_recall, lambda s: ()),
    "lm_ablation": Part(_lm_ablation, lambda s: ()),
    "kernels": Part(_kernels, lambda s: ()),
    "causal_tune": Part(causal_tune.bench_part, lambda s: ()),
}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def run_benchmarks(
    parts: Sequence[str] = tuple(PARTS),
    *,
    device: str = "cpu",
    out: str | Path = "bench_results",
    quick: bool = False,
    suites: Sequence[str] = DEFAULT_SUITES,
    img_size: int = 224,
    batch_size: int = 8,
    repeats: int = 5,
    amp: str = "none",
    channels_last: bool = False,
    compile: bool = False,
    layers: Sequence[str] | None = None,
    log: Log = print,
    warn: Log = _stderr,
) -> dict:
    """Run ``parts``; returns ``{name: rows}`` and writes ``<out>/<name>.{json,csv}``, plots and ``bench.md``.

    ``channels_last`` and ``compile`` apply to the models part (see ``model_bench.bench_model``), ``amp`` to it
    and to the targets, impls and attention parts (the layers' forwards under autocast);
    ``layers`` picks the scaling part's layers among ``layer_bench.LAYER_SUITE`` (default: all). Progress
    goes to ``log``; a missing peer package to ``warn`` (stderr) and ``bench.md``.
    """
    check_amp(amp, device)
    for value, name in ((img_size, "img_size"), (batch_size, "batch_size"), (repeats, "repeats")):
        check_positive_int(value, name)  # also with quick, which replaces them
    check_output_dir(out, "out", "the folder of the results")
    require("matplotlib", "bench", "lambdanet bench (its plots)")
    for what, asked, valid in (
        ("bench layer(s)", layers or (), layer_bench.LAYER_SUITE),
        ("model suite(s)", suites, model_bench.MODEL_SUITES),
        ("bench part(s)", parts, PARTS),
    ):
        unknown = sorted(set(asked) - set(valid))
        if unknown:
            raise ValueError(f"unknown {what} {unknown}; valid: {', '.join(valid)}")
    settings = BenchSettings(
        device=device,
        quick=quick,
        suites=tuple(suites),
        img_size=img_size,
        batch_size=batch_size,
        repeats=repeats,
        amp=amp,
        channels_last=channels_last,
        compile=compile,
        layers=tuple(layers) if layers else None,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = [
        f"# lambdanet bench ({time.strftime('%Y-%m-%d')})",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in environment(device).items()),
        "",
    ]
    needed: dict[str, list[str]] = {}
    for part in parts:
        for peer in PARTS[part].peers(settings):
            needed.setdefault(peer, []).append(part)
    missing = missing_peers_warning(needed)
    if missing:
        warn(f"lambdanet bench: warning: {missing}")
        report += [f"**Warning:** {missing}.", ""]
    results: dict[str, list[dict]] = {}
    for part in [p for p in PARTS if p in parts]:  # in the table's order, whatever the order asked
        rows, lines = PARTS[part].run(settings, out, log)
        results.update(rows)
        report += lines
    for name, table in results.items():
        write_rows(table, out, name)
    (out / "bench.md").write_text("\n".join(report) + "\n")
    log(f"-> {out / 'bench.md'}")
    return results
