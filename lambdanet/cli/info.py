"""Informational commands: ``lambdanet demo`` (one lambda layer forward and backward) and ``lambdanet models``
(the registry with parameters, FLOPs and paper rows)."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["register"]


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run one lambda layer forward and backward on random data and print what it did."""
    import torch

    from lambdanet import LambdaLayer
    from lambdanet.helpers import check_positive_int

    for value, name in ((args.size, "--size"), (args.batch, "--batch")):
        check_positive_int(value, name)
    if args.batch * args.size**2 == 1:
        raise ValueError("--batch 1 with --size 1 is one position: the layer's BatchNorm needs two values per channel "
                         "in training; use --batch 2 or --size 2")  # fmt: skip
    try:
        layer = LambdaLayer(args.dim, dim_k=args.dim_k, heads=args.heads, r=args.r)
    except ValueError as err:  # the layer names its arguments: say which flags gave them
        given = f"--dim {args.dim} --dim-k {args.dim_k} --heads {args.heads} --r {args.r}"
        raise ValueError(f"{err} (from {given})") from None
    from lambdanet.ops.position_lambda.tuning import auto_choice

    x = torch.randn(args.batch, args.dim, args.size, args.size)
    layer(x).float().pow(2).mean().backward()  # untimed: the first call measures the implementations (impl="auto")
    t0 = time.perf_counter()
    y = layer(x)
    y.float().pow(2).mean().backward()
    dt = time.perf_counter() - t0
    params = sum(p.numel() for p in layer.parameters())
    print(layer)
    print(
        f"input {tuple(x.shape)} -> output {tuple(y.shape)}; {params:,} parameters; "
        f"forward+backward {dt * 1e3:.1f} ms (impl={auto_choice(layer, x, grad=True)}, after one untimed call)"
    )
    return 0


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="run one lambda layer forward and backward on random data",
        description="Build a LambdaLayer, run it forward and backward on a random [batch, dim, "
        "size, size] input, and print the layer, its output shape, parameter count, "
        "time and the position implementation it chose.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--dim", type=int, default=64, help="input and output channels d")
    demo.add_argument("--dim-k", type=int, default=16, help="query/key depth |k|")
    demo.add_argument("--heads", type=int, default=4, help="queries per lambda |h| (must divide --dim)")
    demo.add_argument("--r", type=int, default=23, help="local scope |r| of the lambda convolution (odd)")
    demo.add_argument("--size", type=int, default=16, help="input height and width")
    demo.add_argument("--batch", type=int, default=8, help="batch size")
    demo.set_defaults(func=_cmd_demo)


def _paper_rows(args: argparse.Namespace) -> int:
    """``lambdanet models --paper``: the paper-table rows matching the pattern, ours against the papers'."""
    import fnmatch

    from lambdanet.models.paper_tables import PAPER_ROWS
    from lambdanet.models.summary import markdown_table, paper_comparison

    picked = [
        r
        for r in PAPER_ROWS
        if args.pattern is None or (r.model and fnmatch.fnmatch(r.model, args.pattern)) or r.table == args.pattern
    ]
    if not picked:
        print(
            f"lambdanet models: no paper-table row has a model matching {args.pattern!r} (or is table "
            f"{args.pattern!r}); the tables: {', '.join(repr(t) for t in dict.fromkeys(r.table for r in PAPER_ROWS))}",
            file=sys.stderr,
        )
        return 1
    rows = paper_comparison(picked, flops=not args.no_flops)
    for r in rows:
        r["ours"] = f"{r['params_m']:.2f}" if r.get("params_m") is not None else "-"
        r["delta_s"] = f"{r['delta']:+.1%}" if r.get("delta") is not None else "-"
        r["flops_s"] = f"{r['flops_g']:.2f}" if r.get("flops_g") is not None else "-"
    print(
        markdown_table(
            rows,
            [
                ("table", "table"),
                ("row", "row"),
                ("call", "create_model call"),
                ("paper_params_m", "paper (M)"),
                ("ours", "ours (M)"),
                ("delta_s", "delta"),
                ("paper_flops_g", "paper GFLOPs"),
                ("flops_s", "our GFLOPs"),
            ],
        )
    )
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    """Print every registered model (params, FLOPs, input size) or the paper-table comparison."""
    from lambdanet.models import list_models
    from lambdanet.models.registry import published_models
    from lambdanet.models.summary import markdown_table, model_summary

    if args.paper and args.pretrained:
        raise ValueError("--paper lists the papers' tables, which have no published weights: drop --paper or "
                         "--pretrained")  # fmt: skip
    if args.paper:
        return _paper_rows(args)
    published = published_models()
    # only the models listed are built and counted (all 72 take minutes)
    names = [n for n in list_models(args.pattern) if not args.pretrained or n in published]
    rows = [model_summary(name, flops=not args.no_flops) for name in names]
    if args.pretrained:  # the models with published weights, their hub ids and accuracy
        for r in rows:
            p = published[r["model"]]
            r["hub_id"], r["top1"] = p.hub_id, "-" if p.top1 is None else f"{p.top1:.1f}"
    if not rows:
        print(
            f"no registered model{' with pretrained weights' if args.pretrained else ''} matches {args.pattern!r}",
            file=sys.stderr,
        )
        return 1
    for r in rows:
        r["params_m"] = f"{r['params'] / 1e6:.2f}"
        r["gflops"] = f"{r['flops'] / 1e9:.2f}" if r["flops"] is not None else "-"
    columns = [("model", "model"), ("params_m", "params (M)"), ("gflops", "GFLOPs"), ("input_size", "input size")]
    if args.pretrained:
        columns += [("hub_id", "weights (Hugging Face hub)"), ("top1", "ImageNet top-1")]
    print(markdown_table(rows, columns))
    return 0


def _add_models(sub) -> None:
    models = sub.add_parser(
        "models",
        help="list models with params, FLOPs and input size",
        description="Every registered model with its parameters (1000 classes), FLOPs "
        "(torch.utils.flop_counter, one image at the default input size) and input "
        "size; --paper compares the papers' tables instead.",
    )
    models.add_argument(
        "pattern",
        nargs="?",
        default=None,
        help="shell-style filter on model names, e.g. 'lambda_resnet*' (with --paper: rows whose "
        "model matches, or a table number such as 13)",
    )
    models.add_argument("--paper", action="store_true", help="compare with the papers' parameter/FLOP tables")
    models.add_argument("--no-flops", action="store_true", help="skip FLOP counting (faster)")
    models.add_argument(
        "--pretrained",
        action="store_true",
        help="only the models with published ImageNet weights (create_model(name, pretrained=True)), "
        "with their hub ids and accuracy",
    )
    models.set_defaults(func=_cmd_models)


def register(sub) -> None:
    """Add this module's commands to the subparsers ``sub``."""
    _add_demo(sub)
    _add_models(sub)
