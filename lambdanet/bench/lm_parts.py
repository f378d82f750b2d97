"""The language-model parts of ``lambdanet bench`` (:mod:`lambdanet.bench.runner`): ``lm`` (training throughput
and memory against context, generation latency and state, :mod:`lambdanet.bench.lm_bench`), ``lm_quality`` (bits
per byte at equal time and equal steps), ``lm_recall`` (associative recall, :mod:`lambdanet.bench.recall_bench`)
and ``lm_ablation`` (:mod:`lambdanet.bench.lm_ablation`). The long ones keep each row as it is measured
(``<out>/<part>.partial.jsonl``, :class:`lambdanet.bench.report.RowLog`; ``lm_ablation`` its own
``lm_ablation.jsonl``): a stop loses none, and the same command again continues from them."""

from __future__ import annotations

from pathlib import Path

from lambdanet.bench import lm_ablation, lm_bench, recall_bench
from lambdanet.bench.part import BenchSettings, Log, PartResult
from lambdanet.bench.report import RowLog, markdown

__all__ = ["lm", "lm_quality", "lm_recall", "lm_ablation_part"]


def _kept(s: BenchSettings, out: Path, name: str, settings: dict) -> RowLog:
    """The rows of ``name`` kept in ``out`` by an earlier run of the same settings (none otherwise)."""
    return RowLog(out, name, {**settings, "device": s.device, "quick": s.quick})


def lm(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== lm: training throughput and memory against context, generation latency and state")
    size, contexts, gen_contexts = (
        ("nano", (64, 128), (64, 256))
        if s.quick
        else ("tiny", (256, 512, 1024, 2048, 4096, 8192), (1024, 2048, 4096, 8192, 16384))
    )
    tokens = 256 if s.quick else 4096
    train = lm_bench.throughput(
        size, contexts, tokens_per_step=tokens, device=s.device, repeats=1 if s.quick else 3, log=log
    )
    gen = lm_bench.generation(size, gen_contexts, device=s.device, steps=3 if s.quick else 20, log=log)
    slopes = lm_bench.memory_slopes(train, lo=contexts[0] if s.quick else 1024, hi=contexts[-1])
    plots = lm_bench.plot_lm_study(train, gen, [], out)
    return {"lm_train": train, "lm_memory_slopes": slopes, "lm_generation": gen}, [
        f"## Language models: {size} (lambda, the plain lambda layer of before 0.2.0, transformer, linear attention)",
        "",
        f"Training (forward+backward), `max(1, {tokens} // context)` sequences per step; peak memory of one sequence.",
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


QUALITY_QUICK = dict(size="nano", context=64, batch=2, steps=3, seconds=0.5, seeds=(0, 1), eval_bytes=2048)


def lm_quality(s: BenchSettings, out: Path, log: Log) -> PartResult:
    from lambdanet.tasks.lm.data import load_corpus

    log("== lm_quality: validation bits per byte at equal time and equal steps")
    kw: dict = dict(QUALITY_QUICK) if s.quick else dict(size="tiny")
    kept = _kept(s, out, "lm_quality", kw)
    rows = lm_bench.quality(load_corpus("stdlib"), device=s.device, log=log, kept=kept, **kw)
    diverged = lm_bench.non_finite(rows)
    for line in diverged:
        log(f"  warning: diverged or not measured: {line}")
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
    ] + ([f"Diverged (NaN in the means): {'; '.join(diverged)}.", ""] if diverged else []) + [
        f"![{p.stem}]({p.name})" for p in plots
    ] + [""]


RECALL_QUICK = dict(pairs=(2,), steps=2, batch=4, eval_batches=1, seeds=(0,), lrs=(1e-3,))


def lm_recall(s: BenchSettings, out: Path, log: Log) -> PartResult:
    kw: dict = dict(RECALL_QUICK) if s.quick else {}
    lrs, seeds = kw.get("lrs", (1e-3, 3e-3)), kw.get("seeds", (0, 1, 2))
    log(f"== lm_recall: associative recall against the number of key-value pairs ({len(lrs)} learning rate(s) x "
        f"{len(seeds)} seed(s))")  # fmt: skip
    kept = _kept(s, out, "lm_recall", kw)
    rows = recall_bench.recall(device=s.device, log=log, kept=kept, **kw)
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


def lm_ablation_part(s: BenchSettings, out: Path, log: Log) -> PartResult:
    log("== lm_ablation: the lambda layer's knobs and options at one parameter budget (resumable in --out)")
    if s.quick:
        kw: dict = dict(configs=("transformer", "lambda"), size="nano", seeds=(0,), steps=2, context=32, batch=2,
                        eval_bytes=256)  # fmt: skip
    else:
        kw = {}
    rows = lm_ablation.study(out=out, device=s.device, log=log, **kw)
    missing = lm_ablation.missing_runs(rows, kw.get("configs", tuple(lm_ablation.ABLATIONS)),
                                       kw.get("seeds", lm_ablation.DEFAULT_SEEDS))  # fmt: skip
    incomplete = [f"**Incomplete:** not run (held by another process's claim in {out / 'claims'}): "
                  f"{', '.join(missing)}.", ""] if missing else []  # fmt: skip
    if not rows:
        return {}, ["## Language models: ablations", "", *incomplete]
    return {"lm_ablation_summary": lm_ablation.summarize(rows)}, [
        f"## Language models: ablations ({rows[0]['size']}, {rows[0]['steps']} steps, context {rows[0]['context']})",
        "",
        lm_ablation.summary_table(rows),
        "",
        *incomplete,
    ]
