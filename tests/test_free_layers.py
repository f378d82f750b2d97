"""scripts/gpu_free_layers.py, the ceiling of any lambda layer in lambda_resnet26t: its ``free`` model is timm's
resnet26t without exactly the three 3x3 convolutions the lambda layers replace (their FLOPs, nothing else)."""

import importlib.util
from pathlib import Path

import pytest
import torch

timm = pytest.importorskip("timm")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_free_layers.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_free_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_free_model_drops_exactly_the_replaced_convolutions():
    from torch.utils.flop_counter import FlopCounterMode

    script = _script()
    x = torch.randn(2, 3, 64, 64)
    full, free = timm.create_model("resnet26t").eval(), script.free_resnet26t().eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counted_full:
        y_full = full(x)
    with torch.no_grad(), FlopCounterMode(display=False) as counted_free:
        y_free = free(x)
    assert y_free.shape == y_full.shape
    per_module = counted_full.get_flop_counts()
    replaced = sum(sum(per_module[f"ResNet.{name}"].values()) for name in script.REPLACED)
    assert replaced > 0
    assert counted_full.get_total_flops() - counted_free.get_total_flops() == replaced
    # where lambda_resnet26t has its lambda layers: c4's second block and both of c5
    lambdas = {name.rsplit(".", 1)[0] for name, _ in timm.create_model("lambda_resnet26t").named_modules()
               if name.endswith(".self_attn")}  # fmt: skip
    blocks = {name.rsplit(".", 1)[0].replace("layer3", "stages.2").replace("layer4", "stages.3")
              for name in script.REPLACED}  # fmt: skip
    assert lambdas == blocks


def test_a_free_layer_refuses_a_convolution_that_changes_the_channels():
    with pytest.raises(ValueError, match="keeps the channels, got 8 -> 16"):
        _script().Free(torch.nn.Conv2d(8, 16, 3))
