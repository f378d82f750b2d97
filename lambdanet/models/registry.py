"""Model registry in the style of timm: ``@register_model``, ``create_model``, ``list_models``.

Every registered entry point takes ``num_classes``, ``in_chans`` and architecture keyword arguments and
returns an ``nn.Module``. Each entry carries :class:`ModelInfo` metadata: the default input size, the
paper table it comes from and the training recipe of the paper for it (Tables 19-20).
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["register_model", "create_model", "list_models", "model_info", "ModelInfo"]


@dataclass(frozen=True)
class ModelInfo:
    """Metadata of a registered model."""

    name: str
    input_size: int = 224
    paper: str = ""
    recipe: dict = field(default_factory=dict)  # e.g. {"randaugment_magnitude": 10, "dropout": 0.2, ...}
    small: bool = False  # fast enough for CPU tests at small sizes


_MODELS: dict[str, Callable[..., nn.Module]] = {}
_INFO: dict[str, ModelInfo] = {}


def register_model(fn: Callable[..., nn.Module] | None = None, *, info: ModelInfo | None = None):
    """Register a model entry point under its function name (usable bare or with ``info=``)."""

    def deco(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = f.__name__
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = f
        _INFO[name] = info if info is not None else ModelInfo(name)
        return f

    return deco(fn) if fn is not None else deco


def list_models(pattern: str | None = None) -> list[str]:
    """Registered model names, sorted; ``pattern`` is a shell-style wildcard (``"lambda_resnet*"``)."""
    names = sorted(_MODELS)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def model_info(name: str) -> ModelInfo:
    """Metadata of ``name`` (``ValueError`` listing the registered names if unknown)."""
    _check_name(name)
    return _INFO[name]


def _check_name(name: str) -> None:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(list_models())}")


def create_model(name: str, *, num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: one of :func:`list_models`.
        num_classes: classifier outputs (0 for no classifier: ``forward`` returns pooled features).
        in_chans: input image channels.
        **kwargs: architecture options of that model (see its docstring); unknown ones raise a
            ``ValueError`` listing the accepted ones.
    """
    _check_name(name)
    fn = _MODELS[name]
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"model {name!r} does not take {unknown}; it accepts: "
                             f"{', '.join(p for p in params if p not in ('num_classes', 'in_chans'))}")
    if not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
    if not isinstance(in_chans, int) or in_chans <= 0:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    model = fn(num_classes=num_classes, in_chans=in_chans, **kwargs)
    model.model_name = name
    return model
