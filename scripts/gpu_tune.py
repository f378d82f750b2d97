"""Per-kernel launch settings of the fused causal lambda (issue 36), in one call of the device tool.

    python scripts/gpu_tune.py OUTDIR

Each variant sets every product kernel to one ``(warps, block_v, stages)`` and both scans to another
(``fused_chunk.TUNE``); the kernels are independent, so one profile per variant gives each kernel's time under each
of its settings. Steps: compile every variant in parallel processes (untimed, filling Triton's cache); time each
kernel of one forward + backward under every variant (CUDA time from the profiler, mean of 3) at n 2048 x 32 and
32768 x 2 (``lambda_lm_base``'s layer, bf16); compose the fastest setting of each kernel (summed over both points);
then time the op (forward + backward, CUDA events) and ``lambda_lm_base``'s training step (4k, 16k contexts; 65,536
tokens a step) at the defaults against the composed settings, ``transformer_lm_base`` beside them. Writes
OUTDIR/tune.json and prints the composed ``LAMBDANET_CAUSAL_TUNE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_lm import _bench, _lm_step  # noqa: E402

from lambdanet.bench import causal_tune as CT  # noqa: E402
from lambdanet.models import create_model  # noqa: E402
from lambdanet.ops.causal_lambda import fused_chunk as FC  # noqa: E402

if os.environ.get("GPU_TUNE_VARIANTS"):  # "w,bv,s/w,bv,s;..." : products/scans per variant (a narrower sweep)
    _pairs = [item.split("/") for item in os.environ["GPU_TUNE_VARIANTS"].split(";")]
    CT.PRODUCTS[:] = [tuple(int(x) for x in a.split(",")) for a, _ in _pairs]
    CT.SCANS[:] = [tuple(int(x) for x in b.split(",")) for _, b in _pairs]
WARM_S = float(os.environ.get("GPU_TUNE_WARM_S", "60"))  # the parallel compile's deadline (the rest compiles timed)
DEFAULT = dict(FC.tune())


def warm(ids: list[int]) -> None:
    """Compile variants ``ids`` untimed (one process each, in parallel, before the timed sweep)."""
    for i in ids:
        for n, b in CT.POINTS:
            try:
                CT._with(CT.variants()[i], CT._inputs(n, b, "cuda"))
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(i, n, repr(e)[:200], flush=True)


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[2] == "--warm":
        warm([int(x) for x in sys.argv[3].split(",")])
        return
    t0 = time.perf_counter()
    count = len(CT.variants())
    procs = [subprocess.Popen([sys.executable, __file__, out, "--warm", str(i)]) for i in range(count)]
    for p in procs:  # a variant that compiles too long is left out of the cache (it compiles when timed)
        try:
            p.wait(timeout=max(1.0, WARM_S - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "warm_s": time.perf_counter() - t0}
    print(res, flush=True)
    rows, tried = CT.sweep("cuda", log=lambda line: print(line, flush=True))
    res["sweep"] = [{"products": t["grad_local"], "scans": t["state_scan"], **row} for row, t in zip(rows, tried)]
    _save(out, res)
    best = CT.compose(rows, tried, DEFAULT)
    res["best"] = best
    res["tune_env"] = CT.tune_env(best)
    print("LAMBDANET_CAUSAL_TUNE=" + res["tune_env"], flush=True)
    res["tuned_vs_default_rel"] = CT.agreement(best, "cuda")
    print("tuned vs default (relative):", res["tuned_vs_default_rel"], flush=True)
    ops = []
    for n, b in ((2048, 32), (8192, 8), (32768, 2)):
        for label, tune in (("default", DEFAULT), ("tuned", best)):
            f = CT._inputs(n, b, "cuda")
            ms, per = CT._with(tune, lambda f=f: (_bench(f, warmup=2, reps=10), CT.kernel_times(f)))
            ops.append({"n": n, "b": b, "settings": label, "ms": ms, "tokens_per_s": n * b / ms * 1e3,
                        "kernels_ms": per})  # fmt: skip
            print(ops[-1], flush=True)
    res["op"] = ops
    _save(out, res)
    lm = []
    for name, tune in (("lambda_lm_base", DEFAULT), ("lambda_lm_base", best), ("transformer_lm_base", DEFAULT)):
        torch.manual_seed(0)
        model = create_model(name).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for ctx in (4096, 16384):
            tokens = torch.randint(0, 256, (65536 // ctx, ctx + 1), device="cuda")
            step = _lm_step(model, opt, tokens)
            ms = CT._with(tune, lambda step=step: _bench(step, warmup=2, reps=5))
            lm.append({"model": name, "settings": "tuned" if tune is best else "default", "context": ctx, "ms": ms,
                       "tokens_per_s": 65536 / ms * 1e3})  # fmt: skip
            print(lm[-1], flush=True)
        del model, opt
        torch.cuda.empty_cache()
    res["lm"] = lm
    _save(out, res)


def _save(out: str, res: dict) -> None:
    """``OUTDIR/tune.json`` as far as the run got (written after each phase: a stage cut by its limit keeps it)."""
    with open(os.path.join(out, "tune.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
