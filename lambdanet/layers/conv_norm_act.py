"""Convolution -> BatchNorm -> activation: the one set of primitives every model family builds from.

:func:`conv_norm_act` returns the modules as a list (for flat ``nn.Sequential`` stems and blocks, whose
state-dict keys are their indices), :class:`ConvNormAct` the same as one module with named children
``conv``, ``bn``, ``act`` (timm's names, which its checkpoints use).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "get_act", "make_divisible", "conv_norm_act", "ConvNormAct", "BatchNormAct"]

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "silu": nn.SiLU, "relu6": nn.ReLU6}
Act = str | type[nn.Module] | None


def get_act(act: Act, arg: str = "act") -> type[nn.Module] | None:
    """The activation class of ``act``: a name of :data:`ACTIVATIONS`, a module class, or ``None``."""
    if act is None or isinstance(act, type):
        return act
    if act not in ACTIVATIONS:
        raise ValueError(f"{arg} must be one of {list(ACTIVATIONS)}, got {act!r}")
    return ACTIVATIONS[act]


def make_divisible(v: float, divisor: int = 8, round_limit: float = 0.9) -> int:
    """``v`` rounded to the nearest multiple of ``divisor`` (at least ``divisor``), rounded up when rounding
    would lose more than ``1 - round_limit`` of it (the channel rounding of timm's and MobileNet's zoos)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < round_limit * v else new_v


def conv_norm_act(
    dim: int, dim_out: int, kernel_size: int = 1, *, stride: int = 1, groups: int = 1, act: Act = "relu"
) -> list[nn.Module]:
    """``[conv, BatchNorm, activation]``: a ``kernel_size`` convolution without bias, padded to keep the size
    at stride 1; without ``act`` the first two."""
    conv = nn.Conv2d(dim, dim_out, kernel_size, stride, kernel_size // 2, groups=groups, bias=False)
    act_cls = get_act(act)
    return [conv, nn.BatchNorm2d(dim_out)] + ([act_cls(inplace=True)] if act_cls is not None else [])


class ConvNormAct(nn.Sequential):
    """:func:`conv_norm_act` as one module: ``conv``, ``bn``, ``act`` (``nn.Identity`` without ``act``)."""

    def __init__(
        self, dim: int, dim_out: int, kernel_size: int = 1, *, stride: int = 1, groups: int = 1, act: Act = "relu"
    ):
        conv, bn, *act_module = conv_norm_act(dim, dim_out, kernel_size, stride=stride, groups=groups, act=act)
        super().__init__(OrderedDict(conv=conv, bn=bn, act=act_module[0] if act_module else nn.Identity()))


class BatchNormAct(nn.BatchNorm2d):
    """BatchNorm followed by an activation, one module (its parameters are the BatchNorm's)."""

    def __init__(self, channels: int, act: Act = "relu"):
        super().__init__(channels)
        self.act = cast(type[nn.Module], get_act(act))(inplace=True)  # needs an act: None raises TypeError

    def forward(self, x: Tensor) -> Tensor:
        return self.act(super().forward(x))
