"""The twelve attention networks with public ImageNet weights (timm's "bring your own attention" family),
declared as data and built from lambdanet's layers, under timm's names and with exactly timm's parameters.

LambdaResNets (``lambda_resnet26t``, ``lambda_resnet50ts``, ``lambda_resnet26rpt_256``), HaloNets (``halonet26t``,
``halonet50ts``, ``sehalonet33ts``, ``eca_halonext26ts``, ``haloregnetz_b``), BoTNets (``botnet26t_256``,
``sebotnet33ts_256``) and hybrids (``lamhalobotnet50ts_256``, ``halo2botnet50ts_256``). Their trunk: ResNet
bottleneck blocks (1x1, 3x3, 1x1), some with the 3x3 replaced by self-attention, BatchNorm and the activation.
Suffixes (timm's): ``t`` a tiered 3-conv stem (24, 32, 64 channels), ``s`` SiLU, ``rpt`` global relative positions.

Where those checkpoints differ from the papers, the layers take the checkpoints' convention as an option (the
papers' stay the layers' defaults):

* lambda layers (``LambdaLayer``): a bias on the lambda convolution (``position_bias=True``), and a 2x2 average
  pool after a strided layer (``stride_pool=2``) instead of App. E.1's 3x3 one;
* halo attention (``HaloAttention``): no padding mask (``mask_padding=False``), full-depth height/width relative
  tables (``rel_split="full"``), offsets measured from a query's index in its (subsampled) block
  (``rel_geometry="window"``), and a 2x2 average pool after the layer where the stride does not divide the
  block (``downsample="pool"``, ``haloregnetz_b``);
* BoTNet's attention is :class:`~lambdanet.layers.RelativeSelfAttention` with full-depth tables (Bello et al.
  2019), a 2x2 average pool after it when strided;
* squeeze-and-excitation (``se``) and efficient channel attention (``eca``) gates after the 3x3 of convolution
  blocks, grouped 3x3 convolutions (``group_size``), and RegNetZ blocks (``haloregnetz_b``: the bottleneck
  widens its *input* by ``bottle_ratio``, no activation after the sum, no projection shortcut: a block that
  changes the shape has no residual).

:data:`model_cfgs` names each stage's blocks as a string, ``"b"`` a convolution block and ``"a"`` a
self-attention block, as timm's ``interleave_blocks`` places them. :mod:`lambdanet.models.pretrained` loads the
checkpoints (``create_model(name, pretrained=True)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from torch import Tensor, nn

from lambdanet.layers import EfficientChannelAttention, HaloAttention, LambdaLayer, RelativeSelfAttention, SqueezeExcite
from lambdanet.layers.conv_norm_act import BatchNormAct, ConvNormAct, get_act, make_divisible
from lambdanet.helpers import check_number
from lambdanet.layers.drop import DropPath
from lambdanet.models.base import Backbone, image_size
from lambdanet.models.byoa_cfgs import ByoaSpec, ByoaStage, model_cfgs, timm_weights  # re-exported: their old home
from lambdanet.models.family import family_registrar
from lambdanet.models.registry import ModelInfo

__all__ = ["ByoaStage", "ByoaSpec", "ByoaNet", "timm_weights", "model_cfgs", "BYOA_ARGS"]


class ByoaBlock(nn.Module):
    """A bottleneck block: ``1x1 -> (3x3 [-> channel gate] | self-attention -> BN -> act) -> 1x1 (+ shortcut)``.
    ``spatial`` is the 3x3 :class:`ConvNormAct` (then ``attn`` is the optional channel gate) or the
    self-attention layer (then ``post_attn`` is the BN and activation)."""

    def __init__(
        self,
        dim: int,
        dim_out: int,
        mid: int,
        spatial: nn.Module,
        *,
        attention: bool,
        stride: int,
        act: type[nn.Module],
        gate: nn.Module | None,
        shortcut: str,
        linear_out: bool,
        drop_path: float,
    ):
        super().__init__()
        self.shortcut = (
            nn.Identity()
            if dim == dim_out and stride == 1
            else ConvNormAct(dim, dim_out, 1, stride=stride, act=None)
            if shortcut
            else None
        )
        self.conv1_1x1 = ConvNormAct(dim, mid, 1, act=act)
        if attention:
            self.self_attn = spatial  # mid -> mid, its own stride
            self.post_attn = BatchNormAct(mid, act)
        else:
            self.conv2_kxk = spatial  # the 3x3 ConvNormAct
            self.attn = gate if gate is not None else nn.Identity()
        self.attention = attention
        self.conv3_1x1 = ConvNormAct(mid, dim_out, 1, act=None)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.act = nn.Identity() if linear_out else act(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1_1x1(x)  # b mid H W
        if self.attention:
            y = self.post_attn(self.self_attn(y))  # b mid H/s W/s
        else:
            y = self.attn(self.conv2_kxk(y))  # b mid H/s W/s
        y = self.drop_path(self.conv3_1x1(y))  # b out H/s W/s
        if self.shortcut is not None:
            y = y + self.shortcut(x)
        return self.act(y)

    def zero_init_last(self) -> None:
        if self.shortcut is not None:
            nn.init.zeros_(cast(nn.BatchNorm2d, self.conv3_1x1.bn).weight)


def self_attention_layer(kind: str, kwargs: Mapping, dim: int, stride: int, feat_size: tuple[int, int]) -> nn.Module:
    """The self-attention layer of a block (``dim`` channels in and out) from timm's layer name and
    keyword arguments, built from lambdanet's layers with the checkpoints' conventions (module docstring)."""
    kw = dict(kwargs)
    layer: nn.Module
    if kind == "lambda":  # timm: 4 heads, k = 16, u = 1
        r = kw.pop("r", 9)
        layer = LambdaLayer(
            dim,
            dim,
            dim_k=kw.pop("dim_head", 16),
            heads=kw.pop("num_heads", 4),
            r=r,
            feat_size=None if r is not None else feat_size,
            stride=stride,
            stride_pool=2,
            position_bias=r is not None,
        )
    elif kind == "halo":  # timm: 8 heads, query/key depth from qk_ratio unless dim_head
        heads = kw.pop("num_heads", 8)
        dim_head = kw.pop("dim_head", None) or make_divisible(dim * kw.pop("qk_ratio", 1.0)) // heads
        block = kw.pop("block_size", 8)
        layer = HaloAttention(
            dim,
            dim,
            stride=stride,
            block_size=block,
            halo_size=kw.pop("halo_size", 3),
            heads=heads,
            dim_qk=heads * dim_head,
            downsample="pool" if block % stride else "subsample",
            rel_split="full",
            rel_geometry="window",
            mask_padding=False,
        )
    elif kind == "bottleneck":  # BoTNet: 4 heads, global, full-depth relative tables
        heads = kw.pop("num_heads", 4)
        dim_head = kw.pop("dim_head", None) or make_divisible(dim * kw.pop("qk_ratio", 1.0)) // heads
        layer = RelativeSelfAttention(
            dim, dim, feat_size=feat_size, stride=stride, heads=heads, dim_qk=heads * dim_head, rel_split="full"
        )
    else:
        raise ValueError(f"self-attention layer must be one of ['lambda', 'halo', 'bottleneck'], got {kind!r}")
    if kw:
        raise ValueError(f"{kind} self-attention does not take {sorted(kw)}")
    return layer


def _stem(spec: ByoaSpec, in_chans: int, act: type[nn.Module]) -> tuple[nn.Module, int, int, dict]:
    """(stem, channels, reduction, its map at stride 2 as timm's feature_info lists it)."""
    c = spec.stem_chs
    if spec.stem == "3x3":
        return ConvNormAct(in_chans, c, 3, stride=2, act=act), c, 2, {"module": "stem", "num_chs": c}
    chs, strides = (3 * c // 8, c // 2, c), (2, 1, 1 if spec.stem_pool else 2)
    stem, prev = nn.Sequential(), in_chans
    for i, (ch, s) in enumerate(zip(chs, strides)):
        stem.add_module(f"conv{i + 1}", ConvNormAct(prev, ch, 3, stride=s, act=act))
        prev = ch
    if spec.stem_pool:
        stem.add_module("pool", nn.MaxPool2d(3, 2, 1))
    tap = "conv3" if spec.stem_pool else "conv2"  # the last map before the second stride 2
    return stem, c, 4, {"module": f"stem.{tap}", "num_chs": c if spec.stem_pool else c // 2}


class ByoaNet(Backbone):
    """A :class:`ByoaSpec` made module (timm's module names: ``stem``, ``stages.i.j``, ``final_conv``).

    Args:
        spec: the architecture.
        num_classes, in_chans: classifier outputs (0: pooled features) and input channels.
        img_size: the input size (an int or ``(H, W)``) the global attention layers (BoTNet, ``r=None`` lambda)
            are sized for (default: the checkpoint's); smaller inputs also run.
        drop_rate: dropout before the classifier.
        drop_path_rate: stochastic depth, increasing linearly over the blocks.
        features_only: no head; ``forward`` returns the feature maps ``out_indices`` (timm's numbering and maps: 0
            the stem's at stride 2, 1..4 the stages', the last one through ``final_conv``); default 1..4.
        zero_init_last: zero the last BN gamma of every residual block.
    """

    final_conv_in_features = True  # timm's last feature map of these networks: through final_conv

    def __init__(
        self,
        spec: ByoaSpec,
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        img_size: int | Sequence[int] | None = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        features_only: bool = False,
        out_indices: int | Sequence[int] | None = None,
        zero_init_last: bool = True,
    ):
        super().__init__()
        check_number(drop_path_rate, "drop_path_rate", 0, 1, high_open=True)
        img = image_size(img_size, spec.pretrained.input_size)
        self.spec, self.img_size = spec, img
        act = cast("type[nn.Module]", get_act(spec.act, "act"))  # a name: never None
        self.stem, ch, reduction, stem_map = _stem(spec, in_chans, act)
        self.stem_split = 0 if spec.stem == "3x3" else int(stem_map["module"][-1])
        info = [{**stem_map, "stage": "stem", "reduction": 2}]
        # every stride rounds up (padded convolutions, the pools of the lambda layers)
        feat, total = (-(-img[0] // reduction), -(-img[1] // reduction)), sum(len(s.blocks) for s in spec.stages)
        k, stages = 0, []
        for i, stage in enumerate(spec.stages):
            blocks = []
            for j, letter in enumerate(stage.blocks):
                stride = stage.stride if j == 0 else 1
                mid = make_divisible((ch if spec.bottle_in else stage.channels) * stage.bottle_ratio)
                if letter == "a":
                    # the stage's self-attention, else the model's (a spec with "a" blocks has one)
                    spatial = self_attention_layer(
                        *cast("tuple[str, dict]", stage.self_attn or spec.self_attn), mid, stride, feat
                    )
                    gate = None
                else:
                    groups = mid // stage.group_size if stage.group_size else 1
                    spatial = ConvNormAct(mid, mid, 3, stride=stride, groups=groups, act=act)
                    gate = self._gate(spec, mid)
                blocks.append(
                    ByoaBlock(
                        ch,
                        stage.channels,
                        mid,
                        spatial,
                        attention=letter == "a",
                        stride=stride,
                        act=act,
                        gate=gate,
                        shortcut=spec.shortcut,
                        linear_out=spec.linear_out,
                        drop_path=drop_path_rate * k / max(1, total - 1),
                    )
                )
                ch, k = stage.channels, k + 1
                if stride > 1:
                    feat, reduction = (-(-feat[0] // stride), -(-feat[1] // stride)), reduction * stride
            stages.append(nn.Sequential(*blocks))
            info.append({"module": f"stages.{i}", "stage": f"c{i + 2}", "num_chs": ch, "reduction": reduction})
        self.stages = nn.Sequential(*stages)
        self.final_conv = ConvNormAct(ch, spec.num_features, 1, act=act) if spec.num_features else nn.Identity()
        ch = spec.num_features or ch
        info[-1].update(module="final_conv", num_chs=ch)  # timm's last map: through final_conv
        self._init_head(ch, num_classes, drop_rate, features_only, info=info, out_indices=out_indices)
        self._init_weights(zero_init_last)

    @staticmethod
    def _gate(spec: ByoaSpec, channels: int) -> nn.Module | None:
        if spec.channel_attn == "se":
            return SqueezeExcite(channels, rd_channels=make_divisible(channels * spec.se_ratio, round_limit=0.0))
        if spec.channel_attn == "eca":
            return EfficientChannelAttention(channels)
        return None

    def _init_weights(self, zero_init_last: bool) -> None:
        """He init (fan-out) for the trunk's convolutions, BN at identity; attention layers keep their own."""
        for m in self.modules():
            if isinstance(m, ConvNormAct):
                nn.init.kaiming_normal_(cast(nn.Conv2d, m.conv).weight, mode="fan_out", nonlinearity="relu")
        self._init_norms(ByoaBlock, zero_init_last)


BYOA_ARGS: dict[str, object] = {
    "img_size": None,
    "drop_rate": 0.0,
    "drop_path_rate": 0.0,
    "features_only": False,
    "out_indices": None,
    "zero_init_last": True,
}


def _create(variant: str, *, num_classes: int = 1000, in_chans: int = 3, **kwargs) -> ByoaNet:
    return ByoaNet(model_cfgs[variant], num_classes=num_classes, in_chans=in_chans, **kwargs)


def _paper(name: str) -> str:
    """The docstring and ``ModelInfo.paper`` of ``name``: its timm checkpoint."""
    p = model_cfgs[name].pretrained
    top1 = f"{p.top1}% top-1, " if p.top1 is not None else ""
    return f"timm ImageNet checkpoint {p.hub_id} ({top1}{p.input_size}px)"


def _info(name: str) -> ModelInfo:
    p = model_cfgs[name].pretrained
    return ModelInfo(name, p.input_size, _paper(name), pretrained=p)


_register = family_registrar(_info, BYOA_ARGS, doc=_paper)


@_register
def lambda_resnet26t(**kwargs) -> ByoaNet:
    return _create("lambda_resnet26t", **kwargs)


@_register
def lambda_resnet50ts(**kwargs) -> ByoaNet:
    return _create("lambda_resnet50ts", **kwargs)


@_register
def lambda_resnet26rpt_256(**kwargs) -> ByoaNet:
    return _create("lambda_resnet26rpt_256", **kwargs)


@_register
def halonet26t(**kwargs) -> ByoaNet:
    return _create("halonet26t", **kwargs)


@_register
def sehalonet33ts(**kwargs) -> ByoaNet:
    return _create("sehalonet33ts", **kwargs)


@_register
def halonet50ts(**kwargs) -> ByoaNet:
    return _create("halonet50ts", **kwargs)


@_register
def eca_halonext26ts(**kwargs) -> ByoaNet:
    return _create("eca_halonext26ts", **kwargs)


@_register
def haloregnetz_b(**kwargs) -> ByoaNet:
    return _create("haloregnetz_b", **kwargs)


@_register
def botnet26t_256(**kwargs) -> ByoaNet:
    return _create("botnet26t_256", **kwargs)


@_register
def sebotnet33ts_256(**kwargs) -> ByoaNet:
    return _create("sebotnet33ts_256", **kwargs)


@_register
def lamhalobotnet50ts_256(**kwargs) -> ByoaNet:
    return _create("lamhalobotnet50ts_256", **kwargs)


@_register
def halo2botnet50ts_256(**kwargs) -> ByoaNet:
    return _create("halo2botnet50ts_256", **kwargs)
