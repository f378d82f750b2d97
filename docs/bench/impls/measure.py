import json, sys, time, torch
from lambdanet.bench.layer_bench import lambda_impls, IMPL_POINTS, TARGET_POINTS, lambda_vs_peers
which = sys.argv[1]; out = sys.argv[2]
print("torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
t0 = time.time()
if which == "impls_rest":
    pts = IMPL_POINTS[9:] + TARGET_POINTS
elif which == "impls_targets":
    pts = TARGET_POINTS
for p in (pts if which.startswith("impls") else []):
    rows = lambda_impls(points=[p], log=lambda s: print(s, flush=True))
    with open(out, "a") as f:
        for r in rows: f.write(json.dumps(r) + "\n")
    print(f"done {p} at {time.time()-t0:.0f}s", flush=True)
if which == "targets":
    rows = lambda_vs_peers(log=lambda s: print(s, flush=True))
    with open(out, "a") as f:
        for r in rows: f.write(json.dumps(r) + "\n")
print("total", time.time() - t0, flush=True)
