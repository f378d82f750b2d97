"""Registry of drop-in spatial layers: everything that can replace the 3x3 convolution of a bottleneck.

Every layer is built as ``create_spatial_layer(name, dim, dim_out=None, *, stride=1, feat_size=None, **kwargs)``
and maps ``[B, dim, H, W]`` to ``[B, dim_out, ceil(H / stride), ceil(W / stride)]``. ``feat_size`` (the input
size) is handled in one place, the spec's ``feat_size_use``: ``"required"`` by the global layers,
``"optional"`` for the lambda convolution (a global or absolute-embedding variant needs it), ``"unused"``
by the local layers, whose constructors do not take it (the registry does not pass it on).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lambdanet.helpers import check_choice
from lambdanet.layers.axial_attention import AxialAttention
from lambdanet.layers.conv import ConvLayer, ConvSE
from lambdanet.layers.lambda_layer import LambdaLayer
from lambdanet.layers.linear_attention import ConvPlusAttention, DoubleAttention, EfficientAttention
from lambdanet.layers.local_attention import HaloAttention, LocalSelfAttention
from lambdanet.layers.relative_attention import AttentionAugmentedConv, RelativeSelfAttention

__all__ = [
    "create_spatial_layer",
    "list_spatial_layers",
    "spatial_layer_info",
    "SpatialLayerSpec",
    "register_spatial_layer",
    "FEAT_SIZE_USES",
]

_FRAME = ("self", "dim", "dim_out", "stride", "feat_size")
FEAT_SIZE_USES = ("required", "optional", "unused")


@dataclass(frozen=True)
class SpatialLayerSpec:
    """How a registered name is built: ``cls`` with ``fixed`` keyword arguments; ``kwargs_from`` is the class
    whose constructor takes the user's extra keyword arguments (default ``cls``); ``feat_size_use`` (one of
    :data:`FEAT_SIZE_USES`) says whether ``cls`` needs, may take, or does not take ``feat_size``."""

    cls: type[nn.Module]
    fixed: dict[str, Any] = field(default_factory=dict)
    kwargs_from: type[nn.Module] | None = None
    feat_size_use: str = "unused"
    paper: str = ""

    def __post_init__(self):
        check_choice(self.feat_size_use, "feat_size_use", FEAT_SIZE_USES)

    @property
    def needs_feat_size(self) -> bool:
        """Global layers: building one without ``feat_size`` is an error."""
        return self.feat_size_use == "required"

    @property
    def takes_feat_size(self) -> bool:
        """Whether ``feat_size`` is passed to the constructor (local layers are built without it)."""
        return self.feat_size_use != "unused"

    def accepted_kwargs(self) -> list[str]:
        params = inspect.signature((self.kwargs_from or self.cls).__init__).parameters
        skip = set(_FRAME) | set(self.fixed) | ({"dim"} if self.kwargs_from else set())
        return [p for p in params if p not in skip and params[p].kind is not inspect.Parameter.VAR_KEYWORD]


_REGISTRY: dict[str, SpatialLayerSpec] = {}


def register_spatial_layer(name: str, spec: SpatialLayerSpec) -> None:
    """Register ``spec`` under ``name`` (names are public API)."""
    if name in _REGISTRY:
        raise ValueError(f"spatial layer {name!r} is already registered")
    _REGISTRY[name] = spec


register_spatial_layer("conv", SpatialLayerSpec(ConvLayer, paper="ResNet 3x3 convolution (LambdaNetworks Table 3)"))
register_spatial_layer("conv_se", SpatialLayerSpec(ConvSE, paper="conv + squeeze-and-excitation (Hu et al. 2018)"))
register_spatial_layer(
    "linear_attention",
    SpatialLayerSpec(
        ConvPlusAttention,
        {"attention": "efficient"},
        EfficientAttention,
        paper="conv + efficient attention (Shen et al. 2018), Table 3",
    ),
)
register_spatial_layer(
    "double_attention",
    SpatialLayerSpec(
        ConvPlusAttention,
        {"attention": "double"},
        DoubleAttention,
        paper="conv + double attention (A^2-Nets, Chen et al. 2018), Table 3",
    ),
)
register_spatial_layer(
    "relative_self_attention",
    SpatialLayerSpec(
        RelativeSelfAttention,
        feat_size_use="required",
        paper="global relative self-attention (Bello et al. 2019 / BoTNet), Table 4",
    ),
)
register_spatial_layer(
    "attention_augmented_conv",
    SpatialLayerSpec(
        AttentionAugmentedConv,
        feat_size_use="required",
        paper="conv + relative self-attention, attention augmentation (Bello et al. 2019), Table 3",
    ),
)
register_spatial_layer(
    "local_self_attention",
    SpatialLayerSpec(
        LocalSelfAttention, paper="SASA local relative self-attention (Ramachandran et al. 2019), Tables 3-4"
    ),
)
register_spatial_layer(
    "axial_self_attention",
    SpatialLayerSpec(
        AxialAttention,
        feat_size_use="required",
        paper="axial self-attention (Ho et al. 2019; Wang et al. 2020), Table 4",
    ),
)
register_spatial_layer(
    "halo_attention",
    SpatialLayerSpec(HaloAttention, paper="HaloNet blocked local self-attention (Vaswani et al. 2021)"),
)
register_spatial_layer(
    "lambda",
    SpatialLayerSpec(
        LambdaLayer,
        {"r": None},
        feat_size_use="required",
        paper="lambda layer, global context with relative embeddings (LambdaNetworks Sec. 3.3)",
    ),
)
register_spatial_layer(
    "lambda_conv",
    SpatialLayerSpec(
        LambdaLayer,
        feat_size_use="optional",
        paper="lambda convolution, local scope r (LambdaNetworks Sec. 3.4; r=23 default)",
    ),
)


def list_spatial_layers() -> list[str]:
    """Names accepted by :func:`create_spatial_layer`."""
    return sorted(_REGISTRY)


def spatial_layer_info(name: str) -> SpatialLayerSpec:
    """The registry entry of ``name`` (``ValueError`` listing the valid names if unknown)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown spatial layer {name!r}; valid names: {', '.join(list_spatial_layers())}")
    return _REGISTRY[name]


def create_spatial_layer(
    name: str,
    dim: int,
    dim_out: int | None = None,
    *,
    stride: int = 1,
    feat_size: int | tuple[int, int] | None = None,
    **kwargs,
) -> nn.Module:
    """Build the spatial layer ``name`` mapping ``[B, dim, H, W]`` to ``[B, dim_out, H / stride, W / stride]``.
    ``feat_size``: the input's spatial size, needed by global layers, not passed to local ones
    (:attr:`SpatialLayerSpec.feat_size_use`). Unknown names or keywords raise a ``ValueError`` with the choices."""
    spec = spatial_layer_info(name)
    accepted = spec.accepted_kwargs()
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"spatial layer {name!r} does not take {unknown}; it accepts: {', '.join(accepted)}")
    if spec.needs_feat_size and feat_size is None:
        raise ValueError(f"spatial layer {name!r} is global and needs feat_size (the input's spatial size)")
    args = dict(spec.fixed, **kwargs)
    if spec.takes_feat_size:
        args["feat_size"] = feat_size
    return spec.cls(dim, dim_out, stride=stride, **args)
