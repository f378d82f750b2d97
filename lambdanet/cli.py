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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
