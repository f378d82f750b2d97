"""MobileNet-v2 (Sandler et al. 2018) and its lambda variant (LambdaNetworks App. D.3.2, Table 17).

The lightweight lambda block replaces an inverted bottleneck: its first pointwise convolution keeps the
channel count (no expansion), and the depthwise convolution becomes a lambda convolution with a 5x5
scope, ``|k| = 32`` and ``|h| = 4``; the projection and the residual connection stay. ``mobilenet_v2_lambda``
replaces the 10th and 16th inverted bottlenecks (1-indexed over the 17). Table 17: 3.50M / 603 MFLOPs
for MobileNet-v2 and 3.21M / 563 MFLOPs with two lambda blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lambdanet.layers import LambdaLayer
from lambdanet.models.base import Backbone
from lambdanet.models.registry import ModelInfo, register_model

__all__ = ["MobileNetV2", "InvertedResidual", "LambdaBlock", "INVERTED_RESIDUAL_SETTING"]

# (expansion t, channels c, repeats n, stride s) of Sandler et al. 2018, Table 2
INVERTED_RESIDUAL_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                             (6, 160, 3, 2), (6, 320, 1, 1))


def _cbr(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1, act: bool = True) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return layers + [nn.ReLU6(inplace=True)] if act else layers


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, project (1x1, linear); residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = _cbr(cin, hidden) if expand != 1 else []
        layers += _cbr(hidden, hidden, 3, stride, groups=hidden) + _cbr(hidden, cout, act=False)
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class LambdaBlock(nn.Module):
    """Lightweight lambda block (App. D.3.2): 1x1 (no expansion), lambda conv (r=5, k=32, h=4), 1x1."""

    def __init__(self, cin: int, cout: int, stride: int, *, r: int = 5, dim_k: int = 32, heads: int = 4):
        super().__init__()
        self.block = nn.Sequential(
            *_cbr(cin, cin), LambdaLayer(cin, cin, dim_k=dim_k, heads=heads, r=r, stride=stride),
            nn.BatchNorm2d(cin), nn.ReLU6(inplace=True), *_cbr(cin, cout, act=False))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(Backbone):
    """MobileNet-v2 with optional lambda blocks at ``lambda_blocks`` (1-indexed inverted bottlenecks)."""

    def __init__(self, *, num_classes: int = 1000, in_chans: int = 3, lambda_blocks: Sequence[int] = (),
                 drop_rate: float = 0.2, features_only: bool = False, img_size: int = 224):
        super().__init__()
        total = sum(n for _, _, n, _ in INVERTED_RESIDUAL_SETTING)
        if any(not 1 <= i <= total for i in lambda_blocks):
            raise ValueError(f"lambda_blocks must be 1-indexed inverted bottlenecks in 1..{total}, got {lambda_blocks}")
        self.img_size = (img_size, img_size)
        stem = nn.Sequential(*_cbr(in_chans, 32, 3, 2))
        blocks: list[nn.Module] = [stem]
        self.feature_info, self._taps = [], []
        cin, idx, reduction = 32, 0, 2
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            for j in range(n):
                stride = s if j == 0 else 1
                idx += 1
                block = LambdaBlock(cin, c, stride) if idx in lambda_blocks else InvertedResidual(cin, c, stride, t)
                blocks.append(block)
                cin, reduction = c, reduction * stride
            if c in (24, 32, 96, 320):  # the last block at strides 4, 8, 16, 32
                self._taps.append(len(blocks) - 1)
                self.feature_info.append({"module": f"features.{len(blocks) - 1}",
                                          "stage": f"c{len(self.feature_info) + 2}", "num_chs": c,
                                          "reduction": reduction})
        self.features = nn.Sequential(*blocks)
        self.final_conv = nn.Sequential(*_cbr(cin, 1280))
        self._init_head(1280, num_classes, drop_rate, features_only)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if isinstance(self.fc, nn.Linear):
            nn.init.normal_(self.fc.weight, 0, 0.01)
            nn.init.zeros_(self.fc.bias)

    def forward_stages(self, x: Tensor) -> list[Tensor]:
        feats = []
        for i, block in enumerate(self.features):
            x = block(x)
            if i in self._taps:
                feats.append(x)
        return feats

    def forward_features(self, x: Tensor) -> Tensor:
        return self.final_conv(self.features(x))


_RECIPE = {"epochs": 350, "optimizer": "rmsprop", "momentum": 0.9, "lr": 0.1, "batch_size": 4096,
           "lr_decay": "x0.99 every 3 epochs", "weight_decay": 1e-5, "dropout": 0.2, "image_size": 224,
           "source": "LambdaNetworks App. E.2 (MobileNet training setup)"}


@register_model(info=ModelInfo("mobilenet_v2", 224, "Sandler et al. 2018; LambdaNetworks Table 17 (3.50M)",
                               _RECIPE))
def mobilenet_v2(*, num_classes: int = 1000, in_chans: int = 3, drop_rate: float = 0.2, features_only: bool = False,
                 img_size: int = 224) -> MobileNetV2:
    """MobileNet-v2 (3.50M parameters, Table 17)."""
    return MobileNetV2(num_classes=num_classes, in_chans=in_chans, drop_rate=drop_rate, features_only=features_only,
                       img_size=img_size)


@register_model(info=ModelInfo("mobilenet_v2_lambda", 224, "LambdaNetworks App. D.3.2, Table 17 (3.21M)", _RECIPE))
def mobilenet_v2_lambda(*, num_classes: int = 1000, in_chans: int = 3, drop_rate: float = 0.2,
                        features_only: bool = False, lambda_blocks: Sequence[int] = (10, 16),
                        img_size: int = 224) -> MobileNetV2:
    """MobileNet-v2 with the 10th and 16th inverted bottlenecks replaced by lightweight lambda blocks."""
    return MobileNetV2(num_classes=num_classes, in_chans=in_chans, lambda_blocks=tuple(lambda_blocks),
                       drop_rate=drop_rate, features_only=features_only, img_size=img_size)
