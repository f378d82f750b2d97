"""MobileNet-v2 (Sandler et al. 2018) and its lambda variant (LambdaNetworks App. D.3.2, Table 17).

The lightweight lambda block replaces an inverted bottleneck: its first pointwise convolution keeps the channel
count (no expansion), and the depthwise convolution becomes a lambda convolution with a 5x5 scope, ``|k| = 32``
and ``|h| = 4``; the projection and the residual connection stay. ``mobilenet_v2_lambda`` replaces the 10th and
16th of the 17 inverted bottlenecks. Table 17: 3.50M / 603 MFLOPs, and 3.21M / 563 MFLOPs with two lambda blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor, nn

from lambdanet.layers import LambdaLayer
from lambdanet.layers.conv_norm_act import conv_norm_act
from lambdanet.models.base import Backbone, image_size, is_block_list
from lambdanet.models.family import family_registrar
from lambdanet.models.registry import ModelInfo

__all__ = [
    "MobileNetV2",
    "InvertedResidual",
    "LambdaBlock",
    "INVERTED_RESIDUAL_SETTING",
    "FEATURE_ROWS",
    "MobileNetVariant",
    "model_cfgs",
    "MOBILENET_ARGS",
]

# (expansion t, channels c, repeats n, stride s) of Sandler et al. 2018, Table 2
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
# feature taps: the row of INVERTED_RESIDUAL_SETTING whose last block ends each stage (strides 4, 8, 16, 32)
FEATURE_ROWS = {"c2": 1, "c3": 2, "c4": 4, "c5": 6}


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, project (1x1, linear); residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = conv_norm_act(cin, hidden, act="relu6") if expand != 1 else []
        layers += conv_norm_act(hidden, hidden, 3, stride=stride, groups=hidden, act="relu6")  # depthwise
        layers += conv_norm_act(hidden, cout, act=None)  # linear projection
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class LambdaBlock(nn.Module):
    """Lightweight lambda block (App. D.3.2): 1x1 (no expansion), lambda conv (r=5, k=32, h=4), 1x1."""

    def __init__(self, cin: int, cout: int, stride: int, *, r: int = 5, dim_k: int = 32, heads: int = 4):
        super().__init__()
        self.block = nn.Sequential(
            *conv_norm_act(cin, cin, act="relu6"),
            LambdaLayer(cin, cin, dim_k=dim_k, heads=heads, r=r, stride=stride),
            nn.BatchNorm2d(cin),
            nn.ReLU6(inplace=True),
            *conv_norm_act(cin, cout, act=None),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(Backbone):
    """MobileNet-v2 with optional lambda blocks at ``lambda_blocks`` (1-indexed inverted bottlenecks). Its feature
    maps, as timm's ``mobilenetv2_100`` has them: 0 the first inverted bottleneck's (stride 2), 1..4 the last
    block of each stride (c2..c5); ``features_only`` returns ``out_indices`` of them (default 1..4)."""

    def __init__(
        self,
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        lambda_blocks: Sequence[int] = (),
        drop_rate: float = 0.2,
        features_only: bool = False,
        out_indices: int | Sequence[int] | None = None,
        img_size: int | Sequence[int] = 224,
    ):
        super().__init__()
        total = sum(n for _, _, n, _ in INVERTED_RESIDUAL_SETTING)
        if not is_block_list(lambda_blocks) or any(not 1 <= i <= total for i in lambda_blocks):
            raise ValueError(
                f"lambda_blocks must be 1-indexed inverted bottlenecks in 1..{total}, got {lambda_blocks!r}"
            )
        self.img_size = image_size(img_size, 224)  # the size it is built for (pretrained_cfg): any size runs
        blocks: list[nn.Module] = [nn.Sequential(*conv_norm_act(in_chans, 32, 3, stride=2, act="relu6"))]  # stem
        info, self._taps = [{"module": "features.1", "stage": "stem", "num_chs": 16, "reduction": 2}], [1]
        stage_of_row = {row: stage for stage, row in FEATURE_ROWS.items()}
        cin, idx, reduction = 32, 0, 2
        for row, (t, c, n, s) in enumerate(INVERTED_RESIDUAL_SETTING):
            for j in range(n):
                stride, idx = (s if j == 0 else 1), idx + 1
                block = LambdaBlock(cin, c, stride) if idx in lambda_blocks else InvertedResidual(cin, c, stride, t)
                blocks.append(block)
                cin, reduction = c, reduction * stride
            if row in stage_of_row:
                self._taps.append(len(blocks) - 1)
                info.append(
                    {
                        "module": f"features.{len(blocks) - 1}",
                        "stage": stage_of_row[row],
                        "num_chs": c,
                        "reduction": reduction,
                    }
                )
        self.features = nn.Sequential(*blocks)
        self.final_conv = nn.Sequential(*conv_norm_act(cin, 1280, act="relu6"))
        self._init_head(1280, num_classes, drop_rate, features_only, info=info, out_indices=out_indices)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if isinstance(self.fc, nn.Linear):
            nn.init.normal_(self.fc.weight, 0, 0.01)
            nn.init.zeros_(self.fc.bias)

    def _trunk(self) -> tuple[list[list[nn.Module]], list[nn.Module]]:
        blocks, segments, start = list(self.features), [], 0
        for tap in self._taps:
            if tap >= len(blocks):  # pruned
                break
            segments.append(blocks[start : tap + 1])
            start = tap + 1
        return segments, blocks[start:] + [self.final_conv]

    def _blocks(self) -> list[nn.Module]:
        return list(self.features)[1:]

    def forward_features(self, x: Tensor) -> Tensor:
        return self._run([self.features, self.final_conv], x, self._checkpointed())

    def _prune_trunk(self, last: int) -> None:
        self.features = self.features[: self._taps[last] + 1]
        if last < len(self._taps) - 1:
            self.final_conv = nn.Identity()

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's format, and timm's groups of MobileNet-v2: the stem convolution, one group per inverted bottleneck
        (``coarse``: per row of :data:`INVERTED_RESIDUAL_SETTING`), ``final_conv`` joined to the last; the
        classifier last."""
        if not coarse:
            return {"stem": r"^features\.0\.", "blocks": [(r"^features\.(\d+)", None), (r"^final_conv", (99999,))]}
        first, rows = 1, []
        for row, (_, _, n, _) in enumerate(INVERTED_RESIDUAL_SETTING):
            rows.append((rf"^features\.(?:{'|'.join(str(i) for i in range(first, first + n))})\.", (row,)))
            first += n
        return {"stem": r"^features\.0\.", "blocks": [*rows, (r"^final_conv", (99999,))]}


class MobileNetVariant(NamedTuple):
    """One entry of :data:`model_cfgs`."""

    lambda_blocks: tuple[int, ...]  # 1-indexed inverted bottlenecks replaced by lightweight lambda blocks
    paper: str  # ModelInfo.paper


# Every MobileNet model, by registered name
model_cfgs: dict[str, MobileNetVariant] = {
    "mobilenet_v2": MobileNetVariant((), "Sandler et al. 2018; LambdaNetworks Table 17 (3.50M)"),
    "mobilenet_v2_lambda": MobileNetVariant((10, 16), "LambdaNetworks App. D.3.2, Table 17 (3.21M)"),
}
# the keyword arguments of the MobileNet entry points (mobilenet_v2_lambda also takes lambda_blocks)
MOBILENET_ARGS = {"drop_rate": 0.2, "features_only": False, "out_indices": None, "img_size": 224}
# LambdaNetworks App. E.2, MobileNet training setup (the hyperparameters of Howard et al. 2019)
RECIPE = {
    "epochs": 350,
    "optimizer": "rmsprop",
    "momentum": 0.9,
    "lr": 0.1,
    "batch_size": 4096,
    "schedule": "step",
    "lr_decay_rate": 0.99,
    "lr_decay_epochs": 3.0,
    "weight_decay": 1e-5,
    "drop_rate": 0.2,
    "img_size": 224,
}


def _create(variant: str, *, lambda_blocks: Sequence[int] | None = None, **kwargs) -> MobileNetV2:
    """Build ``model_cfgs[variant]`` with the keyword arguments of :data:`MOBILENET_ARGS`."""
    blocks = model_cfgs[variant].lambda_blocks if lambda_blocks is None else lambda_blocks  # checked there
    return MobileNetV2(lambda_blocks=blocks, **kwargs)


def _info(name: str) -> ModelInfo:
    return ModelInfo(
        name,
        224,
        model_cfgs[name].paper,
        dict(RECIPE),
        recipe_source="LambdaNetworks App. E.2 (MobileNet training setup)",
    )


@family_registrar(_info, MOBILENET_ARGS)
def mobilenet_v2(**kwargs) -> MobileNetV2:
    """MobileNet-v2 (3.50M parameters, Table 17)."""
    return _create("mobilenet_v2", **kwargs)


@family_registrar(_info, {**MOBILENET_ARGS, "lambda_blocks": model_cfgs["mobilenet_v2_lambda"].lambda_blocks})
def mobilenet_v2_lambda(**kwargs) -> MobileNetV2:
    """MobileNet-v2 with the 10th and 16th inverted bottlenecks replaced by lightweight lambda blocks."""
    return _create("mobilenet_v2_lambda", **kwargs)
