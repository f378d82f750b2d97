"""torch.compile throughput of lambda_resnet26t (ours and timm's, same architecture) and resnet26t on one GPU:
bf16 autocast, channels_last, 256 px, batch 256, as timm measures (issue 23). Inference first, then training;
each result is appended to ``<out>/compiled.jsonl`` as it comes, so a time limit loses only the model in flight.

    python scripts/gpu_compiled.py OUT_DIR [model ...]
"""

import json
import sys
import time
from pathlib import Path

import torch

from lambdanet.bench.model_bench import _build, bench_model

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
names = sys.argv[2:] or ["lambda_resnet26t", "timm:lambda_resnet26t", "timm:resnet26t"]
for mode in ("infer", "train"):
    for name in names:
        torch.manual_seed(0)
        t0 = time.time()
        model = _build(name, {}, 256)
        res = bench_model(
            model, 256, 256, device="cuda", train=mode == "train", amp="bf16", channels_last=True, compile=True
        )
        row = {"model": name, "mode": mode, "compile": True, **res, "wall_s": time.time() - t0}
        print(json.dumps(row), flush=True)
        with open(out / "compiled.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        torch._dynamo.reset()
