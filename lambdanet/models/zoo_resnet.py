"""ResNet-v1, ResNet-RS and LambdaResNet families, declared as data.

Sources: block counts of ResNet-v1 from He et al. 2016; ResNet-RS and LambdaResNet block counts and
lambda placement from LambdaNetworks Table 18; image sizes and regularisation from Tables 19-20.

**LambdaResNet lambda layers.** App. E.1 says all lambda layers use ``k=16, h=4, u=1`` with a 23x23
scope, and that ``u > 1`` switches to the convolution with a 7x7 scope. The parameter counts of
Tables 14-15 settle which: only c5 lambdas with ``u=4`` (7x7) and c4 lambdas with ``u=1`` (23x23)
reproduce LambdaResNet-101 (36.9M: ours 36.9M) together with -101-C4 (26.0M: ours 26.0M); the same
rule gives -152 51.4M (ours 50.9M) and -152-C4 35.1M (ours 34.5M). With ``u=1`` everywhere -101 would be
36.2M and -152-C4 33.9M; with ``u=4`` everywhere -101-C4 would be 27.3M. LambdaResNet-200-C4 (Table 15:
42M) is 39.1M under that rule but 41.1M with ``u=4`` (7x7) in c4 too, so that model uses ``u=4`` in c4.
LambdaResNet-270-C4 uses a 7x7 scope in c4 (Table 16). No squeeze-and-excitation in LambdaResNets:
App. E.1 rules it out for lambda blocks, and Table 14's counts leave no room for it in conv blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lambdanet.models.registry import ModelInfo, register_model
from lambdanet.models.resnet import ResNet, ResNetConfig, stage_pattern

__all__ = ["RESNET_LAYERS", "RESNET_RS_LAYERS", "LAMBDA_C4_BLOCKS", "RECIPES", "lambda_resnet_pattern",
           "build_resnet"]

# He et al. 2016 (and a compact 26-layer variant for small data)
RESNET_LAYERS = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}

# LambdaNetworks Table 18 (block allocations of Bello et al. 2021)
RESNET_RS_LAYERS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3),
                    270: (4, 29, 53, 4), 350: (4, 36, 72, 4), 420: (4, 44, 87, 4)}

# LambdaNetworks Table 18: lambda layers in c4 (1-indexed blocks); every c5 block is a lambda layer
LAMBDA_C4_BLOCKS = {50: (3,), 101: (6, 12, 18), 152: (5, 10, 15, 20, 25, 30), 200: (5, 10, 15, 20, 25, 30),
                    270: (8, 16, 24, 32, 40, 48), 350: (10, 20, 30, 40, 50, 60),
                    420: (10, 20, 30, 40, 50, 60, 70, 80)}

# Tables 19-20: (image size, RandAugment magnitude, dropout, stochastic depth) per depth, 350 epochs
RECIPES = {50: [(128, 10, 0.2, 0.0), (160, 10, 0.2, 0.0)],
           101: [(160, 10, 0.3, 0.0), (192, 15, 0.2, 0.0)],
           152: [(192, 15, 0.3, 0.0), (224, 15, 0.3, 0.1), (256, 15, 0.3, 0.1), (288, 15, 0.3, 0.1)],
           270: [(256, 15, 0.3, 0.1)],
           350: [(256, 15, 0.3, 0.2), (288, 15, 0.3, 0.2), (320, 15, 0.3, 0.2)],
           420: [(320, 15, 0.3, 0.2)]}
# default image sizes: Table 14 (101: 224, 152: 256), Table 15 (200: 320), Table 16 (270: 256), else Table 19
DEFAULT_SIZE = {26: 224, 50: 160, 101: 224, 152: 256, 200: 320, 270: 256, 350: 320, 420: 320}

C4_LAMBDA = {"dim_k": 16, "heads": 4, "dim_u": 1, "r": 23}
C5_LAMBDA = {"dim_k": 16, "heads": 4, "dim_u": 4, "r": 7}


def lambda_resnet_pattern(layers: Sequence[int], c4_blocks: Sequence[int] | str) -> tuple[str, str, str, str]:
    """Table 18 placement: conv in c2-c3, lambda at ``c4_blocks`` (1-indexed, or ``"all"``), lambda in c5."""
    c4 = "L" * layers[2] if c4_blocks == "all" else "".join(
        "L" if j + 1 in c4_blocks else "C" for j in range(layers[2]))
    return ("C" * layers[0], "C" * layers[1], c4, "L" * layers[3])


def _recipe(depth: int) -> dict:
    rows = RECIPES.get(depth) or RECIPES[min(RECIPES, key=lambda d: abs(d - depth))]
    size, magnitude, dropout, sd = max(rows, key=lambda r: r[0] if r[0] <= DEFAULT_SIZE.get(depth, 10**6) else -1)
    source = "Tables 19-20" if depth in RECIPES else "Tables 19-20, nearest depth (not listed for this depth)"
    return {"epochs": 350, "image_size": size, "randaugment_layers": 2, "randaugment_magnitude": magnitude,
            "dropout": dropout, "drop_path_rate": sd, "weight_decay": 4e-5, "source": source}


def build_resnet(cfg: ResNetConfig, *, num_classes: int, in_chans: int, stage_layers: str | None = None,
                 spatial_layer: str | None = None, layer_kwargs: Mapping | None = None, se: bool | float = False,
                 stem: str | None = None, base_width: int | None = None, nonlocal_blocks: Mapping | None = None,
                 img_size=None, drop_rate: float = 0.0, drop_path_rate: float = 0.0, features_only: bool = False,
                 zero_init_last: bool = True, share_embeddings: bool = False) -> ResNet:
    """Apply the user-facing keyword arguments to ``cfg`` and build the module."""
    changes: dict = {}
    if stage_layers is not None:
        changes["pattern"] = stage_pattern(cfg.layers, stage_layers)
        changes["stage_kwargs"] = ({}, {}, {}, {})
    if spatial_layer is not None:
        changes["spatial_layer"] = spatial_layer
        if stage_layers is None and cfg.pattern is None:
            raise ValueError("spatial_layer selects the layer of the non-C stages: also pass stage_layers, "
                             "e.g. stage_layers='LLLL'")
        changes["stage_kwargs"] = ({}, {}, {}, {})
    if se:
        changes["se_ratio"] = 1 / 16 if se is True else float(se)
    if stem is not None:
        changes["stem"] = stem
    if base_width is not None:
        if not isinstance(base_width, int) or base_width <= 0:
            raise ValueError(f"base_width must be a positive int, got {base_width!r}")
        changes["widths"] = tuple(base_width * 2 ** i for i in range(4))
    if nonlocal_blocks is not None:
        changes["nonlocal_blocks"] = dict(nonlocal_blocks)
    cfg = ResNetConfig(**{**cfg.__dict__, **changes})
    return ResNet(cfg, num_classes=num_classes, in_chans=in_chans, img_size=img_size, drop_rate=drop_rate,
                  drop_path_rate=drop_path_rate, layer_kwargs=layer_kwargs, features_only=features_only,
                  zero_init_last=zero_init_last, share_embeddings=share_embeddings)


def _register(name: str, cfg: ResNetConfig, info: ModelInfo) -> None:
    def entry(*, num_classes: int = 1000, in_chans: int = 3, stage_layers: str | None = None,
              spatial_layer: str | None = None, layer_kwargs: Mapping | None = None, se: bool | float = False,
              stem: str | None = None, base_width: int | None = None, nonlocal_blocks: Mapping | None = None,
              img_size=None, drop_rate: float = 0.0, drop_path_rate: float = 0.0, features_only: bool = False,
              zero_init_last: bool = True, share_embeddings: bool = False) -> ResNet:
        return build_resnet(cfg, num_classes=num_classes, in_chans=in_chans, stage_layers=stage_layers,
                            spatial_layer=spatial_layer, layer_kwargs=layer_kwargs, se=se, stem=stem,
                            base_width=base_width, nonlocal_blocks=nonlocal_blocks, img_size=img_size,
                            drop_rate=drop_rate, drop_path_rate=drop_path_rate, features_only=features_only,
                            zero_init_last=zero_init_last, share_embeddings=share_embeddings)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = (f"{name}: {cfg.paper}\n\nKeyword arguments: stage_layers ('CCLL': C = 3x3 conv, L = "
                     "spatial_layer, per stage c2..c5), spatial_layer (any create_spatial_layer name; default "
                     "lambda_conv), layer_kwargs (forwarded to the L layers), se (True: SE ratio 1/16, or a "
                     "ratio), stem ('resnet' | 'rs' | 'cifar'), base_width, nonlocal_blocks, img_size, drop_rate, "
                     "drop_path_rate, features_only, zero_init_last, share_embeddings.")
    entry.config = cfg
    register_model(entry, info=info)


for _depth, _layers in RESNET_LAYERS.items():
    _register(f"resnet{_depth}", ResNetConfig(
        _layers, input_size=224,
        paper=f"ResNet-{_depth} v1 (He et al. 2016; stride on the 3x3 conv); LambdaNetworks Tables 3, 9, 13"),
        ModelInfo(f"resnet{_depth}", 224, "He et al. 2016; LambdaNetworks Table 3",
                  {"epochs": 90, "source": "App. E.2 90-epoch setup"}, small=_depth == 26))

for _depth, _layers in RESNET_RS_LAYERS.items():
    for _se in (False, True):
        _name = f"resnet_rs{_depth}" + ("_se" if _se else "")
        _register(_name, ResNetConfig(
            _layers, stem="rs", shortcut="avg", se_ratio=0.25 if _se else 0.0, input_size=DEFAULT_SIZE[_depth],
            paper=f"ResNet-RS-{_depth} {'w/' if _se else 'wo/'} SE (Bello et al. 2021): ResNet-D stem and "
                  "shortcut, max pool replaced by a strided 3x3 conv, SE ratio 0.25; LambdaNetworks Table 14"),
            ModelInfo(_name, DEFAULT_SIZE[_depth], "LambdaNetworks Table 14, Table 18 blocks", _recipe(_depth)))

for _depth, _layers in RESNET_RS_LAYERS.items():
    _register(f"lambda_resnet{_depth}", ResNetConfig(
        _layers, stem="rs", shortcut="avg", pattern=lambda_resnet_pattern(_layers, LAMBDA_C4_BLOCKS[_depth]),
        stage_kwargs=({}, {}, C4_LAMBDA, C5_LAMBDA), input_size=DEFAULT_SIZE[_depth],
        paper=f"LambdaResNet-{_depth}: Table 18 ({'-'.join(map(str, _layers))}, lambda in c4 blocks "
              f"{LAMBDA_C4_BLOCKS[_depth]} and all of c5)"),
        ModelInfo(f"lambda_resnet{_depth}", DEFAULT_SIZE[_depth], "LambdaNetworks Tables 14, 18-20",
                  _recipe(_depth)))

for _depth, _c4 in ((101, C4_LAMBDA), (152, C4_LAMBDA), (200, C5_LAMBDA), (270, {**C4_LAMBDA, "r": 7})):
    _layers = RESNET_RS_LAYERS[_depth]
    _register(f"lambda_resnet{_depth}_c4", ResNetConfig(
        _layers, stem="rs", shortcut="avg", pattern=lambda_resnet_pattern(_layers, "all"),
        stage_kwargs=({}, {}, _c4, C5_LAMBDA), input_size=DEFAULT_SIZE[_depth],
        paper=f"LambdaResNet-{_depth}-C4: every c4 and c5 block a lambda layer (Tables 14-16)"),
        ModelInfo(f"lambda_resnet{_depth}_c4", DEFAULT_SIZE[_depth], "LambdaNetworks Tables 14-16",
                  _recipe(_depth)))

# compact hybrid for small data, CPU runs and tests: ResNet-26 blocks, lambda layers in c4 and c5
_register("lambda_resnet26", ResNetConfig(
    RESNET_LAYERS[26], pattern=stage_pattern(RESNET_LAYERS[26], "CCLL"), stage_kwargs=({}, {}, C4_LAMBDA, C4_LAMBDA),
    input_size=224, paper="compact LambdaResNet-26: [2-2-2-2] blocks, lambda layers in c4 and c5 "
                          "(the Table 13 C-C-L-L hybrid at 26 layers)"),
    ModelInfo("lambda_resnet26", 224, "LambdaNetworks Table 13 (C-C-L-L) at 26 layers", small=True))
