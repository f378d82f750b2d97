"""Command-line interface: a thin layer over library functions.

``lambdanet <command> --help`` documents each command.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main", "build_parser"]

DESCRIPTION = ("lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch: lambda layers, LambdaResNets and the "
               "convolution / attention baselines they are measured against (SE, linear, relative, local, axial "
               "and halo attention), with the papers' models, training recipes and benchmarks.")


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run one lambda layer forward and backward on random data and print what it did."""
    import torch

    from lambdanet import LambdaLayer

    layer = LambdaLayer(args.dim, dim_k=args.dim_k, heads=args.heads, r=args.r)
    x = torch.randn(args.batch, args.dim, args.size, args.size)
    t0 = time.perf_counter()
    y = layer(x)
    y.float().pow(2).mean().backward()
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in layer.parameters())
    print(layer)
    print(f"input {tuple(x.shape)} -> output {tuple(y.shape)}; {params:,} parameters; "
          f"forward+backward {dt * 1e3:.1f} ms (impl={layer.choose_impl((args.size, args.size))})")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    """Print every registered model (params, FLOPs, input size) or the paper-table comparison."""
    from lambdanet.models.summary import markdown_table, paper_comparison, summarize_models

    if args.paper:
        import fnmatch

        from lambdanet.models.paper_tables import PAPER_ROWS

        picked = [r for r in PAPER_ROWS if args.pattern is None or (r.model and fnmatch.fnmatch(r.model, args.pattern))
                  or r.table == args.pattern]
        if not picked:
            print(f"no paper-table row has a model matching {args.pattern!r} (or is table {args.pattern!r})",
                  file=sys.stderr)
            return 1
        rows = paper_comparison(picked, flops=not args.no_flops)
        for r in rows:
            r["ours"] = f"{r['params_m']:.2f}" if r.get("params_m") is not None else "-"
            r["delta_s"] = f"{r['delta']:+.1%}" if r.get("delta") is not None else "-"
            r["flops_s"] = f"{r['flops_g']:.2f}" if r.get("flops_g") is not None else "-"
        print(markdown_table(rows, [("table", "table"), ("row", "row"), ("call", "create_model call"),
                                    ("paper_params_m", "paper (M)"), ("ours", "ours (M)"), ("delta_s", "delta"),
                                    ("paper_flops_g", "paper GFLOPs"), ("flops_s", "our GFLOPs")]))
        return 0
    rows = summarize_models(args.pattern, flops=not args.no_flops)
    if not rows:
        print(f"no registered model matches {args.pattern!r}", file=sys.stderr)
        return 1
    for r in rows:
        r["params_m"] = f"{r['params'] / 1e6:.2f}"
        r["gflops"] = f"{r['flops'] / 1e9:.2f}" if r["flops"] is not None else "-"
    print(markdown_table(rows, [("model", "model"), ("params_m", "params (M)"), ("gflops", "GFLOPs"),
                                ("input_size", "input size")]))
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from lambdanet.train.trainer import TrainingDivergedError

    return (ValueError, TrainingDivergedError, FileNotFoundError)


def _cmd_train(args: argparse.Namespace) -> int:
    """Train and evaluate a model (library: ``lambdanet.train.train``)."""
    from lambdanet.train.config import config_from_args
    from lambdanet.train.trainer import train

    cfg = config_from_args(args)
    train(cfg)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Top-1 / top-5 of a checkpoint on a dataset (library: ``lambdanet.train.evaluate_checkpoint``)."""
    import json

    from lambdanet.train.trainer import evaluate_checkpoint

    res = evaluate_checkpoint(args.checkpoint, data=args.data, split=args.split, ema=not args.no_ema,
                              batch_size=args.batch_size, device=args.device, data_dir=args.data_dir)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{res['model']} ({res['weights']} weights, epoch {res['epoch']}) on {res['data']} {res['split']}: "
              f"top-1 {res['top1']:.4f}, top-5 {res['top5']:.4f}, loss {res['loss']:.4f} ({res['samples']} images)")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    """Learning-rate sensitivity study (library: ``lambdanet.train.sweep.lr_sweep``)."""
    from lambdanet.train.config import config_source_from_args
    from lambdanet.train.sweep import lr_sweep, sweep_markdown

    rows = lr_sweep(config_source_from_args(args), args.lrs, args.models)
    print(sweep_markdown(rows))
    return 0


def _cmd_pseudo(args: argparse.Namespace) -> int:
    """Pseudo-label a teacher's unlabelled images (library: ``lambdanet.train.pseudo.make_pseudo_labels``)."""
    from lambdanet.train.pseudo import make_pseudo_labels

    res = make_pseudo_labels(args.checkpoint, args.out, threshold=args.threshold)
    print(f"{len(res['labels'])} pseudo-labels for {res['data']} (labeled_fraction {res['labeled_fraction']}, "
          f"seed {res['seed']}), {res['agreement_with_true_labels']:.4f} agree with the hidden labels -> {args.out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (library: ``lambdanet.bench.runner.run_benchmarks``)."""
    from lambdanet.bench.runner import DEFAULT_PARTS, run_benchmarks

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available")
    run_benchmarks(args.parts or DEFAULT_PARTS, device=args.device, out=args.out, quick=args.quick,
                   suites=args.suites, img_size=args.img_size, batch_size=args.batch_size, repeats=args.repeats,
                   amp=args.amp, channels_last=args.channels_last, compile=args.compile, layers=args.layers)
    return 0


def _add_demo(sub) -> None:
    """``lambdanet demo``"""
    demo = sub.add_parser("demo", help="run one lambda layer forward and backward on random data",
                          description="Build a LambdaLayer, run it forward and backward on a random [batch, dim, "
                                      "size, size] input, and print the layer, its output shape, parameter count, "
                                      "time and the position implementation it chose.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--dim", type=int, default=64, help="input and output channels d")
    demo.add_argument("--dim-k", type=int, default=16, help="query/key depth |k|")
    demo.add_argument("--heads", type=int, default=4, help="queries per lambda |h| (must divide --dim)")
    demo.add_argument("--r", type=int, default=23, help="local scope |r| of the lambda convolution (odd)")
    demo.add_argument("--size", type=int, default=16, help="input height and width")
    demo.add_argument("--batch", type=int, default=8, help="batch size")
    demo.set_defaults(func=_cmd_demo)


def _add_models(sub) -> None:
    """``lambdanet models``"""
    models = sub.add_parser("models", help="list models with params, FLOPs and input size",
                            description="Every registered model with its parameters (1000 classes), FLOPs "
                                        "(torch.utils.flop_counter, one image at the default input size) and input "
                                        "size; --paper compares the papers' tables instead.")
    models.add_argument("pattern", nargs="?", default=None,
                        help="shell-style filter on model names, e.g. 'lambda_resnet*' (with --paper: rows whose "
                             "model matches, or a table number such as 13)")
    models.add_argument("--paper", action="store_true", help="compare with the papers' parameter/FLOP tables")
    models.add_argument("--no-flops", action="store_true", help="skip FLOP counting (faster)")
    models.set_defaults(func=_cmd_models)


def _add_train(sub) -> None:
    """``lambdanet train``"""
    from lambdanet.data import list_datasets
    from lambdanet.train.config import RECIPES, add_config_arguments

    recipes = ", ".join(RECIPES)
    train = sub.add_parser(
        "train", help="train and evaluate a model",
        description=f"Train and evaluate. Recipes: {recipes}. Data: {', '.join(list_datasets())}. Every option is "
                    "also a YAML key (--config FILE); precedence: defaults < --recipe < --config < flags. "
                    "--resume continues the run in --out where it stopped. Under torchrun the same command trains "
                    "with DistributedDataParallel.")
    train.add_argument("--config", help="YAML file of options")
    add_config_arguments(train)
    train.set_defaults(func=_cmd_train)


def _add_eval(sub) -> None:
    """``lambdanet eval``"""
    ev = sub.add_parser("eval", help="evaluate a checkpoint",
                        description="Top-1/top-5 accuracy and loss of a training checkpoint (its EMA weights when it "
                                    "has them) on its dataset or another one.")
    ev.add_argument("--checkpoint", required=True, help="a last.pt written by lambdanet train")
    ev.add_argument("--data", default=None, help="dataset (default: the checkpoint's)")
    ev.add_argument("--data-dir", default=None, help="dataset folder (default: the checkpoint's)")
    ev.add_argument("--split", default="test", choices=["test", "train"], help="split to evaluate (default: test)")
    ev.add_argument("--batch-size", type=int, default=256, help="evaluation batch size (default: 256)")
    ev.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="device (default: auto = CUDA when available)")
    ev.add_argument("--no-ema", action="store_true", help="use the raw weights even if an EMA exists")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(func=_cmd_eval)


def _add_sweep(sub) -> None:
    """``lambdanet sweep``"""
    sw = sub.add_parser("sweep", help="learning-rate sensitivity study",
                        description="Train the same recipe at several learning rates (and models) into "
                                    "--out/<model>/lr_<lr>; writes sweep.md, sweep.json and sweep.png (accuracy vs "
                                    "learning rate) into --out. Rerunning reuses finished runs of the same resolved "
                                    "configuration and resumes unfinished ones; a run folder holding another "
                                    "configuration is refused. Every train option applies.")
    sw.add_argument("--lrs", type=float, nargs="+", required=True, help="learning rates")
    sw.add_argument("--models", nargs="+", default=None, help="models (default: --model)")
    sw.add_argument("--config", help="YAML file of options")
    from lambdanet.train.config import add_config_arguments

    add_config_arguments(sw)
    sw.set_defaults(func=_cmd_sweep)


def _add_pseudo_label(sub) -> None:
    """``lambdanet pseudo-label``"""
    ps = sub.add_parser("pseudo-label", help="label a teacher's unlabelled images",
                        description="Label the unlabelled part (1 - labeled_fraction) of a teacher run's training "
                                    "set; train a student with --labeled-fraction F --pseudo-labels FILE.")
    ps.add_argument("--checkpoint", required=True, help="the teacher's last.pt (trained with --labeled-fraction < 1)")
    ps.add_argument("--out", required=True, help="output file (.pt)")
    ps.add_argument("--threshold", type=float, default=0.0, help="keep labels with at least this confidence")
    ps.set_defaults(func=_cmd_pseudo)


def _add_bench(sub) -> None:
    """``lambdanet bench``"""
    from lambdanet.bench.layer_bench import LAYER_SUITE, TARGET_POINTS
    from lambdanet.bench.model_bench import MODEL_SUITES
    from lambdanet.bench.peers import INSTALL_HINT
    from lambdanet.bench.runner import DEFAULT_PARTS, DEFAULT_SUITES, PARTS
    from lambdanet.runtime import AMP_DTYPES

    points = "; ".join(f"B={b} C={c} {n}x{n} {'global' if r is None else f'{r}x{r}'}"
                       for b, c, n, r in TARGET_POINTS)
    bench = sub.add_parser(
        "bench", help="speed / memory / FLOPs benchmarks against the baselines and peers",
        description=f"Parts: targets (LambdaLayer, k=16 h=4, forward+backward against timm and lucidrains "
                    f"lambda-networks at {points}), attention (HaloNet and global relative attention against "
                    "timm's HaloAttn and BottleneckAttn), scaling (Table 4 layers across resolutions: time, memory, "
                    "FLOPs, log-log slopes and plots), models (Table 13/14 suites, HaloNet, MobileNet, the 26-layer "
                    "hybrid: img/s, memory, params, FLOPs), table4 (Table 4's memory column from the complexity "
                    "formulas). Writes CSV, JSON, PNG plots and bench.md into --out. The peers come with the bench "
                    f"extra ({INSTALL_HINT}); without it their rows are left out, with a warning.")
    bench.add_argument("parts", nargs="*", default=None, metavar="part",
                       help=f"parts to run, among {', '.join(PARTS)} (default: {' '.join(DEFAULT_PARTS)})")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="device to measure on: cpu or cuda (default: %(default)s)")
    bench.add_argument("--out", default="bench_results",
                       help="folder receiving <part>.csv/.json, the plots and bench.md (default: %(default)s)")
    bench.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test of the harness")
    bench.add_argument("--suites", nargs="+", default=list(DEFAULT_SUITES), choices=list(MODEL_SUITES),
                       metavar="SUITE", help=f"models part: suites among {', '.join(MODEL_SUITES)} "
                                             f"(default: {' '.join(DEFAULT_SUITES)})")
    bench.add_argument("--img-size", type=int, default=224,
                       help="models part: input resolution (default: %(default)s)")
    bench.add_argument("--batch-size", type=int, default=8,
                       help="models part: batch size, halved on out-of-memory (default: %(default)s)")
    bench.add_argument("--repeats", type=int, default=5,
                       help="targets and attention parts: timed rounds per implementation (default: %(default)s)")
    bench.add_argument("--layers", nargs="+", default=None, metavar="LAYER",
                       help=f"scaling part: layers to sweep, among {', '.join(LAYER_SUITE)} (default: all)")
    bench.add_argument("--amp", default="none", choices=list(AMP_DTYPES),
                       help=f"models part: autocast precision, one of {', '.join(AMP_DTYPES)} (fp16 needs --device "
                            "cuda; default: %(default)s)")
    bench.add_argument("--channels-last", action="store_true", help="models part: channels_last model and input")
    bench.add_argument("--compile", action="store_true",
                       help="models part: time torch.compile(model) (compilation is in the untimed warm-up)")
    bench.set_defaults(func=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    from lambdanet import __version__

    parser = argparse.ArgumentParser(prog="lambdanet", description=DESCRIPTION,
                                     epilog="Run 'lambdanet COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"lambdanet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    parser.commands = sub.choices  # name -> subparser, for errors in a command's own usage

    for add in (_add_demo, _add_models, _add_train, _add_eval, _add_sweep, _add_pseudo_label, _add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # a mistyped option: the subcommand's usage, not the top-level one
        where = parser.commands.get(getattr(args, "command", None), parser)
        where.error(f"unrecognized arguments: {' '.join(extra)} (see 'lambdanet {args.command or ''} --help')")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except _user_errors() as err:
        print(f"lambdanet {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
