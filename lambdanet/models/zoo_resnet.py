"""ResNet-v1, ResNet-RS and LambdaResNet families, declared as data.

Each model is one entry of :data:`model_cfgs` (its :class:`ResNetConfig` and metadata) and an entry point of
the same name at the end of this file, as in timm; every entry point takes the keyword arguments of
:class:`lambdanet.models.ResNetArgs`. Sources: block counts of ResNet-v1 from He et al. 2016; ResNet-RS and
LambdaResNet block counts and lambda placement from LambdaNetworks Table 18; image sizes and
regularisation from Tables 19-20 (:data:`TABLE20_REGULARIZATION`).

**LambdaResNet lambda layers.** App. E.1 says all lambda layers use ``k=16, h=4, u=1`` with a 23x23
scope, and that ``u > 1`` switches to the convolution with a 7x7 scope. The parameter counts of
Tables 14-15 settle which: only c5 lambdas with ``u=4`` (7x7) and c4 lambdas with ``u=1`` (23x23)
reproduce LambdaResNet-101 (36.9M: ours 36.9M) together with -101-C4 (26.0M: ours 26.0M); the same
rule gives -152 51.4M (ours 50.9M) and -152-C4 35.1M (ours 34.6M). With ``u=1`` everywhere -101 would be
36.2M and -152-C4 33.9M; with ``u=4`` everywhere -101-C4 would be 27.3M. LambdaResNet-200-C4 (Table 15:
42M) is 39.1M under that rule but 41.1M with ``u=4`` (7x7) in c4 too, so that model uses ``u=4`` in c4.
LambdaResNet-270-C4 uses a 7x7 scope in c4 (Table 16). No squeeze-and-excitation in LambdaResNets:
App. E.1 rules it out for lambda blocks, and Table 14's counts leave no room for it in conv blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from lambdanet.models.family import family_registrar
from lambdanet.models.registry import ModelInfo
from lambdanet.models.resnet import RESNET_ARGS, ResNet, ResNetArgs, ResNetConfig, build_resnet, stage_pattern

__all__ = [
    "RESNET_LAYERS",
    "RESNET_RS_LAYERS",
    "LAMBDA_C4_BLOCKS",
    "TABLE20_REGULARIZATION",
    "Table20Row",
    "ZooModel",
    "model_cfgs",
    "lambda_resnet_pattern",
    "table20_recipe",
]

# He et al. 2016 (and a compact 26-layer variant for small data)
RESNET_LAYERS = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}

# LambdaNetworks Table 18 (block allocations of Bello et al. 2021)
RESNET_RS_LAYERS = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
    270: (4, 29, 53, 4),
    350: (4, 36, 72, 4),
    420: (4, 44, 87, 4),
}

# LambdaNetworks Table 18: lambda layers in c4 (1-indexed blocks); every c5 block is a lambda layer
LAMBDA_C4_BLOCKS = {
    50: (3,),
    101: (6, 12, 18),
    152: (5, 10, 15, 20, 25, 30),
    200: (5, 10, 15, 20, 25, 30),
    270: (8, 16, 24, 32, 40, 48),
    350: (10, 20, 30, 40, 50, 60),
    420: (10, 20, 30, 40, 50, 60, 70, 80),
}


class Table20Row(NamedTuple):
    """One row of LambdaNetworks Table 20 (350 epochs, RandAugment with 2 layers); Table 19 has its accuracy."""

    img_size: int
    randaugment_magnitude: int
    drop_rate: float  # dropout before the classifier
    drop_path_rate: float  # stochastic depth


# LambdaNetworks Table 20, per depth
TABLE20_REGULARIZATION: dict[int, tuple[Table20Row, ...]] = {
    50: (Table20Row(128, 10, 0.2, 0.0), Table20Row(160, 10, 0.2, 0.0)),
    101: (Table20Row(160, 10, 0.3, 0.0), Table20Row(192, 15, 0.2, 0.0)),
    152: (
        Table20Row(192, 15, 0.3, 0.0),
        Table20Row(224, 15, 0.3, 0.1),
        Table20Row(256, 15, 0.3, 0.1),
        Table20Row(288, 15, 0.3, 0.1),
    ),
    270: (Table20Row(256, 15, 0.3, 0.1),),
    350: (Table20Row(256, 15, 0.3, 0.2), Table20Row(288, 15, 0.3, 0.2), Table20Row(320, 15, 0.3, 0.2)),
    420: (Table20Row(320, 15, 0.3, 0.2),),
}
# default image sizes: Table 14 (101: 224, 152: 256), Table 15 (200: 320), Table 16 (270: 256), else Table 19
DEFAULT_SIZE = {26: 224, 50: 160, 101: 224, 152: 256, 200: 320, 270: 256, 350: 320, 420: 320}

C4_LAMBDA = {"dim_k": 16, "heads": 4, "dim_u": 1, "r": 23}
C5_LAMBDA = {"dim_k": 16, "heads": 4, "dim_u": 4, "r": 7}


def lambda_resnet_pattern(layers: Sequence[int], c4_blocks: Sequence[int] | str) -> tuple[str, str, str, str]:
    """Table 18 placement: conv in c2-c3, lambda at ``c4_blocks`` (1-indexed, or ``"all"``), lambda in c5."""
    c4 = (
        "L" * layers[2] if c4_blocks == "all" else "".join("L" if j + 1 in c4_blocks else "C" for j in range(layers[2]))
    )
    return ("C" * layers[0], "C" * layers[1], c4, "L" * layers[3])


def table20_recipe(depth: int, img_size: int) -> tuple[dict, str]:
    """The 350-epoch recipe of a ResNet-RS / LambdaResNet as ``TrainConfig`` fields, and its source: the Table 20
    row of ``depth`` (else the nearest listed depth) with the largest image size up to ``img_size`` (its size)."""
    listed = depth in TABLE20_REGULARIZATION
    rows = TABLE20_REGULARIZATION[depth if listed else min(TABLE20_REGULARIZATION, key=lambda d: abs(d - depth))]
    row = max(rows, key=lambda r: r.img_size if r.img_size <= img_size else -1)
    source = "LambdaNetworks App. E.2, Tables 19-20" + ("" if listed else ", nearest depth (not listed for this depth)")
    return {
        "epochs": 350,
        "img_size": row.img_size,
        "randaugment_layers": 2,
        "randaugment_magnitude": row.randaugment_magnitude,
        "drop_rate": row.drop_rate,
        "drop_path_rate": row.drop_path_rate,
        "weight_decay": 4e-5,
    }, source


class ZooModel(NamedTuple):
    """One entry of :data:`model_cfgs`: the architecture and what :func:`model_info` reports for it."""

    cfg: ResNetConfig
    paper: str  # the tables its parameter count is checked against (ModelInfo.paper)
    recipe: Mapping  # the paper's training recipe as TrainConfig fields (ModelInfo.recipe)
    recipe_source: str
    small: bool = False  # fast enough for CPU tests at full width


def _resnet_v1(depth: int, *, small: bool = False) -> ZooModel:
    paper_row = depth == 50  # only ResNet-50 is a row of LambdaNetworks Tables 3, 9 and 13
    tables = "; LambdaNetworks Tables 3, 9, 13" if paper_row else ""
    cfg = ResNetConfig(
        RESNET_LAYERS[depth],
        input_size=224,
        paper=f"ResNet-{depth} v1 (He et al. 2016; stride on the 3x3 conv){tables}",
    )
    return ZooModel(
        cfg,
        "He et al. 2016" + ("; LambdaNetworks Table 3" if paper_row else ""),
        {"epochs": 90},
        "LambdaNetworks App. E.2, 90-epoch setup",
        small,
    )


def _resnet_rs(depth: int, *, se: bool = False) -> ZooModel:
    listed = depth in TABLE14_DEPTHS  # Table 14 lists ResNet-RS-101 and -152; Table 18 gives every depth's blocks
    cfg = ResNetConfig(
        RESNET_RS_LAYERS[depth],
        stem="rs",
        shortcut="avg",
        se_ratio=0.25 if se else 0.0,
        input_size=DEFAULT_SIZE[depth],
        paper=f"ResNet-RS-{depth} {'w/' if se else 'wo/'} SE (Bello et al. 2021): ResNet-D stem and "
        "shortcut, max pool replaced by a strided 3x3 conv, SE ratio 0.25; LambdaNetworks "
        + ("Table 14" if listed else "Table 18 blocks"),
    )
    return ZooModel(
        cfg,
        "LambdaNetworks " + ("Table 14, Table 18 blocks" if listed else "Table 18 blocks"),
        *table20_recipe(depth, DEFAULT_SIZE[depth]),
    )


def _lambda_resnet(depth: int) -> ZooModel:
    layers = RESNET_RS_LAYERS[depth]
    pattern = lambda_resnet_pattern(layers, LAMBDA_C4_BLOCKS[depth])
    cfg = ResNetConfig(
        layers,
        stem="rs",
        shortcut="avg",
        pattern=pattern,
        stage_kwargs=({}, {}, C4_LAMBDA, C5_LAMBDA),
        input_size=DEFAULT_SIZE[depth],
        paper=f"LambdaResNet-{depth}: Table 18 ({'-'.join(map(str, layers))}, lambda in c4 blocks "
        f"{LAMBDA_C4_BLOCKS[depth]} and all of c5)",
    )
    # Table 14 has the parameter counts of -101 and -152; Tables 19-20 list every depth but 200
    tables = ("Table 14, " if depth in TABLE14_DEPTHS else "") + (
        "Tables 18-20" if depth in TABLE20_REGULARIZATION else "Table 18"
    )
    return ZooModel(cfg, f"LambdaNetworks {tables}", *table20_recipe(depth, DEFAULT_SIZE[depth]))


def _lambda_resnet_c4(depth: int, c4_lambda: Mapping) -> ZooModel:
    layers = RESNET_RS_LAYERS[depth]
    cfg = ResNetConfig(
        layers,
        stem="rs",
        shortcut="avg",
        pattern=lambda_resnet_pattern(layers, "all"),
        stage_kwargs=({}, {}, c4_lambda, C5_LAMBDA),
        input_size=DEFAULT_SIZE[depth],
        paper=f"LambdaResNet-{depth}-C4: every c4 and c5 block a lambda layer ({C4_TABLES[depth]})",
    )
    return ZooModel(cfg, f"LambdaNetworks {C4_TABLES[depth]}", *table20_recipe(depth, DEFAULT_SIZE[depth]))


# the depths whose ResNet-RS and LambdaResNet rows (parameter counts) are in Table 14
TABLE14_DEPTHS = (101, 152)
# the tables that list each LambdaResNet-C4
C4_TABLES = {101: "Table 14", 152: "Tables 14-15", 200: "Table 15", 270: "Table 16"}


# Every ResNet-family model, by registered name (each has an entry point of that name below).
model_cfgs: dict[str, ZooModel] = {
    # ResNet-v1 (He et al. 2016): LambdaNetworks Tables 3, 9, 13; resnet26 is a compact variant for small data
    "resnet26": _resnet_v1(26, small=True),
    "resnet50": _resnet_v1(50),
    "resnet101": _resnet_v1(101),
    "resnet152": _resnet_v1(152),
    # ResNet-RS (Bello et al. 2021) without and with squeeze-and-excitation: Table 14, Table 18 blocks
    "resnet_rs50": _resnet_rs(50),
    "resnet_rs50_se": _resnet_rs(50, se=True),
    "resnet_rs101": _resnet_rs(101),
    "resnet_rs101_se": _resnet_rs(101, se=True),
    "resnet_rs152": _resnet_rs(152),
    "resnet_rs152_se": _resnet_rs(152, se=True),
    "resnet_rs200": _resnet_rs(200),
    "resnet_rs200_se": _resnet_rs(200, se=True),
    "resnet_rs270": _resnet_rs(270),
    "resnet_rs270_se": _resnet_rs(270, se=True),
    "resnet_rs350": _resnet_rs(350),
    "resnet_rs350_se": _resnet_rs(350, se=True),
    "resnet_rs420": _resnet_rs(420),
    "resnet_rs420_se": _resnet_rs(420, se=True),
    # LambdaResNets: Table 18 blocks and lambda placement, Table 14 parameter counts, Tables 19-20 recipes
    "lambda_resnet50": _lambda_resnet(50),
    "lambda_resnet101": _lambda_resnet(101),
    "lambda_resnet152": _lambda_resnet(152),
    "lambda_resnet200": _lambda_resnet(200),
    "lambda_resnet270": _lambda_resnet(270),
    "lambda_resnet350": _lambda_resnet(350),
    "lambda_resnet420": _lambda_resnet(420),
    # LambdaResNet-C4: Tables 14-16, c4 lambdas as argued in the module docstring
    "lambda_resnet101_c4": _lambda_resnet_c4(101, C4_LAMBDA),
    "lambda_resnet152_c4": _lambda_resnet_c4(152, C4_LAMBDA),
    "lambda_resnet200_c4": _lambda_resnet_c4(200, C5_LAMBDA),
    "lambda_resnet270_c4": _lambda_resnet_c4(270, {**C4_LAMBDA, "r": 7}),
    # compact hybrid for small data, CPU runs and tests: the Table 13 C-C-L-L hybrid at 26 layers
    "lambda_resnet26": ZooModel(
        ResNetConfig(
            RESNET_LAYERS[26],
            pattern=stage_pattern(RESNET_LAYERS[26], "CCLL"),
            stage_kwargs=({}, {}, C4_LAMBDA, C4_LAMBDA),
            input_size=224,
            paper="compact LambdaResNet-26: [2-2-2-2] blocks, lambda layers in c4 and c5 (the Table 13 "
            "C-C-L-L hybrid at 26 layers)",
        ),
        "LambdaNetworks Table 13 (C-C-L-L) at 26 layers",
        {},
        "",
        small=True,
    ),
}


def _create(variant: str, *, num_classes: int = 1000, in_chans: int = 3, **kwargs) -> ResNet:
    """Build ``model_cfgs[variant]`` with the keyword arguments of :class:`ResNetArgs`."""
    return build_resnet(model_cfgs[variant].cfg, ResNetArgs(**kwargs), num_classes=num_classes, in_chans=in_chans)


def _info(name: str) -> ModelInfo:
    """The metadata of the ``model_cfgs`` entry ``name``."""
    entry = model_cfgs[name]
    return ModelInfo(name, entry.cfg.input_size, entry.paper, dict(entry.recipe), entry.small, entry.recipe_source)


def _doc(name: str) -> str:
    return f"{name}: {model_cfgs[name].cfg.paper}\n\nKeyword arguments: see lambdanet.models.ResNetArgs."


_register = family_registrar(_info, RESNET_ARGS, doc=_doc)  # the keyword arguments of ResNetArgs


@_register
def resnet26(**kwargs) -> ResNet:
    return _create("resnet26", **kwargs)


@_register
def resnet50(**kwargs) -> ResNet:
    return _create("resnet50", **kwargs)


@_register
def resnet101(**kwargs) -> ResNet:
    return _create("resnet101", **kwargs)


@_register
def resnet152(**kwargs) -> ResNet:
    return _create("resnet152", **kwargs)


@_register
def resnet_rs50(**kwargs) -> ResNet:
    return _create("resnet_rs50", **kwargs)


@_register
def resnet_rs50_se(**kwargs) -> ResNet:
    return _create("resnet_rs50_se", **kwargs)


@_register
def resnet_rs101(**kwargs) -> ResNet:
    return _create("resnet_rs101", **kwargs)


@_register
def resnet_rs101_se(**kwargs) -> ResNet:
    return _create("resnet_rs101_se", **kwargs)


@_register
def resnet_rs152(**kwargs) -> ResNet:
    return _create("resnet_rs152", **kwargs)


@_register
def resnet_rs152_se(**kwargs) -> ResNet:
    return _create("resnet_rs152_se", **kwargs)


@_register
def resnet_rs200(**kwargs) -> ResNet:
    return _create("resnet_rs200", **kwargs)


@_register
def resnet_rs200_se(**kwargs) -> ResNet:
    return _create("resnet_rs200_se", **kwargs)


@_register
def resnet_rs270(**kwargs) -> ResNet:
    return _create("resnet_rs270", **kwargs)


@_register
def resnet_rs270_se(**kwargs) -> ResNet:
    return _create("resnet_rs270_se", **kwargs)


@_register
def resnet_rs350(**kwargs) -> ResNet:
    return _create("resnet_rs350", **kwargs)


@_register
def resnet_rs350_se(**kwargs) -> ResNet:
    return _create("resnet_rs350_se", **kwargs)


@_register
def resnet_rs420(**kwargs) -> ResNet:
    return _create("resnet_rs420", **kwargs)


@_register
def resnet_rs420_se(**kwargs) -> ResNet:
    return _create("resnet_rs420_se", **kwargs)


@_register
def lambda_resnet50(**kwargs) -> ResNet:
    return _create("lambda_resnet50", **kwargs)


@_register
def lambda_resnet101(**kwargs) -> ResNet:
    return _create("lambda_resnet101", **kwargs)


@_register
def lambda_resnet152(**kwargs) -> ResNet:
    return _create("lambda_resnet152", **kwargs)


@_register
def lambda_resnet200(**kwargs) -> ResNet:
    return _create("lambda_resnet200", **kwargs)


@_register
def lambda_resnet270(**kwargs) -> ResNet:
    return _create("lambda_resnet270", **kwargs)


@_register
def lambda_resnet350(**kwargs) -> ResNet:
    return _create("lambda_resnet350", **kwargs)


@_register
def lambda_resnet420(**kwargs) -> ResNet:
    return _create("lambda_resnet420", **kwargs)


@_register
def lambda_resnet101_c4(**kwargs) -> ResNet:
    return _create("lambda_resnet101_c4", **kwargs)


@_register
def lambda_resnet152_c4(**kwargs) -> ResNet:
    return _create("lambda_resnet152_c4", **kwargs)


@_register
def lambda_resnet200_c4(**kwargs) -> ResNet:
    return _create("lambda_resnet200_c4", **kwargs)


@_register
def lambda_resnet270_c4(**kwargs) -> ResNet:
    return _create("lambda_resnet270_c4", **kwargs)


@_register
def lambda_resnet26(**kwargs) -> ResNet:
    return _create("lambda_resnet26", **kwargs)
