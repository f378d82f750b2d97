"""Model registry in the style of timm: ``@register_model``, ``create_model``, ``list_models``, ``model_args``.

Every registered entry point takes ``num_classes``, ``in_chans`` and architecture keyword arguments and
returns an ``nn.Module``. Each entry carries :class:`ModelInfo` metadata (the default input size, the paper
table it comes from and the paper's training recipe for it) and the architecture keyword arguments it
accepts, declared once per model family (``register_model(args=...)``): :func:`create_model` validates
against that declaration and :func:`model_args` lists it.
"""

from __future__ import annotations

import fnmatch
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

__all__ = ["unregister_model", "register_model", "create_model", "default_pretrained_cfg", "list_models", "model_info", "model_args", "ModelInfo"]


@dataclass(frozen=True)
class ModelInfo:
    """Metadata of a registered model.

    Attributes:
        name: the registered name.
        input_size: default (square) input size.
        paper: the paper tables the model reproduces.
        recipe: the paper's training recipe for this model, as ``lambdanet.train.TrainConfig`` fields
            (``{"img_size": 160, "randaugment_magnitude": 10, "drop_rate": 0.2, ...}``).
        small: fast enough to build and train at its full width in CPU tests.
        recipe_source: where in the papers ``recipe`` comes from.
    """

    name: str
    input_size: int = 224
    paper: str = ""
    recipe: dict = field(default_factory=dict)
    small: bool = False
    recipe_source: str = ""


# name -> entry point; name -> metadata; name -> accepted architecture keywords and their defaults
_MODELS: dict[str, Callable[..., nn.Module]] = {}
_INFO: dict[str, ModelInfo] = {}
_ARGS: dict[str, dict[str, object]] = {}
_BUILD_ARGS = ("num_classes", "in_chans")  # taken by every entry point, not architecture arguments


def register_model(fn: Callable[..., nn.Module] | None = None, *, info: ModelInfo | None = None,
                   args: Mapping[str, object] | None = None):
    """Register a model entry point under its function name (usable bare or with keywords).

    Args:
        fn: the entry point, called as ``fn(num_classes=..., in_chans=..., **kwargs)``.
        info: its metadata (default: ``ModelInfo(name)``).
        args: the architecture keyword arguments it accepts, with their defaults (the family's
            declaration; ``num_classes`` and ``in_chans`` excluded). Given, it also becomes the entry point's
            ``inspect.signature``. Omitted, the keyword parameters of ``fn`` are the declaration (none if
            ``fn`` takes ``**kwargs``: its keywords are then not validated).
    """

    def deco(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = f.__name__
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        if args is None:
            declared = _keyword_parameters(f)
        else:
            bad = sorted(set(args) & set(_BUILD_ARGS))
            if bad:
                raise ValueError(f"args of model {name!r} must not contain {bad}: every model takes them")
            declared = dict(args)
            f.__signature__ = _signature(declared)
        if declared is not None:
            _ARGS[name] = declared
        _MODELS[name] = f
        _INFO[name] = info if info is not None else ModelInfo(name)
        return f

    return deco(fn) if fn is not None else deco


def _signature(args: Mapping[str, object]) -> inspect.Signature:
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("num_classes", kw, default=1000), inspect.Parameter("in_chans", kw, default=3)]
    return inspect.Signature(params + [inspect.Parameter(k, kw, default=v) for k, v in args.items()])


def _keyword_parameters(fn: Callable) -> dict[str, object] | None:
    """The keyword parameters of a plain entry point and their defaults (``None`` if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name: None if p.default is inspect.Parameter.empty else p.default
            for p in params if p.name not in _BUILD_ARGS}


def unregister_model(name: str) -> None:
    """Remove a registered model (for plug-ins and tests that register temporary models)."""
    _check_name(name)
    del _MODELS[name], _INFO[name]
    _ARGS.pop(name, None)


def list_models(pattern: str | None = None) -> list[str]:
    """Registered model names, sorted; ``pattern`` is a shell-style wildcard (``"lambda_resnet*"``)."""
    names = sorted(_MODELS)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def model_info(name: str) -> ModelInfo:
    """Metadata of ``name`` (``ValueError`` listing the registered names if unknown)."""
    _check_name(name)
    return _INFO[name]


def model_args(name: str) -> dict[str, object]:
    """The architecture keyword arguments ``create_model(name, ...)`` accepts, with their defaults
    (``num_classes`` and ``in_chans``, which every model takes, excluded), e.g. for ``lambda_resnet26``
    ``{"stage_layers": None, ..., "img_size": None, "drop_rate": 0.0, "drop_path_rate": 0.0, ...}``."""
    _check_name(name)
    return dict(_ARGS.get(name, {}))


def _check_name(name: str) -> None:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(list_models())}")


def create_model(name: str, *, num_classes: int = 1000, in_chans: int = 3, pretrained: bool = False,
                 checkpoint_path: str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: one of :func:`list_models`.
        num_classes: classifier outputs (0 for no classifier: ``forward`` returns pooled features).
        in_chans: input image channels.
        pretrained: load the published ImageNet checkpoint (the timm-architecture models of
            :mod:`lambdanet.models.byoa`): downloaded from the Hugging Face hub once, converted and cached
            (:mod:`lambdanet.models.pretrained`). With another ``num_classes`` the classifier is new.
        checkpoint_path: load a local weights file instead: timm's state dict of this model (``.pth``,
            ``.bin``, ``.safetensors``) or lambdanet's own weights (a run's ``model.safetensors``, or the run
            directory: :func:`lambdanet.models.pretrained.run_file`), detected from its keys. A checkpoint with
            another number of input channels has its input convolution adapted to ``in_chans``.
        **kwargs: architecture options of that model (:func:`model_args`); unknown ones raise a
            ``ValueError`` listing the accepted ones.

    The model carries ``pretrained_cfg``: what its inputs should look like (``image_size``, ``mean``, ``std``,
    ``crop_pct``, ``interpolation``) and its ``classes`` (``None``: ImageNet's for 1000 classes).
    """
    _check_name(name)
    accepted = _ARGS.get(name)  # None: not declared (``**kwargs`` without ``args``), not validated
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ValueError(f"model {name!r} does not take {unknown}; it accepts: {', '.join(accepted)}")
    if not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
    if not isinstance(in_chans, int) or in_chans <= 0:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    if pretrained and checkpoint_path is not None:
        raise ValueError("pass pretrained=True (the published checkpoint) or checkpoint_path=FILE, not both")
    if pretrained:
        from lambdanet.models.pretrained import hub_id

        hub_id(name)  # fail before building when there are no weights
    model = _MODELS[name](num_classes=num_classes, in_chans=in_chans, **kwargs)
    model.model_name = name
    if not isinstance(getattr(model, "pretrained_cfg", None), dict):
        model.pretrained_cfg = default_pretrained_cfg(name, num_classes, in_chans)
    if pretrained or checkpoint_path is not None:
        _load_into(model, name, pretrained, checkpoint_path)
    return model


def default_pretrained_cfg(name: str, num_classes: int, in_chans: int) -> dict:
    """The preprocessing of a model without a checkpoint of its own: its default input size, ImageNet's mean
    and standard deviation, a 0.875 centre crop (torchvision's ImageNet evaluation)."""
    return {"model": name, "num_classes": num_classes, "in_chans": in_chans, "classes": None, "data": None,
            "image_size": _INFO[name].input_size, "crop_pct": 0.875, "interpolation": "bilinear",
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def _load_into(model: nn.Module, name: str, pretrained: bool, checkpoint_path) -> None:
    from lambdanet.models import pretrained as weights

    if checkpoint_path is not None:
        checkpoint_path = weights.run_file(checkpoint_path)  # a run directory: its weights file
    notes = weights.load_pretrained(model, name) if pretrained else weights.load_weights(model, checkpoint_path, name)
    if checkpoint_path is not None:  # lambdanet's run weights describe their data: classes and preprocessing
        meta = weights.run_metadata(checkpoint_path) or {}
        model.pretrained_cfg.update({k: meta[k] for k in ("classes", "data", "image_size", "mean", "std") if k in meta})
        if any("classifier" in n for n in notes):
            model.pretrained_cfg["classes"] = None
    model.pretrained_cfg["weights"] = "pretrained" if pretrained else str(checkpoint_path)
    model.pretrained_cfg["load_notes"] = notes
