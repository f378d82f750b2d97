"""``lambdanet bench``: the benchmarks of BENCHMARKS.md."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (library: ``lambdanet.bench.runner.run_benchmarks``)."""
    from lambdanet.bench.runner import DEFAULT_PARTS, check_request, run_benchmarks
    from lambdanet.cli.common import check_device
    from lambdanet.files import make_output_dir
    from lambdanet.helpers import check_positive_int

    check_device(args.device)
    for value, name in ((args.img_size, "--img-size"), (args.batch_size, "--batch-size"), (args.repeats, "--repeats")):
        if value is not None:  # None: not given (its default; under --quick, its tiny value)
            check_positive_int(value, name)
    parts = args.parts or DEFAULT_PARTS
    check_request(parts, device=args.device, amp=args.amp, suites=args.suites, layers=args.layers)  # before --out
    make_output_dir(args.out, "--out", "the folder of the results")
    run_benchmarks(
        parts,
        device=args.device,
        out=args.out,
        quick=args.quick,
        suites=args.suites,
        img_size=args.img_size,
        batch_size=args.batch_size,
        repeats=args.repeats,
        amp=args.amp,
        channels_last=args.channels_last,
        compile=args.compile,
        layers=args.layers,
    )
    return 0


def _add_bench(sub) -> None:
    from lambdanet.bench.layer_bench import TARGET_POINTS
    from lambdanet.bench.peers import INSTALL_HINT
    from lambdanet.bench.runner import DEFAULT_PARTS, PARTS

    points = "; ".join(f"B={b} C={c} {n}x{n} {'global' if r is None else f'{r}x{r}'}" for b, c, n, r in TARGET_POINTS)
    bench = sub.add_parser(
        "bench",
        help="speed / memory / FLOPs benchmarks against the baselines and peers",
        description=f"Parts: targets (LambdaLayer, k=16 h=4, forward+backward against timm and lucidrains "
        f"lambda-networks at {points}; with the Triton kernels as their own row on CUDA), impls (every "
        "LambdaLayer position implementation and impl='auto' at batch 64-256, 14x14 and 28x28, scopes 7, 23 "
        "and global, and at the five target points: the fastest, what auto ran and auto/fastest), attention "
        "(HaloNet and global relative attention against "
        "timm's HaloAttn and BottleneckAttn), scaling (Table 4 layers across resolutions: time, memory, "
        "FLOPs, log-log slopes and plots), models (Table 13/14 suites, HaloNet, MobileNet, the 26-layer "
        "hybrid: img/s, memory, params, FLOPs), table4 (Table 4's memory column from the complexity "
        "formulas), detection (backbones at detection sizes), lm (language models: training tokens/s "
        "and memory at contexts 256-8192, generation latency and state at 1k-16k), lm_quality (bits "
        "per byte at equal time and equal steps, 3 seeds, about 35 minutes), lm_recall (associative recall of "
        "the LM families against the number of key-value pairs, nano, under a curriculum, 3 seeds: about two "
        "hours), lm_ablation (the lambda layer's knobs and "
        "options at the transformer's parameter budget, three seeds: hours, resumable in --out), kernels (the "
        "Triton position kernels' roofline on a CUDA device, against its copy and matrix ceilings measured in the "
        "same run), causal_tune (the fused causal lambda kernels' launch settings for a CUDA device: the fastest "
        "of each, timed against the defaults). Writes CSV, JSON, PNG plots, each part's section and bench.md into "
        "--out as each part ends; bench.md holds every part measured into that folder, each with its date, "
        "environment and options. A stop (Ctrl-C, SIGTERM) loses no finished part; impls, lm_quality, lm_recall "
        "and lm_ablation keep each point or run as it ends, and the same command continues from them. --quick "
        "replaces the options not given with tiny values. The peers come with the bench "
        f"extra ({INSTALL_HINT}); without it their rows are left out, with a warning.",
    )
    bench.add_argument(
        "parts",
        nargs="*",
        default=None,
        metavar="part",
        help=f"parts to run, among {', '.join(PARTS)} (default: {' '.join(DEFAULT_PARTS)})",
    )
    bench.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="device to measure on: cpu or cuda (default: %(default)s)",
    )
    bench.add_argument(
        "--out",
        default="bench_results",
        help="folder receiving <part>.csv/.json, the plots and bench.md (default: %(default)s)",
    )
    bench.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test of the harness")
    _add_part_options(bench)
    bench.set_defaults(func=_cmd_bench)


def _add_part_options(bench) -> None:
    """The options that only some parts read."""
    from lambdanet.bench.layer_bench import LAYER_SUITE
    from lambdanet.bench.model_bench import MODEL_SUITES
    from lambdanet.engine.config import add_threads_argument
    from lambdanet.bench.runner import DEFAULT_SUITES
    from lambdanet.runtime import AMP_DTYPES

    bench.add_argument(
        "--suites",
        nargs="+",
        default=None,
        choices=list(MODEL_SUITES),
        metavar="SUITE",
        help=f"models part: suites among {', '.join(MODEL_SUITES)} (default: {' '.join(DEFAULT_SUITES)})",
    )
    bench.add_argument("--img-size", type=int, default=None, help="models part: input resolution (default: 224)")
    bench.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="models part: batch size, halved on out-of-memory (default: 8)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="targets, impls and attention parts: timed rounds per implementation (default: 5)",
    )
    bench.add_argument(
        "--layers",
        nargs="+",
        default=None,
        metavar="LAYER",
        help=f"scaling part: layers to sweep, among {', '.join(LAYER_SUITE)} (default: all)",
    )
    bench.add_argument(
        "--amp",
        default="none",
        choices=list(AMP_DTYPES),
        help=f"models, targets, impls and attention parts: autocast precision, one of {', '.join(AMP_DTYPES)} "
        "(fp16 needs --device cuda; default: %(default)s)",
    )
    bench.add_argument("--channels-last", action="store_true", help="models part: channels_last model and input")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="models part: time torch.compile(model) (compilation is in the untimed warm-up)",
    )
    add_threads_argument(bench)


def register(sub) -> None:
    """Add this module's commands to the subparsers ``sub``."""
    _add_bench(sub)
