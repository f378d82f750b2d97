"""The GPU study of the causal lambda op and the language models (issue 36), in one call of the device tool.

    python scripts/gpu_lm.py OUTDIR [--parts warm,opprof,check,op,lm,gen,profile] [--quick]

Parts (each writes OUTDIR/<part>.json and prints a table):
* warm: compile every kernel of the other parts at their shapes, untimed (run it in a process of its own beside
  the untimed check, before the timed parts).
* opprof: the CUDA time of each kernel of one fused_chunk forward + backward.
* check: ``lambdanet.ops.causal_lambda`` modes against the definition in float64 on the GPU, outputs and gradients,
  float32 and bf16 inputs, awkward lengths.
* op: forward+backward tokens/s and peak memory of the causal lambda op (``fused_chunk`` and the PyTorch ``chunk``
  form, bf16 inputs) against fla's ``chunk_linear_attn`` (8 heads, 64 x 64 states) and SDPA causal attention
  (8 heads of 64), at n 2048 x 32, 8192 x 8, 32768 x 2.
* lm: training tokens/s (bf16 autocast, AdamW step included) of ``{lambda,transformer}_lm_base`` at contexts
  1k / 4k / 16k with 65,536 tokens per step.
* gen: generation ms/token after an 8k-token context, batch 1.
* profile: CUDA kernel launches and GPU time of one ``lambda_lm_base`` and ``transformer_lm_base`` training step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lambdanet.functional.causal import causal_lambda_reference  # noqa: E402
from lambdanet.models import create_model  # noqa: E402
from lambdanet.ops import causal_lambda  # noqa: E402

DEV = torch.device(os.environ.get("GPU_LM_DEVICE", "cuda"))


def _bench(fn, warmup=3, reps=10) -> float:
    """Median ms of ``fn`` (CUDA events)."""
    from lambdanet.bench.causal_tune import cuda_median_ms

    return cuda_median_ms(fn, warmup=warmup, reps=reps)


def _back_to_back(fn, calls: int = 10) -> float:
    """ms per call of ``calls`` calls queued without a synchronisation between them: the host prepares the next
    call while the GPU runs this one, so the host's own time (Python, dispatch, launches) shows only where it is
    longer than the GPU's. ``ms`` (one call from an idle GPU) minus this is the host time before the first kernel
    and in the gaps between short kernels."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def part_check(quick: bool) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    # keys of spread 40: many chunks rise past MAX_SPREAD (the channel loop); spread 3: every chunk factored
    for (b, n, h, k, v, u, r), scale in [((1, 100, 8, 16, 208, 1, 64), 40.0), ((1, 100, 8, 16, 208, 1, 64), 3.0)]:
        q = torch.randn(b, n, h, k, generator=g).to(DEV, torch.float64)
        K = (torch.randn(b, n, k, u, generator=g) * scale).to(DEV, torch.float64)
        V = torch.randn(b, n, v, u, generator=g).to(DEV, torch.float64)
        E = torch.randn(r, k, u, generator=g).to(DEV, torch.float64) if r else None
        for dtype in (torch.float32, torch.bfloat16, "bf16, float32 keys"):  # the last: a decayed model's layer
            bf, f32 = torch.bfloat16, torch.float32
            dts = (bf, f32, bf, f32) if isinstance(dtype, str) else (dtype,) * 4  # q, keys, values, emb
            ins = [t.to(d).requires_grad_() for t, d in zip((q, K, V, E), dts) if t is not None]
            ref_ins = [t.detach().double().requires_grad_() for t in ins]
            ref = causal_lambda_reference(*ref_ins[:3], ref_ins[3] if r else None)
            dy = torch.randn(ref.shape, generator=g).to(DEV, torch.float64)
            ref.backward(dy)
            for mode in ("fused_chunk",):
                xs = [t.detach().clone().requires_grad_() for t in ins]
                o = causal_lambda(*xs[:3], xs[3] if r else None, mode=mode)
                o.backward(dy.to(o.dtype))
                row = {"shape": (b, n, h, k, v, u, r), "key_scale": scale, "dtype": str(dtype), "mode": mode,
                       "out": _rel(o, ref)}  # fmt: skip
                for name, x, xr in zip("qKVE", xs, ref_ins):
                    row["d" + name] = _rel(x.grad, xr.grad)
                row["finite"] = all(bool(torch.isfinite(x.grad).all()) for x in xs) and bool(torch.isfinite(o).all())
                rows.append(row)
                print(row, flush=True)
    rows += _dtype_times()
    return rows


def _dtype_times() -> list[dict]:
    """Forward + backward ms of the op in float32 and in bf16 side by side (float32 had never been timed; its
    kernels now launch with every register, ptxas alone having given two of them 32). ``n`` 2040, like the check's
    100, is not a multiple of 16, so Triton reuses the check's compiled kernels."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(8, 2040, 8, 16, device=DEV, dtype=dtype, requires_grad=True)
        K = (3 * torch.randn(8, 2040, 16, 1, device=DEV)).to(dtype).requires_grad_()
        V = torch.randn(8, 2040, 208, 1, device=DEV, dtype=dtype, requires_grad=True)
        E = torch.randn(64, 16, 1, device=DEV, dtype=dtype).div(32).requires_grad_()
        dy = torch.randn(8, 2040, 8, 208, device=DEV, dtype=dtype)

        def f(q=q, K=K, V=V, E=E, dy=dy):
            causal_lambda(q, K, V, E, mode="fused_chunk").backward(dy)

        rows.append({"n": 2040, "b": 8, "dtype": str(dtype), "ms": _bench(f, warmup=2, reps=5)})
        print(rows[-1], flush=True)
    return rows


PEERS = os.environ.get("GPU_LM_PEERS", "1") != "0"  # 0: the op parts time our kernels alone (fla / SDPA elsewhere)


def part_warm(quick: bool) -> list[dict]:
    """Compile (no timing) every kernel the other parts launch at their shapes, filling Triton's cache before the
    timed runs (``gpu_bench.sh lm-first`` runs it in a process of its own beside the untimed check)."""
    rows = []
    fla = _fla() if PEERS else None
    for n, b in ((2048, 32), (8192, 8), (32768, 2)):
        q = torch.randn(b, n, 8, 16, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        K = torch.randn(b, n, 16, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        V = torch.randn(b, n, 208, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        E = (torch.randn(64, 16, 1, device=DEV) / 32).requires_grad_()
        for chunk in (16, 32):
            t0 = time.perf_counter()
            causal_lambda(q, K, V, E, mode="fused_chunk", chunk_size=chunk).float().sum().backward()
            _sync()
            rows.append({"n": n, "b": b, "chunk": chunk, "s": time.perf_counter() - t0})
        if fla is not None:
            qa = torch.randn(b, n, 8, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            o, _ = fla(qa, qa, qa)
            o.float().sum().backward()
        print(rows[-1], flush=True)
    if os.environ.get("GPU_LM_WARM_MODELS"):
        for ctx in (4096, 16384):
            model = create_model("lambda_lm_base").to(DEV)
            tokens = torch.randint(0, 256, (65536 // ctx, ctx + 1), device=DEV)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            t0 = time.perf_counter()
            _lm_step(model, opt, tokens)()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                _, state = model(tokens[:1, :64], return_state=True)
                model.step(state, tokens[:1, 64])
            _sync()
            rows.append({"model": "lambda_lm_base", "context": ctx, "s": time.perf_counter() - t0})
            print(rows[-1], flush=True)
            del model, opt
    return rows


def _fla():
    try:
        from fla.ops.linear_attn import chunk_linear_attn

        return chunk_linear_attn
    except Exception as e:  # noqa: BLE001
        print("fla unavailable:", e)
        return None


def part_op(quick: bool) -> list[dict]:
    rows = []
    fla = _fla()
    points = [(2048, 32), (8192, 8), (32768, 2)]
    h, k, v, r = 8, 16, 208, 64
    for n, b in points:
        torch.manual_seed(0)
        dt = torch.bfloat16
        q = torch.randn(b, n, h, k, device=DEV, dtype=dt, requires_grad=True)
        K = torch.randn(b, n, k, 1, device=DEV, dtype=dt, requires_grad=True)
        V = torch.randn(b, n, v, 1, device=DEV, dtype=dt, requires_grad=True)
        E = (torch.randn(r, k, 1, device=DEV) / 32).requires_grad_()
        dy = torch.randn(b, n, h, v, device=DEV, dtype=dt)
        qa = torch.randn(b, n, 8, 64, device=DEV, dtype=dt, requires_grad=True)
        ka = torch.randn(b, n, 8, 64, device=DEV, dtype=dt, requires_grad=True)
        va = torch.randn(b, n, 8, 64, device=DEV, dtype=dt, requires_grad=True)
        do = torch.randn(b, n, 8, 64, device=DEV, dtype=dt)

        def ours(mode, chunk=None):
            def f():
                o = causal_lambda(q, K, V, E, mode=mode, chunk_size=chunk)
                o.backward(dy.to(o.dtype))

            return f

        def sdpa():
            o = F.scaled_dot_product_attention(qa.transpose(1, 2), ka.transpose(1, 2), va.transpose(1, 2),
                                               is_causal=True)  # fmt: skip
            o.backward(do.transpose(1, 2))

        fns = {"lambda fused_chunk C16": ours("fused_chunk", 16), "lambda fused_chunk C32": ours("fused_chunk", 32),
               "sdpa causal": sdpa}  # fmt: skip
        if n <= 8192 and os.environ.get("GPU_LM_TORCH_CHUNK"):
            fns["lambda chunk (torch)"] = ours("chunk")
        if not PEERS:
            del fns["sdpa causal"]
        if fla is not None and PEERS:

            def fla_fn():
                o, _ = fla(qa, ka, va)
                o.backward(do)

            fns["fla chunk_linear_attn"] = fla_fn
        for name, fn in fns.items():
            try:
                ms = _bench(fn, warmup=2, reps=5 if quick else 10)
                peak = _peak(fn)
                row = {"n": n, "b": b, "op": name, "ms": ms, "tokens_per_s": b * n / ms * 1e3, "peak_gb": peak,
                       "ms_back_to_back": _back_to_back(fn)}  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row = {"n": n, "b": b, "op": name, "error": repr(e)[:300]}
            rows.append(row)
            print(row, flush=True)
    return rows


def _lm_step(model, opt, tokens):
    def f():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return f


def part_lm(quick: bool) -> list[dict]:
    rows = []
    for name in ("lambda_lm_base", "transformer_lm_base"):
        torch.manual_seed(0)
        model = create_model(name.split(":")[0]).to(DEV)
        for layer in model.modules():
            if hasattr(layer, "mode") and ":" in name:
                layer.mode = name.split(":")[1]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for ctx in (4096, 16384) if ":" not in name else (4096,):
            b = max(1, 65536 // ctx)
            tokens = torch.randint(0, 256, (b, ctx + 1), device=DEV)
            try:
                ms = _bench(_lm_step(model, opt, tokens), warmup=2, reps=3 if quick else 5)
                row = {"model": name, "context": ctx, "batch": b, "ms": ms, "tokens_per_s": b * ctx / ms * 1e3}
                row["peak_gb"] = _peak(_lm_step(model, opt, tokens))
            except Exception as e:  # noqa: BLE001
                row = {"model": name, "context": ctx, "error": repr(e)[:300]}
            rows.append(row)
            print(row, flush=True)
        del model, opt
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def part_gen(quick: bool) -> list[dict]:
    from lambdanet.models.lm_graph import StepGraph

    rows = []
    for name, graphed in (("lambda_lm_base", True), ("lambda_lm_base", False), ("transformer_lm_base", False)):
        torch.manual_seed(0)
        model = create_model(name).to(DEV).eval()
        prompt = torch.randint(0, 256, (1, 8192), device=DEV)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, state = model(prompt, return_state=True)
                tok = prompt[:, -1]
                steps = 32 if quick else 64
                graph = StepGraph(model._advance, state, tok, name=name) if graphed else None

                def run(model=model, graph=graph):
                    s, t = state, tok
                    for _ in range(steps):
                        if graph is not None:  # one replay per token (the state moves on in its buffers)
                            t = graph.step(t).argmax(-1)
                            continue
                        logits, s = model.step(s, t)
                        t = logits.argmax(-1)

                ms = _bench(run, warmup=1, reps=3) / steps
            rows.append({"model": name, "cuda_graph": graphed, "context": 8192, "ms_per_token": ms})
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "cuda_graph": graphed, "error": repr(e)[:300]})
        print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def part_profile(quick: bool) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for name in ("lambda_lm_base", "transformer_lm_base"):
        torch.manual_seed(0)
        model = create_model(name).to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = _lm_step(model, opt, torch.randint(0, 256, (16, 4097), device=DEV))
        step()
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        # the dtype copies by input shapes (lambda_lm_base's 339 aten::copy_ took 20 ms of 104, the transformer's 235
        # 13.5: which tensors are they?)
        shaped = prof.key_averages(group_by_input_shape=True)
        copies = [e for e in shaped if e.key in ("aten::copy_", "aten::cat")]
        copies = sorted(copies, key=lambda e: -e.device_time_total)[:20]
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.device_time for e in kernels) / 1e3
        top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
        per: dict[str, list] = {}  # the GPU kernels themselves by name: [ms, launches]
        for e in kernels:
            entry = per.setdefault(e.name[:70], [0.0, 0])
            entry[0] += e.device_time / 1e3
            entry[1] += 1
        by_time = sorted(([k, round(v[0], 3), v[1]] for k, v in per.items()), key=lambda r: -r[1])
        rows.append({"model": name, "launches": len(kernels), "gpu_ms": gpu_ms, "wall_ms_profiled": wall,
                     "top": [(e.key[:60], round(e.device_time_total / 1e3, 2), e.count) for e in top],
                     "kernels": by_time[:30],
                     "copies": [(e.key, str(e.input_shapes)[:120], round(e.device_time_total / 1e3, 3), e.count)
                                for e in copies]})  # fmt: skip
        print(rows[-1], flush=True)
        del model, opt
    return rows


def part_opprof(quick: bool) -> list[dict]:
    """Where the fused op's time goes: CUDA time per kernel of one forward + backward at each point."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for n, b in ((2048, 32), (32768, 2)):
        q = torch.randn(b, n, 8, 16, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        K = torch.randn(b, n, 16, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        V = torch.randn(b, n, 208, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        E = (torch.randn(64, 16, 1, device=DEV) / 32).requires_grad_()

        def f():
            causal_lambda(q, K, V, E, mode="fused_chunk").float().sum().backward()

        f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:40]] = per.get(e.name[:40], 0.0) + e.device_time / 1e3
        rows.append({"n": n, "b": b, "kernels_ms": dict(sorted(per.items(), key=lambda kv: -kv[1]))})
        print(rows[-1], flush=True)
    return rows


def part_ncu(quick: bool) -> list[dict]:
    """Two forward + backward passes at 2048 x 32 for Nsight Compute (``gpu_bench.sh lm-ncu`` profiles the second
    pass's product kernels: stall reasons, occupancy, memory throughput)."""
    q = torch.randn(32, 2048, 8, 16, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    K = torch.randn(32, 2048, 16, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    V = torch.randn(32, 2048, 208, 1, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    E = (torch.randn(64, 16, 1, device=DEV) / 32).requires_grad_()
    dy = torch.randn(32, 2048, 8, 208, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        causal_lambda(q, K, V, E, mode="fused_chunk").backward(dy)
        _sync()
    return [{"passes": 2}]


PARTS = {"warm": part_warm, "ncu": part_ncu, "opprof": part_opprof, "check": part_check, "op": part_op,
         "lm": part_lm, "gen": part_gen, "profile": part_profile}  # fmt: skip
ORDER = "opprof,op,lm,check,gen,profile"  # the next GPU session: what the kernels spend, then the study


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--parts", default=ORDER)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "time": time.time()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(info, flush=True)
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            rows = PARTS[part](args.quick)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            rows = [{"error": repr(e)[:500]}]
        with open(os.path.join(args.out, f"{part}.json"), "w") as f:
            json.dump({"info": info, "rows": rows, "seconds": time.perf_counter() - t0}, f, indent=1, default=str)
        print(f"== {part}: {time.perf_counter() - t0:.1f}s", flush=True)
    _ = math  # noqa


if __name__ == "__main__":
    main()
