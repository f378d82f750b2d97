"""Command-line interface: a thin layer over library functions.

``lambdanet <command> --help`` documents each command.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main", "build_parser"]


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
        rows = paper_comparison(flops=not args.no_flops)
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
    from lambdanet.train.config import config_from_args
    from lambdanet.train.sweep import lr_sweep, sweep_markdown

    cfg = config_from_args(args)
    rows = lr_sweep(cfg, args.lrs, args.models)
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
    from lambdanet.bench.runner import run_benchmarks

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available")
    run_benchmarks(args.parts or ["targets", "scaling", "table4"], device=args.device, out=args.out, quick=args.quick,
                   suites=args.suites, img_size=args.img_size, batch_size=args.batch_size, repeats=args.repeats,
                   amp=args.amp, channels_last=args.channels_last, compile=args.compile, layers=args.layers)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lambdanet import __version__

    parser = argparse.ArgumentParser(prog="lambdanet", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lambdanet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")

    demo = sub.add_parser("demo", help="run one lambda layer on random data")
    demo.add_argument("--dim", type=int, default=64)
    demo.add_argument("--dim-k", type=int, default=16)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--r", type=int, default=23)
    demo.add_argument("--size", type=int, default=16)
    demo.add_argument("--batch", type=int, default=8)
    demo.set_defaults(func=_cmd_demo)

    models = sub.add_parser("models", help="list models with params, FLOPs and input size",
                            description="Every registered model with its parameters (1000 classes), FLOPs "
                                        "(torch.utils.flop_counter, one image at the default input size) and input "
                                        "size; --paper compares the papers' tables instead.")
    models.add_argument("pattern", nargs="?", default=None, help="shell-style filter, e.g. 'lambda_resnet*'")
    models.add_argument("--paper", action="store_true", help="compare with the papers' parameter/FLOP tables")
    models.add_argument("--no-flops", action="store_true", help="skip FLOP counting (faster)")
    models.set_defaults(func=_cmd_models)

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

    ev = sub.add_parser("eval", help="evaluate a checkpoint", description="Top-1/top-5 of a checkpoint.")
    ev.add_argument("--checkpoint", required=True, help="a last.pt written by lambdanet train")
    ev.add_argument("--data", default=None, help="dataset (default: the checkpoint's)")
    ev.add_argument("--data-dir", default=None)
    ev.add_argument("--split", default="test", choices=["test", "train"])
    ev.add_argument("--batch-size", type=int, default=256)
    ev.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ev.add_argument("--no-ema", action="store_true", help="use the raw weights even if an EMA exists")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(func=_cmd_eval)

    sw = sub.add_parser("sweep", help="learning-rate sensitivity study",
                        description="Train the same recipe at several learning rates (and models); writes "
                                    "sweep.md, sweep.json and sweep.png (accuracy vs learning rate) into --out.")
    sw.add_argument("--lrs", type=float, nargs="+", required=True, help="learning rates")
    sw.add_argument("--models", nargs="+", default=None, help="models (default: --model)")
    sw.add_argument("--config", help="YAML file of options")
    add_config_arguments(sw)
    sw.set_defaults(func=_cmd_sweep)

    ps = sub.add_parser("pseudo-label", help="label a teacher's unlabelled images",
                        description="Label the unlabelled part (1 - labeled_fraction) of a teacher run's training "
                                    "set; train a student with --labeled-fraction F --pseudo-labels FILE.")
    ps.add_argument("--checkpoint", required=True, help="the teacher's last.pt")
    ps.add_argument("--out", required=True, help="output file (.pt)")
    ps.add_argument("--threshold", type=float, default=0.0, help="keep labels with at least this confidence")
    ps.set_defaults(func=_cmd_pseudo)

    from lambdanet.bench.models import MODEL_SUITES
    from lambdanet.bench.layers import LAYER_SUITE
    from lambdanet.bench.runner import PARTS

    bench = sub.add_parser("bench", help="speed / memory / FLOPs benchmarks against the baselines and peers",
                           description="Parts: targets (LambdaLayer vs timm / lucidrains at the issue's points), "
                                       "attention (halo / global relative attention vs timm), "
                                       "scaling (Table 4 layers across resolutions, log-log plots), models "
                                       "(Table 13/14 suites, HaloNet, MobileNet, 26-layer hybrid), table4 (memory "
                                       "column). Writes CSV, JSON, PNG plots and bench.md into --out.")
    bench.add_argument("parts", nargs="*", default=None,
                       help=f"parts to run, among {', '.join(PARTS)} (default: targets scaling table4)")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    bench.add_argument("--out", default="bench_results")
    bench.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    bench.add_argument("--suites", nargs="+", default=["table13", "hybrid26", "mobilenet", "halonet"],
                       choices=list(MODEL_SUITES), help="model suites for the models part")
    bench.add_argument("--img-size", type=int, default=224)
    bench.add_argument("--batch-size", type=int, default=8)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--layers", nargs="+", default=None, metavar="LAYER",
                       help=f"scaling part: layers to sweep (default: all of {', '.join(LAYER_SUITE)})")
    bench.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"],
                       help="models part: autocast precision (fp16 needs --device cuda)")
    bench.add_argument("--channels-last", action="store_true", help="models part: channels_last model and input")
    bench.add_argument("--compile", action="store_true", help="models part: time torch.compile(model)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
