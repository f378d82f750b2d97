"""Bottleneck ResNets with any spatial layer: ResNet-v1, ResNet-RS, LambdaResNets, hybrids and HaloNets.

A model variant is data (:class:`ResNetConfig`): block counts, widths, stem, shortcut and which spatial
layer each block uses; the keyword arguments of the registered models (:class:`ResNetArgs`) adjust it and
:func:`build_resnet` builds it. The module (:class:`ResNet`) is a plain stack of :class:`Bottleneck` blocks:

    x -> conv1x1 (w) -> BN -> act -> spatial layer (w -> w rv, stride) -> BN -> act
      -> conv1x1 (w rb) -> BN (gamma = 0) [-> SE] -> drop path -> + shortcut -> act

with ``rb = 4`` (expansion) and ``rv = 1`` except in HaloNets. The spatial layer is a 3x3 convolution (``C``) or
any layer of :func:`lambdanet.layers.create_spatial_layer` (``L``), which also carries the stride as its paper
prescribes (strided conv, 3x3 average pool after a lambda layer, query subsampling in HaloNet attention, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import cast

from torch import Tensor, nn

from lambdanet.layers import (
    ConvLayer,
    DoubleAttention,
    RelativePositionEmbedding,
    SqueezeExcite,
    create_spatial_layer,
    list_spatial_layers,
)
from lambdanet.layers.conv_norm_act import ACTIVATIONS, conv_norm_act, get_act
from lambdanet.helpers import check_number
from lambdanet.layers.drop import DropPath
from lambdanet.models.base import Backbone, image_size, is_block_list

__all__ = [
    "ResNetConfig",
    "ResNetArgs",
    "RESNET_ARGS",
    "ResNet",
    "Bottleneck",
    "build_resnet",
    "stage_pattern",
    "STAGE_NAMES",
]

STAGE_NAMES = ("c2", "c3", "c4", "c5")


@dataclass(frozen=True)
class ResNetConfig:
    """A bottleneck ResNet as data.

    Attributes:
        layers: blocks per stage c2..c5.
        widths: bottleneck widths ``w`` per stage.
        expansion: block output = ``w * expansion`` (HaloNet ``rb``; 4 in ResNets).
        spatial_mult: spatial layer output = ``w * spatial_mult`` (HaloNet ``rv``; 1 in ResNets).
        stem: ``"resnet"`` (7x7/2 conv + 3x3/2 max pool), ``"rs"`` (ResNet-D 3x3 convs 32-32-64, the max
            pool replaced by a 3x3/2 conv: ResNet-RS), ``"cifar"`` (3x3/1 conv, no pool: small images).
        shortcut: ``"conv"`` (1x1/s conv) or ``"avg"`` (ResNet-D: 2x2 average pool, then 1x1 conv).
        pattern: per stage, one letter per block: ``C`` 3x3 convolution, ``L`` the ``spatial_layer``.
        spatial_layer: registry name used for the ``L`` blocks.
        stage_kwargs: per-stage keyword arguments for the ``L`` layers.
        se_ratio: squeeze-and-excitation ratio after the last 1x1 conv of ``C`` blocks (0: none).
        act: ``"relu"`` or ``"silu"``.
        final_conv: width of a 1x1 conv before pooling (HaloNet ``df``), or ``None``.
        input_size: default (square) image size; sizes the global spatial layers.
        nonlocal_blocks: ``{stage: (block, ...)}`` (1-indexed) after which a residual double-attention
            module (``c_m = c_n = C / 2``) is inserted, non-local-network style (A^2-Nets).
        paper: the table this configuration reproduces.
    """

    layers: tuple[int, int, int, int]
    widths: tuple[int, int, int, int] = (64, 128, 256, 512)
    expansion: float = 4.0
    spatial_mult: float = 1.0
    stem: str = "resnet"
    shortcut: str = "conv"
    pattern: tuple[str, str, str, str] | None = None
    spatial_layer: str = "lambda_conv"
    stage_kwargs: tuple[Mapping, Mapping, Mapping, Mapping] = ({}, {}, {}, {})
    se_ratio: float = 0.0
    act: str = "relu"
    final_conv: int | None = None
    input_size: int = 224
    nonlocal_blocks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    paper: str = ""

    def block_pattern(self) -> tuple[str, str, str, str]:
        return (
            self.pattern
            if self.pattern is not None
            else cast("tuple[str, str, str, str]", tuple("C" * n for n in self.layers))
        )


@dataclass(frozen=True)
class ResNetArgs:
    """The architecture keyword arguments of the ResNet-family entry points (ResNet-v1, ResNet-RS,
    LambdaResNets; HaloNets take a subset), declared once: :data:`RESNET_ARGS` is what ``create_model``
    validates against. ``None`` keeps the registered configuration's value.

    Attributes:
        stage_layers: Table 13 notation, one letter per stage c2..c5 (``"CCLL"``): ``C`` a 3x3 convolution,
            ``L`` the ``spatial_layer``.
        spatial_layer: any :func:`lambdanet.layers.list_spatial_layers` name for the ``L`` blocks (the
            configurations use ``lambda_conv``, the paper's 23x23-scope lambda layer).
        layer_kwargs: keyword arguments for every ``L`` layer (``dim_k``, ``heads``, ``dim_u``, ``r``, ``impl``).
        se: ``True`` (squeeze-and-excitation with ratio 1/16 after the last 1x1 conv of ``C`` blocks) or a ratio.
        stem: ``"resnet"``, ``"rs"`` or ``"cifar"`` (:class:`ResNetConfig`).
        base_width: bottleneck width ``w`` of c2; c3..c5 double it stage by stage (default 64).
        nonlocal_blocks: ``{stage: (block, ...)}``: residual double-attention modules (:class:`ResNetConfig`).
        img_size, drop_rate, drop_path_rate, features_only, out_indices, zero_init_last, share_embeddings: as in
            :class:`ResNet`.
    """

    stage_layers: str | None = None
    spatial_layer: str | None = None
    layer_kwargs: Mapping | None = None
    se: bool | float = False
    stem: str | None = None
    base_width: int | None = None
    nonlocal_blocks: Mapping | None = None
    img_size: int | Sequence[int] | None = None
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    features_only: bool = False
    out_indices: int | Sequence[int] | None = None
    zero_init_last: bool = True
    share_embeddings: bool = False


RESNET_ARGS: dict[str, object] = {f.name: f.default for f in fields(ResNetArgs)}


def stage_pattern(layers: Sequence[int], stage_layers: str) -> tuple[str, str, str, str]:
    """``"CCLL"`` (Table 13 notation, one letter per stage c2..c5) -> one letter per block."""
    if not isinstance(stage_layers, str) or len(stage_layers) != 4 or set(stage_layers.upper()) - {"C", "L"}:
        raise ValueError(
            f"stage_layers must be 4 letters C (3x3 conv) or L (the spatial_layer), one per stage "
            f"c2..c5, e.g. 'CCLL'; got {stage_layers!r}"
        )
    return cast("tuple[str, str, str, str]", tuple(letter * n for letter, n in zip(stage_layers.upper(), layers)))


# per stem: how many of its modules end at its feature map (timm's index 0) and that map's reduction
_STEM_MAP = {"resnet": (3, 2), "rs": (9, 2), "cifar": (3, 1)}


def _stem(kind: str, in_chans: int, act: type[nn.Module]) -> tuple[nn.Sequential, int, int]:
    """Returns (stem, out channels, reduction)."""

    def cba(cin, cout, k, s):  # flat: the stem's keys are indices
        return conv_norm_act(cin, cout, k, stride=s, act=act)

    if kind == "resnet":
        return nn.Sequential(*cba(in_chans, 64, 7, 2), nn.MaxPool2d(3, 2, 1)), 64, 4
    if kind == "rs":
        return (
            nn.Sequential(*cba(in_chans, 32, 3, 2), *cba(32, 32, 3, 1), *cba(32, 64, 3, 1), *cba(64, 64, 3, 2)),
            64,
            4,
        )
    if kind == "cifar":
        return nn.Sequential(*cba(in_chans, 64, 3, 1)), 64, 1
    raise ValueError(f"stem must be one of ['resnet', 'rs', 'cifar'], got {kind!r}")


class Bottleneck(nn.Module):
    """A bottleneck block with an arbitrary spatial layer (see module docstring)."""

    def __init__(
        self,
        in_ch: int,
        width: int,
        out_ch: int,
        spatial: nn.Module,
        spatial_ch: int,
        *,
        stride: int,
        shortcut: str,
        se_ratio: float,
        act: type[nn.Module],
        drop_path: float,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.spatial = spatial
        self.bn2 = nn.BatchNorm2d(spatial_ch)
        self.conv3 = nn.Conv2d(spatial_ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.se = SqueezeExcite(out_ch, rd_ratio=se_ratio) if se_ratio > 0 else nn.Identity()
        self.act = act(inplace=True)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            layers: list[nn.Module] = []
            if shortcut == "avg" and stride > 1:
                layers.append(nn.AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False))
                stride = 1
            layers += [nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)]
            self.shortcut = nn.Sequential(*layers)

    def zero_init_last(self) -> None:
        """App. A: the last BN's gamma starts at 0, so every block starts as the identity."""
        nn.init.zeros_(self.bn3.weight)

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.act(self.bn2(self.spatial(out)))
        out = self.se(self.bn3(self.conv3(out)))
        return self.act(self.drop_path(out) + self.shortcut(x))


def _check_args(
    cfg: ResNetConfig,
    img_size: int | Sequence[int] | None,
    drop_path_rate: float,
    share_embeddings: bool,
    layer_kwargs: Mapping | None = None,
) -> tuple[int, ...]:
    """:class:`ResNet`'s arguments checked (one-line ``ValueError``s); returns the input size ``(H, W)``."""
    _validate_config(cfg)
    check_number(drop_path_rate, "drop_path_rate", 0, 1, high_open=True)
    img = image_size(img_size, cfg.input_size)
    if layer_kwargs is not None and not isinstance(layer_kwargs, Mapping):
        raise ValueError(f"layer_kwargs must be a mapping of the spatial layers' options, got {layer_kwargs!r}")
    if (layer_kwargs or share_embeddings) and "L" not in "".join(cfg.block_pattern()):
        name = "layer_kwargs" if layer_kwargs else "share_embeddings"
        raise ValueError(
            f"{name} configures the spatial layers of the non-C stages, and this model has none (all blocks "
            f"are convolutions): also pass stage_layers, e.g. stage_layers='CCLL'"
        )
    if share_embeddings and cfg.spatial_layer not in ("lambda", "lambda_conv"):
        raise ValueError(
            f"share_embeddings needs lambda layers (spatial_layer 'lambda' or 'lambda_conv'), "
            f"got spatial_layer={cfg.spatial_layer!r}"
        )
    return img


class ResNet(Backbone):
    """A :class:`ResNetConfig` made module.

    Args:
        cfg: the architecture.
        num_classes: classifier outputs (0: ``forward`` returns pooled features).
        in_chans: input channels.
        img_size: input size (default ``cfg.input_size``); sizes the global spatial layers.
        drop_rate: dropout before the classifier.
        drop_path_rate: stochastic depth, linearly increasing from 0 to this rate over the blocks.
        layer_kwargs: keyword arguments for every ``L`` spatial layer (override ``cfg.stage_kwargs``).
        features_only: build no head; ``forward`` returns the feature maps ``out_indices``.
        out_indices: with ``features_only``, the maps ``forward`` returns in timm's numbering
            (:mod:`lambdanet.models.features`: 0 the stem's last map before its stride-2 pool or convolution,
            1..4 the stages c2..c5; an int ``n``: the last ``n``); default c2..c5.
        zero_init_last: zero the last BN gamma of every block (App. A).
        share_embeddings: lambda layers with the same scope share one position embedding (Table 4 "shared
            embeddings", App. A): one per (scope, depth) for local scopes, one per input size for global contexts.
    """

    def __init__(
        self,
        cfg: ResNetConfig,
        *,
        num_classes: int = 1000,
        in_chans: int = 3,
        img_size: int | Sequence[int] | None = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        layer_kwargs: Mapping | None = None,
        features_only: bool = False,
        out_indices: int | Sequence[int] | None = None,
        zero_init_last: bool = True,
        share_embeddings: bool = False,
    ):
        super().__init__()
        img = _check_args(cfg, img_size, drop_path_rate, share_embeddings, layer_kwargs)
        self.cfg, self.img_size = cfg, img
        act = cast("type[nn.Module]", get_act(cfg.act))  # a name (validated): never None
        self.stem, ch, reduction = _stem(cfg.stem, in_chans, act)
        self.stem_split, stem_reduction = _STEM_MAP[cfg.stem]
        info = [{"module": f"stem.{self.stem_split - 1}", "stage": "stem", "num_chs": ch, "reduction": stem_reduction}]
        size, total = tuple(math.ceil(s / reduction) for s in img), sum(cfg.layers)
        dpr = [drop_path_rate * i / max(1, total - 1) for i in range(total)]
        shared: dict[tuple, RelativePositionEmbedding] = {}
        stages, k = [], 0
        for i, (n, w, letters) in enumerate(zip(cfg.layers, cfg.widths, cfg.block_pattern())):
            out_ch, spatial_ch = int(w * cfg.expansion), int(w * cfg.spatial_mult)
            blocks: list[nn.Module] = []
            extra = set(cfg.nonlocal_blocks.get(STAGE_NAMES[i], ()))
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                if letters[j] == "C":
                    spatial = create_spatial_layer("conv", w, spatial_ch, stride=stride)
                else:
                    kwargs = {**cfg.stage_kwargs[i], **(layer_kwargs or {})}
                    if share_embeddings:
                        kwargs["embedding"] = _shared_embedding(shared, cfg.spatial_layer, kwargs, size)
                    feat = cast("tuple[int, int]", size)  # (H, W)
                    spatial = create_spatial_layer(
                        cfg.spatial_layer, w, spatial_ch, stride=stride, feat_size=feat, **kwargs
                    )
                se = cfg.se_ratio if letters[j] == "C" else 0.0
                blocks.append(
                    Bottleneck(
                        ch,
                        w,
                        out_ch,
                        spatial,
                        spatial_ch,
                        stride=stride,
                        shortcut=cfg.shortcut,
                        se_ratio=se,
                        act=act,
                        drop_path=dpr[k],
                    )
                )
                if j + 1 in extra:
                    blocks.append(DoubleAttention(out_ch))
                ch, k = out_ch, k + 1
                if stride == 2:
                    size, reduction = tuple(math.ceil(s / 2) for s in size), reduction * 2
            stages.append(nn.Sequential(*blocks))
            info.append({"module": f"stages.{i}", "stage": STAGE_NAMES[i], "num_chs": ch, "reduction": reduction})
        self.stages = nn.Sequential(*stages)
        self.final_conv: nn.Module = nn.Identity()
        if cfg.final_conv:
            self.final_conv = nn.Sequential(
                nn.Conv2d(ch, cfg.final_conv, 1, bias=False), nn.BatchNorm2d(cfg.final_conv), act(inplace=True)
            )
            ch = cfg.final_conv
        self._init_head(ch, num_classes, drop_rate, features_only, info=info, out_indices=out_indices)
        self._init_weights(zero_init_last)

    def _init_weights(self, zero_init_last: bool) -> None:
        """He init for the ResNet's own convolutions (stem, 1x1s, shortcuts, 3x3 ``C`` layers); attention and
        lambda layers keep the initialisation of their papers."""
        convs = [m for part in (self.stem, self.final_conv) for m in part.modules() if isinstance(m, nn.Conv2d)]
        for block in self.modules():
            if isinstance(block, Bottleneck):
                convs += [block.conv1, block.conv3]
                convs += [m for m in block.shortcut.modules() if isinstance(m, nn.Conv2d)]
                if isinstance(block.spatial, ConvLayer):
                    convs.append(block.spatial.conv)
        for conv in convs:
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        self._init_norms(Bottleneck, zero_init_last)


def _shared_embedding(shared: dict, layer: str, kwargs: Mapping, size: tuple[int, ...]) -> RelativePositionEmbedding:
    dim_k, dim_u = kwargs.get("dim_k", 16), kwargs.get("dim_u", 1)
    key = ("global", dim_k, dim_u, size) if layer == "lambda" else ("local", dim_k, dim_u, kwargs.get("r", 23))
    if key not in shared:
        shared[key] = (
            RelativePositionEmbedding.global_context(dim_k, size, dim_u=dim_u)
            if layer == "lambda"
            else RelativePositionEmbedding.local(dim_k, cast(int, key[3]), dim_u=dim_u)
        )
    return shared[key]


def _validate_config(cfg: ResNetConfig) -> None:
    if len(cfg.layers) != 4 or any(not isinstance(n, int) or n < 1 for n in cfg.layers):
        raise ValueError(f"layers must be 4 positive block counts (c2..c5), got {cfg.layers!r}")
    for i, (letters, n) in enumerate(zip(cfg.block_pattern(), cfg.layers)):
        if len(letters) != n or set(letters) - {"C", "L"}:
            raise ValueError(f"pattern of stage {STAGE_NAMES[i]} must be {n} letters C/L, got {letters!r}")
    if cfg.spatial_layer not in list_spatial_layers():
        raise ValueError(f"spatial_layer must be one of {list_spatial_layers()}, got {cfg.spatial_layer!r}")
    if cfg.act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {list(ACTIVATIONS)}, got {cfg.act!r}")
    if cfg.shortcut not in ("conv", "avg"):
        raise ValueError(f"shortcut must be one of ['conv', 'avg'], got {cfg.shortcut!r}")
    for stage, blocks in cfg.nonlocal_blocks.items():
        if stage not in STAGE_NAMES:
            raise ValueError(f"nonlocal_blocks keys must be among {list(STAGE_NAMES)}, got {stage!r}")
        n = cfg.layers[STAGE_NAMES.index(stage)]
        if not is_block_list(blocks) or any(not 1 <= b <= n for b in blocks):
            raise ValueError(f"nonlocal_blocks[{stage!r}] must be 1-indexed blocks in 1..{n}, got {blocks}")


def build_resnet(
    cfg: ResNetConfig, args: ResNetArgs = ResNetArgs(), *, num_classes: int = 1000, in_chans: int = 3
) -> ResNet:
    """Apply the keyword arguments ``args`` to the configuration ``cfg`` and build the module."""
    changes: dict = {}
    if args.stage_layers is not None:
        changes["pattern"] = stage_pattern(cfg.layers, args.stage_layers)
        changes["stage_kwargs"] = ({}, {}, {}, {})
    if args.spatial_layer is not None:
        changes["spatial_layer"] = args.spatial_layer
        if args.stage_layers is None and cfg.pattern is None:
            raise ValueError(
                "spatial_layer selects the layer of the non-C stages: also pass stage_layers, e.g. stage_layers='LLLL'"
            )
        changes["stage_kwargs"] = ({}, {}, {}, {})
    if args.se:
        ratio = args.se
        if ratio is not True and (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1):
            raise ValueError(f"se must be True, False or a reduction ratio in (0, 1], got {ratio!r}")
        changes["se_ratio"] = 1 / 16 if ratio is True else float(ratio)
    if args.stem is not None:
        changes["stem"] = args.stem
    if args.base_width is not None:
        if not isinstance(args.base_width, int) or args.base_width <= 0:
            raise ValueError(f"base_width must be a positive int, got {args.base_width!r}")
        changes["widths"] = tuple(args.base_width * 2**i for i in range(4))
    if args.nonlocal_blocks is not None:
        if not isinstance(args.nonlocal_blocks, Mapping):
            raise ValueError(f"nonlocal_blocks must be a mapping {{stage: (block, ...)}}, got {args.nonlocal_blocks!r}")
        changes["nonlocal_blocks"] = dict(args.nonlocal_blocks)
    return ResNet(
        replace(cfg, **changes),
        num_classes=num_classes,
        in_chans=in_chans,
        img_size=args.img_size,
        drop_rate=args.drop_rate,
        drop_path_rate=args.drop_path_rate,
        layer_kwargs=args.layer_kwargs,
        features_only=args.features_only,
        out_indices=args.out_indices,
        zero_init_last=args.zero_init_last,
        share_embeddings=args.share_embeddings,
    )
