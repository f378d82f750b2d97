"""The plot of BENCHMARKS.md section 8 (docs/bench/gpu/models_h100.png) from the committed H100 results:
eager (timm26.json) and compiled (compiled.jsonl) throughput of lambda_resnet26t, ours and timm's, and resnet26t."""

import json
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

D = "docs/bench/gpu/"
rows = [json.loads(line) for line in open(D + "compiled.jsonl")]
eager = json.load(open(D + "timm26.json"))
names = [
    ("timm:resnet26t", "timm resnet26t"),
    ("lambda_resnet26t", "ours lambda_resnet26t"),
    ("timm:lambda_resnet26t", "timm lambda_resnet26t"),
]
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, mode in zip(axes, ("infer", "train")):
    vals_e = [next(r[f"{mode}_images_per_s"] for r in eager if r["model"] == n) for n, _ in names]
    vals_c = [next(r["images_per_s"] for r in rows if r["model"] == n and r["mode"] == mode) for n, _ in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], vals_e, 0.4, label="eager")
    ax.bar([i + 0.2 for i in x], vals_c, 0.4, label="torch.compile")
    ax.set_xticks(list(x))
    ax.set_xticklabels([label for _, label in names], rotation=12, fontsize=8)
    ax.set_title(f"{'inference' if mode == 'infer' else 'training'}: images/s")
    ax.legend()
fig.suptitle("H100, bf16, channels_last, 256 px, batch 256")
fig.tight_layout()
fig.savefig(D + "models_h100.png", dpi=110)
