"""Small helpers shared across the package: argument validation and n-d operator lookup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "compute_dtype",
    "to_ntuple",
    "check_positive_int",
    "check_choice",
    "conv_nd",
    "avg_pool_nd",
    "check_input",
]


def to_ntuple(value: int | Sequence[int] | None, n: int, name: str) -> tuple[int, ...] | None:
    """Return ``value`` as an ``n``-tuple of ints (``None`` stays ``None``).

    Raises a ``ValueError`` naming ``name`` when a sequence of the wrong length is given.
    """
    if value is None:
        return None
    if isinstance(value, int):
        return (int(value),) * n
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {value!r}") from None
    if len(out) != n:
        raise ValueError(f"{name} must have {n} entries (one per spatial dim), got {value!r}")
    return out


def check_positive_int(value, name: str, *, odd: bool = False, allow_none: bool = False) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a positive (odd) int."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (odd and value % 2 == 0):
        kind = "a positive odd int" if odd else "a positive int"
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be {kind}{extra}, got {value!r}")


def check_choice(value, name: str, choices: Sequence) -> None:
    """Raise a ``ValueError`` naming ``name`` and listing ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def conv_nd(spatial_dims: int) -> Callable[..., Tensor]:
    """``F.conv1d`` / ``F.conv2d`` / ``F.conv3d`` for 1, 2 or 3 spatial dims."""
    return _CONV[spatial_dims]


def avg_pool_nd(spatial_dims: int) -> Callable[..., Tensor]:
    """``F.avg_pool1d`` / ``2d`` / ``3d`` for 1, 2 or 3 spatial dims."""
    return _AVG_POOL[spatial_dims]


def check_input(x: Tensor, dim: int, spatial_dims: int, layer: str) -> None:
    """Validate a ``[B, C, *spatial]`` input: rank and channel count, with a clear ``ValueError``."""
    if x.dim() != spatial_dims + 2:
        names = {1: "[B, C, L]", 2: "[B, C, H, W]", 3: "[B, C, D, H, W]"}[spatial_dims]
        raise ValueError(
            f"{layer} expects input of rank {spatial_dims + 2} {names} (spatial_dims={spatial_dims}), "
            f"got shape {tuple(x.shape)}"
        )
    if x.shape[1] != dim:
        raise ValueError(f"{layer} was built with dim={dim} input channels, got input with {x.shape[1]} channels")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype softmaxes, attention logits and lambdas are computed in for inputs of ``dtypes``: their
    promotion, at least float32. float16 / bfloat16 -> float32 (never half precision, also under autocast),
    float32 -> float32, float64 -> float64 (so float64 layers can be ``gradcheck``-ed and cross-checked)."""
    dtype = torch.float32
    for d in dtypes:
        dtype = torch.promote_types(dtype, d)
    return dtype
