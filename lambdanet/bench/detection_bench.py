"""Detection backbones: backbone-only time and peak memory at detection resolutions.

LambdaNetworks Table 6 and HaloNet Table 5 compare detection backbones by accuracy and by the backbone's
own cost (HaloNet: "backbone-only time"). :func:`backbone_costs` measures each backbone of the side-by-side
study (:data:`lambdanet.tasks.detection.model.STUDY_BACKBONES`, at the quick recipe's width) as the detector runs
it: ``create_feature_backbone`` (``features_only``, relative tables sized for the input), square inputs of
``size x size``, the c2..c5 maps out. Per backbone, size and batch: parameters, forward time (inference,
no autograd), forward+backward time (training: the loss is the sum of every map's mean), and the peak
memory of each (tensors created during the call, :func:`lambdanet.runtime.peak_memory`).

:func:`memory_slopes` fits the log-log slope of peak memory against the image area: 1 is linear growth
(lambda convolutions, LambdaNetworks Table 2, and blocked local attention, HaloNet Table 1, cost
``Theta(b n m)`` with a fixed ``m``), 2 the quadratic growth of global attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lambdanet.bench.layer_bench import loglog_slope
from lambdanet.tasks.detection.model import STUDY_BACKBONES, create_feature_backbone
from lambdanet.tasks.detection.config import quick_backbone_kwargs
from lambdanet.runtime import peak_memory, time_round_robin

__all__ = ["DETECTION_SIZES", "DETECTION_BATCHES", "backbone_costs", "memory_slopes"]

DETECTION_SIZES = (512, 768, 1024)  # LambdaNetworks Table 6 and HaloNet Table 5 detect at 1024 x 1024
DETECTION_BATCHES = (1, 2)


def _steps(body: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    def forward():
        with torch.no_grad():
            body(x)

    def train():
        body.zero_grad(set_to_none=True)
        sum(f.mean() for f in body(x)).backward()

    return {"forward": forward, "train": train}


def backbone_costs(
    backbones: Sequence[str] = tuple(STUDY_BACKBONES),
    sizes: Sequence[int] = DETECTION_SIZES,
    batches: Sequence[int] = DETECTION_BATCHES,
    *,
    device: str = "cpu",
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per backbone, size and batch: ``params``, ``forward_ms`` / ``train_ms`` (medians over
    ``repeats`` round-robin rounds) and ``forward_peak_bytes`` / ``train_peak_bytes``."""
    device_ = torch.device(device)
    rows = []
    for name in backbones:
        kwargs = quick_backbone_kwargs(name)
        for size in sizes:
            torch.manual_seed(0)
            body, _, _ = create_feature_backbone(name, max_size=size, **kwargs)
            body = body.to(device_).train()
            params = sum(p.numel() for p in body.parameters())
            for batch in batches:
                x = torch.randn(batch, 3, size, size, device=device_)  # b 3 s s
                steps = _steps(body, x)
                timing = time_round_robin(steps, device_, warmup=1, repeats=repeats, max_seconds=120)
                peaks = {mode: peak_memory(step, device_) for mode, step in steps.items()}
                body.zero_grad(set_to_none=True)
                row = {
                    "backbone": name,
                    "label": STUDY_BACKBONES.get(name, name),
                    "size": size,
                    "batch": batch,
                    "params": params,
                    "forward_ms": timing["forward"].median_s * 1e3,
                    "train_ms": timing["train"].median_s * 1e3,
                    "forward_peak_bytes": peaks["forward"],
                    "train_peak_bytes": peaks["train"],
                }
                rows.append(row)
                log(
                    f"  {name} {size}px batch {batch}: forward {row['forward_ms']:.0f} ms / "
                    f"{peaks['forward'] / 2**20:.0f} MiB, train {row['train_ms']:.0f} ms / "
                    f"{peaks['train'] / 2**20:.0f} MiB"
                )
    return rows


def memory_slopes(rows: Sequence[dict]) -> list[dict]:
    """Per backbone (at its smallest batch): log-log slopes of forward and training peak memory against the
    image area, and the ratio of the peaks at the largest and smallest size next to the ratio of areas."""
    out = []
    for name in dict.fromkeys(r["backbone"] for r in rows):
        mine = [r for r in rows if r["backbone"] == name]
        batch = min(r["batch"] for r in mine)
        mine = sorted((r for r in mine if r["batch"] == batch), key=lambda r: r["size"])
        if len(mine) < 2:
            continue
        areas = [r["size"] ** 2 for r in mine]
        out.append(
            {
                "backbone": name,
                "batch": batch,
                "sizes": "/".join(str(r["size"]) for r in mine),
                "forward_memory_slope": loglog_slope(areas, [r["forward_peak_bytes"] for r in mine]),
                "train_memory_slope": loglog_slope(areas, [r["train_peak_bytes"] for r in mine]),
                "area_ratio": areas[-1] / areas[0],
                "train_peak_ratio": mine[-1]["train_peak_bytes"] / mine[0]["train_peak_bytes"],
            }
        )
    return out
