"""HaloNet H0-H7 (Vaswani et al. 2021, Table 2 and Table A2) as configurations of the bottleneck ResNet.

Block of stage ``i`` (base width ``w = 64, 128, 256, 512``): ``1x1 (w) -> halo attention (b, h), w rv ->
1x1, w rb``; 7x7/2 stem with max pool; SiLU; a final ``1x1, df`` conv for H3-H7; heads ``(4, 8, 8, 8)``;
query and key projections ``w -> w``, values ``w -> w rv`` (HaloNet App. A: three linear maps, relative
embeddings factorised over height and width with half a head's channels each, shared by the heads).
Downsampling subsamples the queries inside the attention (HaloNet Fig. 2). No squeeze-and-excitation:
the paper's H0-H7 use label smoothing, SiLU and RandAugment but not SE (Sec. 4.2.1).

Parameter counts (1000 classes) against Table A2: H0 5.49M (5.5), H1 8.08 (8.1), H2 9.38 (9.4),
H4 19.08 (19.1), H5 30.68 (30.7), H6 43.42 (43.4), H7 67.39 (67). H3 is 11.82M against 12.3M (-3.9%) with
the row's values. One entry changed at a time, ``df = 1280`` (H4's value) gives 12.27M and ``l3 = 13``
12.21M, but 68 layers where the row says 65 (``3 (9 + l3) + 2``, which fixes ``l3 = 12``); ``rb = 1.75``
(12.87M), ``rv = 1.25`` (12.84M) and ``df = 1536`` (12.72M) overshoot. ``df = 1280`` may be what the authors
trained, but the table says 1024, and we keep the table's values.

Each :data:`model_cfgs` row (:class:`HaloNetSpec`) has an entry point of its name taking :data:`HALONET_ARGS`.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from lambdanet.models.family import family_registrar
from lambdanet.models.registry import ModelInfo
from lambdanet.models.resnet import RESNET_ARGS, ResNet, ResNetArgs, ResNetConfig, build_resnet

__all__ = ["HaloNetSpec", "model_cfgs", "halonet_config", "HALONET_ARGS"]


class HaloNetSpec(NamedTuple):
    """One row of HaloNet Table A2, and the RandAugment magnitude of App. C.3."""

    b: int  # query block size
    h: int  # halo size
    rv: float  # attention output width multiplier
    rb: float  # bottleneck output width multiplier
    l3: int  # blocks in the third group (c4)
    s: int  # image size
    df: int | None  # final 1x1 conv width (None: no final conv)
    params_m: float  # parameters (M) reported by Table A2
    randaugment_magnitude: int


# by registered name: HaloNet Table A2 (b, h, rv, rb, l3, s, df, params_m), App. C.3 RandAugment magnitude
model_cfgs: dict[str, HaloNetSpec] = {
    "halonet_h0": HaloNetSpec(8, 3, 1.0, 0.5, 7, 256, None, 5.5, 6),
    "halonet_h1": HaloNetSpec(8, 3, 1.0, 1.0, 10, 256, None, 8.1, 8),
    "halonet_h2": HaloNetSpec(8, 3, 1.0, 1.25, 11, 256, None, 9.4, 10),
    "halonet_h3": HaloNetSpec(10, 3, 1.0, 1.5, 12, 320, 1024, 12.3, 14),
    "halonet_h4": HaloNetSpec(12, 2, 1.0, 3.0, 12, 384, 1280, 19.1, 17),
    "halonet_h5": HaloNetSpec(14, 2, 2.5, 2.0, 23, 448, 1536, 30.7, 19),
    "halonet_h6": HaloNetSpec(8, 4, 3.0, 2.75, 24, 512, 1536, 43.4, 24),
    "halonet_h7": HaloNetSpec(10, 3, 4.0, 3.5, 26, 600, 2048, 67.0, 31),
}
HEADS = (4, 8, 8, 8)  # per stage c2..c5 (Table A2 caption)

# the ResNet keyword arguments a HaloNet takes (its blocks, stem and widths are the table's)
HALONET_ARGS = {
    k: RESNET_ARGS[k]
    for k in (
        "img_size",
        "drop_rate",
        "drop_path_rate",
        "features_only",
        "out_indices",
        "layer_kwargs",
        "zero_init_last",
    )
}
# HaloNet Sec. 4.1 and App. C.3 (the RandAugment magnitude and image size are per model)
RECIPE = {
    "epochs": 350,
    "optimizer": "sgd",
    "nesterov": True,
    "lr": 1.6,
    "batch_size": 4096,
    "warmup_epochs": 10,
    "weight_decay": 2e-5,
    "label_smoothing": 0.1,
}


def halonet_config(name: str, *, base_width: int = 64, **changes) -> ResNetConfig:
    """The bottleneck ResNet of the Table A2 row ``model_cfgs[name]`` (see the module docstring).

    Args:
        name: a key of :data:`model_cfgs`.
        base_width: ``w`` of c2 (c3..c5 double it); the paper's models use 64, smaller ones are for fast tests.
        **changes: Table A2 entries to replace (``df=1280``), for ablations of the table.
    """
    b, h, rv, rb, l3, s, df, params_m, _ = model_cfgs[name]._replace(**changes)
    widths = tuple(base_width * 2**i for i in range(4))
    stage_kwargs = cast(
        "tuple[dict, dict, dict, dict]",  # one per stage: HEADS has 4 entries
        tuple({"block_size": b, "halo_size": h, "heads": heads, "dim_qk": w} for heads, w in zip(HEADS, widths)),
    )
    return ResNetConfig(
        (3, 3, l3, 3),
        widths=widths,
        expansion=rb,
        spatial_mult=rv,
        stem="resnet",
        shortcut="conv",
        pattern=("L" * 3, "L" * 3, "L" * l3, "L" * 3),
        spatial_layer="halo_attention",
        stage_kwargs=stage_kwargs,
        act="silu",
        final_conv=df,
        input_size=s,
        paper=f"HaloNet-{name.removeprefix('halonet_').upper()}: Table A2 (b={b}, h={h}, rv={rv}, rb={rb}, l3={l3}, "
        f"s={s}, df={df}), {params_m}M parameters",
    )


def _create(variant: str, *, num_classes: int = 1000, in_chans: int = 3, **kwargs) -> ResNet:
    """Build ``model_cfgs[variant]`` with the keyword arguments of :data:`HALONET_ARGS`."""
    return build_resnet(halonet_config(variant), ResNetArgs(**kwargs), num_classes=num_classes, in_chans=in_chans)


def _info(name: str) -> ModelInfo:
    """The metadata of the ``model_cfgs`` entry ``name``."""
    spec = model_cfgs[name]
    recipe = {**RECIPE, "randaugment_magnitude": spec.randaugment_magnitude, "img_size": spec.s}
    return ModelInfo(name, spec.s, "HaloNet Table A2", recipe, recipe_source="HaloNet Sec. 4.1 and App. C.3")


def _doc(name: str) -> str:
    return halonet_config(name).paper


_register = family_registrar(_info, HALONET_ARGS, doc=_doc)


@_register
def halonet_h0(**kwargs) -> ResNet:
    return _create("halonet_h0", **kwargs)


@_register
def halonet_h1(**kwargs) -> ResNet:
    return _create("halonet_h1", **kwargs)


@_register
def halonet_h2(**kwargs) -> ResNet:
    return _create("halonet_h2", **kwargs)


@_register
def halonet_h3(**kwargs) -> ResNet:
    return _create("halonet_h3", **kwargs)


@_register
def halonet_h4(**kwargs) -> ResNet:
    return _create("halonet_h4", **kwargs)


@_register
def halonet_h5(**kwargs) -> ResNet:
    return _create("halonet_h5", **kwargs)


@_register
def halonet_h6(**kwargs) -> ResNet:
    return _create("halonet_h6", **kwargs)


@_register
def halonet_h7(**kwargs) -> ResNet:
    return _create("halonet_h7", **kwargs)
