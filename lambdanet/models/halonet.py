"""HaloNet H0-H7 (Vaswani et al. 2021, Table 2 and Table A2) as configurations of the bottleneck ResNet.

Block of stage ``i`` (base width ``w = 64, 128, 256, 512``): ``1x1 (w) -> halo attention (b, h), w rv ->
1x1, w rb``; 7x7/2 stem with max pool; SiLU; a final ``1x1, df`` conv for H3-H7; heads ``(4, 8, 8, 8)``;
query and key projections ``w -> w``, values ``w -> w rv`` (HaloNet App. A: three linear maps, relative
embeddings factorised over height and width with half a head's channels each, shared by the heads).
Downsampling subsamples the queries inside the attention (HaloNet Fig. 2). No squeeze-and-excitation:
the paper's H0-H7 use label smoothing, SiLU and RandAugment but not SE (Sec. 4.2.1).

Parameter counts (1000 classes) against Table A2: H0 5.49M (5.5), H1 8.08 (8.1), H2 9.38 (9.4),
H4 19.08 (19.1), H5 30.68 (30.7), H6 43.42 (43.4), H7 67.39 (67). H3 is 11.82M against 12.3M (-3.9%): the
row's own layer count (65 layers) fixes ``l3 = 12``, and no single other entry of the row reproduces
12.3M (``rb = 1.75``: 12.87M, ``df = 1536``: 12.72M, ``rv = 1.25``: 12.84M); we keep the table's values.
"""

from __future__ import annotations

from lambdanet.models.registry import ModelInfo, register_model
from lambdanet.models.resnet import ResNet, ResNetConfig

__all__ = ["HALONET_SPECS", "halonet_config"]

# Table A2: name -> (b, h, rv, rb, l3, s, df, params M, RandAugment magnitude (App. C.3))
HALONET_SPECS = {
    "h0": (8, 3, 1.0, 0.5, 7, 256, None, 5.5, 6),
    "h1": (8, 3, 1.0, 1.0, 10, 256, None, 8.1, 8),
    "h2": (8, 3, 1.0, 1.25, 11, 256, None, 9.4, 10),
    "h3": (10, 3, 1.0, 1.5, 12, 320, 1024, 12.3, 14),
    "h4": (12, 2, 1.0, 3.0, 12, 384, 1280, 19.1, 17),
    "h5": (14, 2, 2.5, 2.0, 23, 448, 1536, 30.7, 19),
    "h6": (8, 4, 3.0, 2.75, 24, 512, 1536, 43.4, 24),
    "h7": (10, 3, 4.0, 3.5, 26, 600, 2048, 67.0, 31),
}
HEADS = (4, 8, 8, 8)
WIDTHS = (64, 128, 256, 512)


def halonet_config(variant: str) -> ResNetConfig:
    b, h, rv, rb, l3, s, df, params, _ = HALONET_SPECS[variant]
    stage_kwargs = tuple({"block_size": b, "halo_size": h, "heads": heads, "dim_qk": w}
                         for heads, w in zip(HEADS, WIDTHS))
    return ResNetConfig(
        (3, 3, l3, 3), widths=WIDTHS, expansion=rb, spatial_mult=rv, stem="resnet", shortcut="conv",
        pattern=("L" * 3, "L" * 3, "L" * l3, "L" * 3), spatial_layer="halo_attention", stage_kwargs=stage_kwargs,
        act="silu", final_conv=df, input_size=s,
        paper=f"HaloNet-{variant.upper()}: Table A2 (b={b}, h={h}, rv={rv}, rb={rb}, l3={l3}, s={s}, df={df}), "
              f"{params}M parameters")


def _register(variant: str) -> None:
    cfg = halonet_config(variant)
    magnitude = HALONET_SPECS[variant][8]

    def entry(*, num_classes: int = 1000, in_chans: int = 3, img_size=None, drop_rate: float = 0.0,
              drop_path_rate: float = 0.0, features_only: bool = False, layer_kwargs=None,
              zero_init_last: bool = True) -> ResNet:
        return ResNet(cfg, num_classes=num_classes, in_chans=in_chans, img_size=img_size, drop_rate=drop_rate,
                      drop_path_rate=drop_path_rate, features_only=features_only, layer_kwargs=layer_kwargs,
                      zero_init_last=zero_init_last)

    name = f"halonet_{variant}"
    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = cfg.paper
    entry.config = cfg
    recipe = {"epochs": 350, "optimizer": "nesterov", "lr": 1.6, "batch_size": 4096, "warmup_epochs": 10,
              "weight_decay": 2e-5, "label_smoothing": 0.1, "randaugment_magnitude": magnitude,
              "image_size": cfg.input_size, "source": "HaloNet Sec. 4.1 and App. C.3"}
    register_model(entry, info=ModelInfo(name, cfg.input_size, "HaloNet Table A2", recipe))


for _variant in HALONET_SPECS:
    _register(_variant)
