"""The architectures of timm's "bring your own attention" networks as data (:mod:`lambdanet.models.byoa` builds
them): :class:`ByoaStage` and :class:`ByoaSpec`, the twelve entries of :data:`model_cfgs` under timm's names,
and each checkpoint's :class:`~lambdanet.models.registry.PretrainedCfg` (:func:`timm_weights`)."""

from __future__ import annotations

from dataclasses import dataclass

from lambdanet.models.registry import PretrainedCfg

__all__ = ["ByoaStage", "ByoaSpec", "timm_weights", "model_cfgs"]


def timm_weights(
    hub_id: str,
    top1: float | None,
    *,
    input_size: int = 256,
    crop_pct: float = 0.95,
    interpolation: str = "bicubic",
    **kwargs,
) -> PretrainedCfg:
    """The :class:`PretrainedCfg` of a timm checkpoint: ``hub_id``, its reported ImageNet top-1 (%, ``None``
    when our sources do not state it) and its evaluation preprocessing (timm's defaults for this family)."""
    return PretrainedCfg(input_size, crop_pct, interpolation, hub_id=hub_id, top1=top1, **kwargs)


@dataclass(frozen=True)
class ByoaStage:
    """One stage: its blocks (``"b"`` convolution, ``"a"`` self-attention), output channels, first-block stride,
    3x3 group size (0: dense), bottleneck ratio, and a ``(kind, kwargs)`` self-attention overriding the model's."""

    blocks: str
    channels: int
    stride: int = 2
    group_size: int = 0
    bottle_ratio: float = 0.25
    self_attn: tuple[str, dict] | None = None


@dataclass(frozen=True)
class ByoaSpec:
    """A network: stem, stages, the self-attention layer (``"lambda"``, ``"halo"`` or ``"bottleneck"``
    with its keyword arguments, timm's names), the channel gate of convolution blocks, and its checkpoint."""

    stages: tuple[ByoaStage, ByoaStage, ByoaStage, ByoaStage]
    pretrained: PretrainedCfg
    self_attn: tuple[str, dict] | None = None
    stem: str = "tiered"  # "tiered": 3x3 convs of 3/8, 1/2 and 1 x stem_chs; "3x3": one conv
    stem_chs: int = 64
    stem_pool: bool = True  # 3x3 max pool (else the last tiered conv has stride 2)
    act: str = "relu"
    num_features: int = 0  # a final 1x1 conv to this width (0: none)
    channel_attn: str | None = None  # "se" | "eca" after the 3x3 of convolution blocks
    se_ratio: float = 1 / 16
    shortcut: str = "conv1x1"  # projection of blocks that change the shape; "": no residual there
    bottle_in: bool = False  # bottleneck width from the block's input (RegNetZ) instead of its output
    linear_out: bool = False  # no activation after the residual sum (RegNetZ)
    fixed_input_size: bool = False  # global attention sized for one input size


model_cfgs: dict[str, ByoaSpec] = {
    "lambda_resnet26t": ByoaSpec(
        stages=(ByoaStage("bb", 256, 1), ByoaStage("bb", 512), ByoaStage("ba", 1024), ByoaStage("aa", 2048)),
        self_attn=("lambda", {"r": 9}),
        pretrained=timm_weights("timm/lambda_resnet26t.c1_in1k", 79.1, crop_pct=0.94),
    ),
    "lambda_resnet50ts": ByoaSpec(
        stages=(ByoaStage("bbb", 256, 1), ByoaStage("bbba", 512), ByoaStage("bababa", 1024), ByoaStage("bab", 2048)),
        self_attn=("lambda", {"r": 9}),
        act="silu",
        pretrained=timm_weights("timm/lambda_resnet50ts.a1h_in1k", 81.2, crop_pct=0.95),
    ),
    "lambda_resnet26rpt_256": ByoaSpec(
        stages=(ByoaStage("bb", 256, 1), ByoaStage("bb", 512), ByoaStage("ba", 1024), ByoaStage("aa", 2048)),
        self_attn=("lambda", {"r": None}),
        fixed_input_size=True,
        pretrained=timm_weights("timm/lambda_resnet26rpt_256.c1_in1k", 79.0, crop_pct=0.94),
    ),
    "halonet26t": ByoaSpec(
        stages=(ByoaStage("bb", 256, 1), ByoaStage("bb", 512), ByoaStage("ba", 1024), ByoaStage("aa", 2048)),
        self_attn=("halo", {"block_size": 8, "halo_size": 2}),
        pretrained=timm_weights("timm/halonet26t.a1h_in1k", 79.1, crop_pct=0.95),
    ),
    "sehalonet33ts": ByoaSpec(
        stages=(
            ByoaStage("bb", 256, 1),
            ByoaStage("bba", 512),
            ByoaStage("bba", 1024),
            ByoaStage("aa", 1536, bottle_ratio=0.333),
        ),
        self_attn=("halo", {"block_size": 8, "halo_size": 3}),
        stem_pool=False,
        act="silu",
        num_features=1280,
        channel_attn="se",
        pretrained=timm_weights("timm/sehalonet33ts.ra2_in1k", 81.0, crop_pct=0.94),
    ),
    "halonet50ts": ByoaSpec(
        stages=(
            ByoaStage("bbb", 256, 1),
            ByoaStage("bbba", 512, self_attn=("halo", {"block_size": 8, "halo_size": 3, "num_heads": 4})),
            ByoaStage("bababa", 1024),
            ByoaStage("bab", 2048),
        ),
        self_attn=("halo", {"block_size": 8, "halo_size": 3}),
        act="silu",
        pretrained=timm_weights("timm/halonet50ts.a1h_in1k", 81.6, crop_pct=0.94),
    ),
    "eca_halonext26ts": ByoaSpec(
        stages=(
            ByoaStage("bb", 256, 1, 16),
            ByoaStage("bb", 512, 2, 16),
            ByoaStage("ba", 1024, 2, 16),
            ByoaStage("aa", 2048, 2, 16),
        ),
        self_attn=("halo", {"block_size": 8, "halo_size": 2, "dim_head": 16}),
        act="silu",
        channel_attn="eca",
        pretrained=timm_weights("timm/eca_halonext26ts.c1_in1k", 79.5, crop_pct=0.94),
    ),
    "haloregnetz_b": ByoaSpec(
        stages=(
            ByoaStage("bb", 48, 2, 16, 3),
            ByoaStage("bbbbbb", 96, 2, 16, 3),
            ByoaStage("bbbabbbabbba", 192, 2, 16, 3),
            ByoaStage("aa", 288, 2, 16, 3),
        ),
        self_attn=("halo", {"block_size": 7, "halo_size": 2, "qk_ratio": 0.33}),
        stem="3x3",
        stem_chs=32,
        stem_pool=False,
        act="silu",
        num_features=1536,
        channel_attn="se",
        se_ratio=0.25,
        shortcut="",
        bottle_in=True,
        linear_out=True,
        pretrained=timm_weights(
            "timm/haloregnetz_b.ra3_in1k",
            81.1,
            input_size=224,
            crop_pct=0.94,
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
        ),
    ),
    "botnet26t_256": ByoaSpec(
        stages=(ByoaStage("bb", 256, 1), ByoaStage("bb", 512), ByoaStage("ba", 1024), ByoaStage("aa", 2048)),
        self_attn=("bottleneck", {}),
        fixed_input_size=True,
        pretrained=timm_weights("timm/botnet26t_256.c1_in1k", None, crop_pct=0.95),
    ),
    "sebotnet33ts_256": ByoaSpec(
        stages=(
            ByoaStage("bb", 256, 1),
            ByoaStage("bba", 512),
            ByoaStage("bba", 1024),
            ByoaStage("aa", 1536, bottle_ratio=0.333),
        ),
        self_attn=("bottleneck", {}),
        stem_pool=False,
        act="silu",
        num_features=1280,
        channel_attn="se",
        fixed_input_size=True,
        pretrained=timm_weights("timm/sebotnet33ts_256.a1h_in1k", None, crop_pct=0.94),
    ),
    "lamhalobotnet50ts_256": ByoaSpec(
        stages=(
            ByoaStage("bbb", 256, 1),
            ByoaStage("baba", 512, self_attn=("lambda", {"r": 13})),
            ByoaStage("bababa", 1024, self_attn=("halo", {"halo_size": 3})),
            ByoaStage("bab", 2048, self_attn=("bottleneck", {})),
        ),
        stem_pool=False,
        act="silu",
        fixed_input_size=True,
        pretrained=timm_weights("timm/lamhalobotnet50ts_256.a1h_in1k", 81.6, crop_pct=0.95),
    ),
    "halo2botnet50ts_256": ByoaSpec(
        stages=(
            ByoaStage("bbb", 256, 1),
            ByoaStage("baba", 512, self_attn=("halo", {"halo_size": 3})),
            ByoaStage("bababa", 1024, self_attn=("halo", {"halo_size": 3})),
            ByoaStage("bab", 2048, self_attn=("bottleneck", {})),
        ),
        stem_pool=False,
        act="silu",
        fixed_input_size=True,
        pretrained=timm_weights("timm/halo2botnet50ts_256.a1h_in1k", 82.1, crop_pct=0.95),
    ),
}
