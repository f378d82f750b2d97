"""Host time of one ``fused_chunk`` forward + backward of the causal lambda op, the kernels' launches stubbed out:
the Python, dispatch and autograd work a GPU waits on between short kernels (and before the first one of a call),
for the custom-op path (what compilers and tracers get) and the eager path side by side, interleaved, in one run.

    python scripts/causal_host_time.py [--reps 300] [--rounds 3]

Runs on the CPU (CPU tensors, ``TRITON_INTERPRET=1`` so that the op takes its kernel path; no kernel runs) at a
tiny size, so that allocations and the gradients' accumulation cost next to nothing. The figure is this machine's
host time, not a GPU's: a faster host divides both paths alike.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from lambdanet.ops import causal_lambda  # noqa: E402

FC = importlib.import_module("lambdanet.ops.causal_lambda.fused_chunk")
TC = importlib.import_module("lambdanet.ops.causal_lambda.triton_chunk")


class _NoLaunch:
    """A kernel whose launch does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name in FC.KERNELS:
        setattr(TC, "_" + name, _NoLaunch())
    b, n, h, k, v, r = 1, 64, 8, 16, 208, 64  # lambda_lm_base's layer, one chunk of 64 positions
    dt = torch.bfloat16
    q = torch.randn(b, n, h, k, dtype=dt, requires_grad=True)
    keys = torch.randn(b, n, k, 1, dtype=dt, requires_grad=True)
    values = torch.randn(b, n, v, 1, dtype=dt, requires_grad=True)
    emb = (torch.randn(r, k, 1) / 32).requires_grad_()
    dy = torch.randn(b, n, h, v, dtype=dt)

    def step() -> None:
        causal_lambda(q, keys, values, emb, mode="fused_chunk").backward(dy)

    eager = getattr(FC, "_eager", None)  # absent from versions before the eager path (measure them alike)
    paths = {"custom op": lambda *tensors: False, "eager": eager} if eager else {"custom op": None}
    for i in range(args.rounds):
        for label, choose in paths.items():
            if choose is not None:
                FC._eager = choose
            for _ in range(20):
                step()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            median = sorted(times)[len(times) // 2] * 1e6
            print(f"round {i + 1}: {label:9s} forward + backward host time, median {median:6.1f} us")
    if eager is not None:
        FC._eager = eager


if __name__ == "__main__":
    main()
