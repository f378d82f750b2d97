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
