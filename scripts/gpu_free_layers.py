"""The ceiling of any lambda layer in lambda_resnet26t: timm's resnet26t with the three 3x3 convolutions that the
lambda layers replace (the second block of c4, both of c5) made free (an identity, or a strided slice where the
block downsamples), timed beside resnet26t itself, timm's lambda_resnet26t and ours. Inference, bf16 autocast,
channels_last, 256 px, batch 256, as BENCHMARKS.md section 8 measures.

If ``free`` is below 2x timm's lambda_resnet26t, no lambda layer, however fast, meets issue 36's ">= 2x timm's"
(BENCHMARKS.md section 8 estimates 1.77x from the FLOPs). Rows go to ``<out>/free_layers.jsonl`` as they come.

    python scripts/gpu_free_layers.py OUT_DIR [--device cuda] [--batch 256] [--img 256] [--repeats 5]
"""

import argparse
import json
from pathlib import Path

import timm
import torch
from torch import nn

from lambdanet.bench.model_bench import bench_model
from lambdanet.models import create_model

REPLACED = ("layer3.1.conv2", "layer4.0.conv2", "layer4.1.conv2")  # where lambda_resnet26t has its lambda layers


class Free(nn.Module):
    """A 3x3 convolution that costs nothing: its input (channels in == out), strided as the convolution was."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        if conv.in_channels != conv.out_channels:
            raise ValueError(f"a free layer keeps the channels, got {conv.in_channels} -> {conv.out_channels}")
        self.stride = conv.stride[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x


def free_resnet26t() -> nn.Module:
    model = timm.create_model("resnet26t", pretrained=False)
    for name in REPLACED:
        parent, child = name.rsplit(".", 1)
        owner = model.get_submodule(parent)
        setattr(owner, child, Free(getattr(owner, child)))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--img", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    builders = {
        "timm:resnet26t": lambda: timm.create_model("resnet26t", pretrained=False),
        "free": free_resnet26t,
        "timm:lambda_resnet26t": lambda: timm.create_model("lambda_resnet26t", pretrained=False),
        "lambda_resnet26t": lambda: create_model("lambda_resnet26t", img_size=a.img),
    }
    rows = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        res = bench_model(build(), a.img, a.batch, device=a.device, train=False, repeats=a.repeats,
                          amp="bf16", channels_last=True)  # fmt: skip
        rows[name] = res["images_per_s"]
        row = {"model": name, **res}
        print(json.dumps(row), flush=True)
        with open(a.out / "free_layers.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    timm_lambda, conv = rows["timm:lambda_resnet26t"], rows["timm:resnet26t"]
    print(
        f"free / timm's lambda_resnet26t: {rows['free'] / timm_lambda:.2f}x (the ceiling of any lambda layer); "
        f"ours {rows['lambda_resnet26t'] / timm_lambda:.2f}x; free / resnet26t {rows['free'] / conv:.2f}x"
    )


if __name__ == "__main__":
    main()
