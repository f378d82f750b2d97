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

import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lambdanet.bench import causal_tune, detection_bench, kernel_bench, layer_bench, model_bench
from lambdanet.bench.layer_parts import attention, impls, scaling, targets
from lambdanet.bench.lm_parts import lm, lm_ablation_part, lm_quality, lm_recall
from lambdanet.bench.part import DEFAULT_SUITES, BenchSettings, Log, Part, PartResult
from lambdanet.bench.peers import missing_peers_warning
from lambdanet.bench.report import environment, markdown, partial_path, write_rows
from lambdanet.engine.preempt import Preempted
from lambdanet.files import make_output_dir
from lambdanet.helpers import check_positive_int, require
from lambdanet.runtime import check_amp

__all__ = ["BenchSettings", "Part", "PARTS", "DEFAULT_PARTS", "DEFAULT_SUITES", "check_request", "run_benchmarks"]

DEFAULT_PARTS = ("targets", "scaling", "table4")  # what ``lambdanet bench`` runs without part names


def _models(s: BenchSettings, out: Path, log: Log) -> PartResult:
    rows = []
    for suite in s.model_suites:
        log(f"== models: {suite}")
        rows += model_bench.run_model_suite(
            suite,
            img=s.value("img_size", 32),
            batch=s.value("batch_size", 2),
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
                ("relative_to", "rel. to"),
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


PARTS: dict[str, Part] = {
    "targets": Part(targets, lambda s: ("timm", "lambda_networks"), ("repeats", "amp")),
    "impls": Part(impls, lambda s: (), ("repeats", "amp")),
    "attention": Part(attention, lambda s: ("timm",), ("repeats", "amp")),
    "scaling": Part(scaling, lambda s: (), ("layers",)),
    "models": Part(
        _models,
        lambda s: model_bench.suite_peers(s.model_suites),
        ("suites", "img_size", "batch_size", "amp", "channels_last", "compile"),
    ),  # fmt: skip
    "table4": Part(_table4, lambda s: ()),
    "detection": Part(_detection, lambda s: ()),
    "lm": Part(lm, lambda s: ()),
    "lm_quality": Part(lm_quality, lambda s: ()),
    "lm_recall": Part(lm_recall, lambda s: ()),
    "lm_ablation": Part(lm_ablation_part, lambda s: ()),
    "kernels": Part(_kernels, lambda s: ()),
    "causal_tune": Part(causal_tune.bench_part, lambda s: ()),
}
CUDA_PARTS = ("kernels", "causal_tune")  # measure nothing on a CPU
PLOTTING_PARTS = ("scaling", "lm", "lm_quality")  # need matplotlib (the bench extra)
OPTION_DEFAULTS: dict[str, Any] = dict(suites=DEFAULT_SUITES, img_size=224, batch_size=8, repeats=5, amp="none",
                                       channels_last=False, compile=False, layers=None)  # fmt: skip


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class _Terminated(BaseException):
    """SIGTERM during a bench run (``timeout``, a scheduler): stops it as Ctrl-C does."""


@contextmanager
def _sigterm_stops() -> Iterator[None]:
    """While entered, SIGTERM raises :class:`_Terminated` in the main thread (elsewhere: the handler stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _settings(parts: Sequence[str], device: str, quick: bool, options: dict, warn: Log) -> BenchSettings:
    """The run's :class:`BenchSettings` from the options (``None``: not given, its default); a warning for a given
    option that no part of ``parts`` reads, and for a CUDA-only part on the CPU."""
    given = frozenset(k for k, v in options.items() if v is not None and v != OPTION_DEFAULTS[k])
    given |= {k for k in ("suites", "img_size", "batch_size", "repeats") if options[k] is not None}
    for name in sorted(given):
        if not any(name in PARTS[p].reads for p in parts):
            readers = ", ".join(p for p in PARTS if name in PARTS[p].reads)
            warn(f"lambdanet bench: warning: --{name.replace('_', '-')} is read by {readers}, none of which runs; "
                 "ignored")  # fmt: skip
    for part in (p for p in CUDA_PARTS if p in parts and device != "cuda"):
        warn(f"lambdanet bench: warning: {part} measures a CUDA device (--device cuda); skipped on the CPU")
    values: dict[str, Any] = {k: OPTION_DEFAULTS[k] if v is None else v for k, v in options.items()}
    values.update(  # each suite and layer once, in the order given
        suites=tuple(dict.fromkeys(values["suites"])), layers=tuple(dict.fromkeys(values["layers"] or ())) or None
    )
    return BenchSettings(device=device, quick=quick, given=given, **values)


def _stamp(part: str, s: BenchSettings, env: str) -> str:
    """The line under a part's title in ``bench.md``: when, where and with which options it was measured."""
    options = [f"{name} {getattr(s, name)}" for name in PARTS[part].reads if name in s.given or not s.quick]
    return f"_Measured {time.strftime('%Y-%m-%d %H:%M')}; {env}" + "; --quick" * s.quick + (
        f"; {', '.join(options)}" if options else "") + "._"  # fmt: skip


def _write_report(out: Path) -> None:
    """``bench.md``: the sections of every part measured into ``out`` (``sections/<part>.md``), in the table's
    order: parts run by earlier commands into the same folder stay in it, each with its own stamp."""
    sections = [out / "sections" / f"{p}.md" for p in PARTS]
    report = [f"# lambdanet bench ({out.resolve().name or out.resolve()})", "",  # --out . : the folder's name
              "Each part's section says when, where and with which options it was measured.", ""]  # fmt: skip
    report += [path.read_text() for path in sections if path.is_file()]
    (out / "bench.md").write_text("\n".join(report))


def _run_part(part: str, s: BenchSettings, out: Path, env: str, log: Log) -> dict[str, list[dict]]:
    """Run ``part``; write its rows, its section and ``bench.md`` at once (a later part's stop loses nothing)."""
    rows, lines = PARTS[part].run(s, out, log)
    for name, table in rows.items():
        write_rows(table, out, name)
    partial_path(out, part).unlink(missing_ok=True)  # its rows kept as they were measured: now written whole
    missing = missing_peers_warning({peer: [part] for peer in PARTS[part].peers(s)})
    section = [lines[0], "", _stamp(part, s, env), *([f"**Warning:** {missing}.", ""] if missing else []), *lines[1:]]
    if (out / "bench.md").is_file() and not (out / "sections").is_dir():  # an earlier version's report: kept
        (out / "bench.md").replace(out / "bench_earlier.md")
    (out / "sections").mkdir(exist_ok=True)
    (out / "sections" / f"{part}.md").write_text("\n".join(section) + "\n")
    _write_report(out)
    return rows


def _stopped(sig: signal.Signals, part: str, done: list[str], out: Path) -> Preempted:
    """The one line of a run stopped by ``sig`` in ``part``: what was written and what a rerun continues from."""
    written = f"{', '.join(done)} written to {out}" if done else f"no part finished in {out}"
    kept = partial_path(out, part)
    if part == "lm_ablation":
        written += "; the finished runs of lm_ablation are kept in lm_ablation.jsonl: the same command continues"
    elif kept.is_file():
        written += f"; the rows of {part} measured so far are kept in {kept.name}: the same command continues"
    return Preempted(f"stopped by {sig.name} in part {part}: {written}")


def check_request(
    parts: Sequence[str],
    *,
    device: str = "cpu",
    amp: str = "none",
    img_size: int | None = None,
    batch_size: int | None = None,
    repeats: int | None = None,
    suites: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
) -> None:
    """What :func:`run_benchmarks` checks before it writes anything (its arguments, the same names): the precision
    on the device, the sizes, the names of the parts, suites and layers (a one-line ``ValueError``), and the
    plotting package the parts need. ``lambdanet bench`` calls it before it makes ``--out``."""
    check_amp(amp, device)
    for value, name in ((img_size, "img_size"), (batch_size, "batch_size"), (repeats, "repeats")):
        if value is not None:
            check_positive_int(value, name)
    if any(p in PLOTTING_PARTS for p in parts):
        require("matplotlib", "bench", "lambdanet bench (the plots of " + ", ".join(PLOTTING_PARTS) + ")")
    for what, asked, valid in (
        ("--layers: unknown bench layer(s)", layers or (), layer_bench.LAYER_SUITE),
        ("--suites: unknown model suite(s)", suites or (), model_bench.MODEL_SUITES),
        ("unknown bench part(s)", parts, PARTS),
    ):
        unknown = sorted(set(asked) - set(valid))
        if unknown:
            hint = ""
            if what.startswith("--") and (named := [u for u in unknown if u in PARTS]):  # nargs="+" took the part
                hint = f" ({', '.join(named)}: a part; put the parts before --layers / --suites)"
            raise ValueError(f"{what} {unknown}; valid: {', '.join(valid)}{hint}")


def run_benchmarks(
    parts: Sequence[str] = tuple(PARTS),
    *,
    device: str = "cpu",
    out: str | Path = "bench_results",
    quick: bool = False,
    suites: Sequence[str] | None = None,
    img_size: int | None = None,
    batch_size: int | None = None,
    repeats: int | None = None,
    amp: str = "none",
    channels_last: bool = False,
    compile: bool = False,
    layers: Sequence[str] | None = None,
    log: Log = print,
    warn: Log = _stderr,
) -> dict:
    """Run ``parts``; returns ``{name: rows}`` and writes ``<out>/<name>.{json,csv}``, plots, the part's section
    ``<out>/sections/<part>.md`` and ``bench.md`` as each part ends (a stop loses no finished part; the long LM
    parts keep their rows as they are measured, and the same call continues from them).

    ``suites``, ``img_size`` and ``batch_size`` apply to the models part, with ``channels_last`` and ``compile``
    (see ``model_bench.bench_model``), ``amp`` to it and to the targets, impls and attention parts (the layers'
    forwards under autocast), ``repeats`` to those three; ``layers`` picks the scaling part's layers among
    ``layer_bench.LAYER_SUITE`` (default: all). ``None``: the default (``OPTION_DEFAULTS``), or under ``quick``
    its tiny value; a value given is kept under ``quick`` too. Progress goes to ``log``; a missing peer package,
    or an option no part of ``parts`` reads, to ``warn`` (stderr), and the former into ``bench.md``. SIGINT or
    SIGTERM stops the run with :class:`~lambdanet.engine.preempt.Preempted` naming what was written.
    """
    check_request(parts, device=device, amp=amp, img_size=img_size, batch_size=batch_size, repeats=repeats,
                  suites=suites, layers=layers)  # fmt: skip
    out = make_output_dir(out, "out", "the folder of the results")
    options = dict(suites=suites, img_size=img_size, batch_size=batch_size, repeats=repeats, amp=amp,
                   channels_last=channels_last, compile=compile, layers=layers)  # fmt: skip
    settings = _settings(parts, device, quick, options, warn)
    needed: dict[str, list[str]] = {}
    for part in parts:
        for peer in PARTS[part].peers(settings):
            needed.setdefault(peer, []).append(part)
    missing = missing_peers_warning(needed)
    if missing:
        warn(f"lambdanet bench: warning: {missing}")
    env = ", ".join(f"{k} {v}" for k, v in environment(device).items())
    results: dict[str, list[dict]] = {}
    done: list[str] = []
    part = ""
    try:
        with _sigterm_stops():
            # (warned) a CUDA part that cannot measure here (the CPU, or no Triton) writes its "Skipped" section,
            # but never over one measured on a GPU
            here = layer_bench.triton_runs(device)
            skipped = [p for p in CUDA_PARTS if not here and (out / "sections" / f"{p}.md").is_file()]
            for part in [p for p in PARTS if p in parts and p not in skipped]:  # the table's order
                results.update(_run_part(part, settings, out, env, log))
                done.append(part)
    except KeyboardInterrupt:
        raise _stopped(signal.SIGINT, part, done, out) from None
    except _Terminated:
        raise _stopped(signal.SIGTERM, part, done, out) from None
    log(f"-> {out / 'bench.md'}")
    return results
