"""Model registry in the style of timm: ``@register_model``, ``create_model``, ``list_models``, ``model_args``.

Every registered entry point takes ``num_classes``, ``in_chans`` and architecture keyword arguments and returns
an ``nn.Module``. Each entry carries :class:`ModelInfo` metadata (default input size, source paper table, the
paper's training recipe) and the architecture keyword arguments it accepts, declared once per model family
(``register_model(args=...)``): :func:`create_model` validates against them and :func:`model_args` lists them.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from lambdanet.constants import DATASET_CLASSES, DEFAULT_CROP_PCT, DEFAULT_INTERPOLATION, IMAGENET_MEAN, IMAGENET_STD
from lambdanet.helpers import check_choice

__all__ = [
    "unregister_model",
    "register_model",
    "entry_point",
    "image_cfg",
    "run_image_cfg",
    "pretrained_cfg",
    "published_models",
    "list_models",
    "model_info",
    "model_args",
    "ModelInfo",
    "ModelAdapter",
    "PretrainedCfg",
]


@dataclass(frozen=True)
class PretrainedCfg:
    """How a model's inputs must look (timm's ``pretrained_cfg``, typed) and where its published weights are.

    Attributes:
        input_size: side of the square input.
        crop_pct: evaluation crop: resize the shorter side to ``input_size / crop_pct``, centre-crop.
        interpolation: ``"bilinear"`` or ``"bicubic"``.
        mean, std: per-channel normalisation (RGB).
        hub_id: Hugging Face hub repository of the published weights (``None``: none published).
        top1: ImageNet-1k top-1 (%) reported for them (``None``: not stated in our sources).
    """

    input_size: int = 224
    crop_pct: float = DEFAULT_CROP_PCT
    interpolation: str = DEFAULT_INTERPOLATION
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    hub_id: str | None = None
    top1: float | None = None


class ModelAdapter:
    """How :func:`lambdanet.models.create_model` builds the models of a family whose entry points take other build
    arguments than an image model's ``num_classes`` and ``in_chans``. The family registers it with its models,
    ``ModelInfo(adapter=...)``, as :mod:`lambdanet.models.lm_zoo` does; a model without one is an image model, built
    by :class:`lambdanet.models.factory.ImageAdapter`. The factory calls an adapter without knowing its family."""

    build_args: Mapping[str, object] = {}
    """The keyword arguments every entry point of the family takes besides its architecture arguments, with their
    defaults (the first parameters of the entry points' ``inspect.signature``)."""

    def create(
        self,
        name: str,
        build: Callable[..., nn.Module],
        kwargs: dict[str, Any],
        *,
        num_classes: int | None,
        in_chans: int | None,
        pretrained: bool,
        checkpoint_path: object,
    ) -> nn.Module:
        """``create_model(name, num_classes=..., in_chans=..., pretrained=..., checkpoint_path=..., **kwargs)``:
        the model ``build`` (the entry point, ``kwargs`` checked against its arguments) makes, with
        ``model_name``, ``model_kwargs`` and ``pretrained_cfg`` set; a ``ValueError`` for what the family does
        not take."""
        raise NotImplementedError

    def saved(self, name: str, kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The registered model and architecture options that a saved ``name`` and ``kwargs`` (a run's, or weights'
        shared on the hub) describe in this version: themselves, unless a default of the family moved since they
        were written (:func:`lambdanet.models.lm_zoo.saved_lm`)."""
        return name, dict(kwargs)

    def from_hub(
        self,
        repo: str,
        name: str,
        path: object,
        meta: dict[str, Any],
        kwargs: dict[str, Any],
        *,
        num_classes: int | None,
        in_chans: int | None,
    ) -> nn.Module:
        """``create_model("hf-hub:REPO", ...)`` of the family's architecture ``name``: the model ``meta`` (the
        downloaded weights' metadata) describes, with the architecture options ``kwargs`` and the weights of
        the downloaded file ``path``."""
        raise NotImplementedError


@dataclass(frozen=True)
class ModelInfo:
    """Metadata of a registered model.

    Attributes:
        name: the registered name.
        input_size: default (square) input size (0: the model takes no images, as the language models).
        paper: the paper tables the model reproduces.
        recipe: the paper's training recipe for this model, as ``lambdanet.tasks.classification.TrainConfig`` fields
            (``{"img_size": 160, "randaugment_magnitude": 10, "drop_rate": 0.2, ...}``).
        small: fast enough to build and train at its full width in CPU tests.
        recipe_source: where in the papers ``recipe`` comes from.
        pretrained: the published weights and their preprocessing (``None``: none; see :attr:`preprocessing`).
        adapter: how :func:`~lambdanet.models.create_model` builds it (:class:`ModelAdapter`; ``None``: an image
            model, ``num_classes`` and ``in_chans``).
        task: ``"image"`` (classifiers and backbones: ``num_classes``, ``in_chans``, images in) or ``"lm"``
            (language models: ``vocab_size``, tokens in; :mod:`lambdanet.models.lm_zoo`).
    """

    name: str
    input_size: int = 224
    paper: str = ""
    recipe: dict = field(default_factory=dict)
    small: bool = False
    recipe_source: str = ""
    pretrained: PretrainedCfg | None = None
    task: str = "image"
    adapter: ModelAdapter | None = field(default=None, compare=False, repr=False)

    @property
    def preprocessing(self) -> PretrainedCfg:
        """The inputs the model expects: its published weights', else ImageNet's normalisation, a 0.875
        bilinear centre crop (torchvision's ImageNet evaluation) at ``input_size``."""
        return self.pretrained or PretrainedCfg(input_size=self.input_size)


if TYPE_CHECKING:

    class CreatedModel(nn.Module):
        """For type checkers only: the attributes :func:`lambdanet.models.create_model` sets on its model."""

        model_name: str
        model_kwargs: dict[str, Any]
        pretrained_cfg: dict[str, Any]
        default_cfg: dict[str, Any]


# name -> entry point; name -> metadata; name -> accepted architecture keywords and their defaults
_MODELS: dict[str, Callable[..., nn.Module]] = {}
_INFO: dict[str, ModelInfo] = {}
_ARGS: dict[str, dict[str, object]] = {}
_BUILD_ARGS = {"num_classes": 1000, "in_chans": 3}  # every image model takes them: not architecture arguments


def register_model(
    fn: Callable[..., nn.Module] | None = None,
    *,
    info: ModelInfo | None = None,
    args: Mapping[str, object] | None = None,
):
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
        if not callable(f) or not isinstance(getattr(f, "__name__", None), str):
            raise ValueError(f"register_model expects a model function (its name is the model's), got {f!r}")
        name = f.__name__
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        declared = _keyword_parameters(f) if args is None else dict(args)
        build_args = _BUILD_ARGS if info is None or info.adapter is None else info.adapter.build_args
        if args is not None:
            bad = sorted(set(args) & set(build_args))
            if bad:
                raise ValueError(f"args of model {name!r} must not contain {bad}: every model takes them")
            # declared is dict(args) here; inspect.signature reads a function's __signature__ (unknown to Callable)
            cast(Any, f).__signature__ = _signature(build_args, cast("dict[str, object]", declared))
        if declared is not None:
            _ARGS[name] = declared
        _MODELS[name], _INFO[name] = f, info if info is not None else ModelInfo(name)
        return f

    return deco(fn) if fn is not None else deco


def _signature(build_args: Mapping[str, object], args: Mapping[str, object]) -> inspect.Signature:
    """Keyword-only parameters: the build arguments of the model's family, then its architecture arguments."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([inspect.Parameter(k, kw, default=v) for k, v in {**build_args, **args}.items()])


def _keyword_parameters(fn: Callable) -> dict[str, object] | None:
    """The keyword parameters of a plain entry point and their defaults (``None`` if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name: None if p.default is inspect.Parameter.empty else p.default for p in params if p.name not in _BUILD_ARGS
    }


def unregister_model(name: str) -> None:
    """Remove a registered model (for plug-ins and tests that register temporary models)."""
    _check_name(name)
    del _MODELS[name], _INFO[name]
    _ARGS.pop(name, None)


def list_models(
    pattern: str | Sequence[str] | None = None, *, task: str | None = None, pretrained: bool = False
) -> list[str]:
    """Registered model names, sorted; ``pattern`` is a shell-style wildcard (``"lambda_resnet*"``) or a list of
    them (a name matching any, as timm's ``filter``), ``task`` keeps one kind (``"image"`` or ``"lm"``,
    :attr:`ModelInfo.task`), ``pretrained`` only the models with published weights (:func:`published_models`)."""
    patterns = [pattern] if isinstance(pattern, str) or pattern is None else pattern
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) or p is None for p in patterns):
        raise ValueError(
            f"pattern must be a shell-style wildcard string or None, got {pattern!r} (or a list of them: any matches)"
        )
    if task is not None:
        check_choice(task, "task", sorted({info.task for info in _INFO.values()}))
    if not isinstance(pretrained, bool):
        raise ValueError(f"pretrained must be True or False, got {pretrained!r}")
    return [
        n
        for n in sorted(_MODELS)
        if any(not p or fnmatch.fnmatch(n, p) for p in patterns or [None])  # none given: every name
        and (task is None or _INFO[n].task == task)
        and (not pretrained or bool((cfg := _INFO[n].pretrained) and cfg.hub_id))
    ]


def model_info(name: str) -> ModelInfo:
    """Metadata of ``name`` (``ValueError`` naming the closest registered names if unknown)."""
    _check_name(name)
    return _INFO[name]


def model_args(name: str) -> dict[str, object]:
    """The architecture keyword arguments ``create_model(name, ...)`` accepts, with their defaults
    (``num_classes`` and ``in_chans``, which every model takes, excluded), e.g. for ``lambda_resnet26``
    ``{"stage_layers": None, ..., "img_size": None, "drop_rate": 0.0, "drop_path_rate": 0.0, ...}``."""
    _check_name(name)
    return dict(_ARGS.get(name, {}))


def _check_name(name: str) -> None:
    """A one-line ``ValueError`` for a name that is not registered: the registered names closest to it (not all
    of them: there are dozens) and where the full list is."""
    if name not in _MODELS:
        names = {n.lower(): n for n in list_models()}
        close = [names[n] for n in difflib.get_close_matches(str(name).lower(), names, n=3, cutoff=0.6)]
        guess = f"did you mean {', '.join(close)}?" if close else "no registered name is close to it;"
        raise ValueError(
            f"unknown model {name!r}; {guess} lambdanet.list_models() or 'lambdanet models' lists all {len(_MODELS)}"
        )


def entry_point(name: str, kwargs: Mapping[str, object] | None = None) -> Callable[..., nn.Module]:
    """The entry point of ``name``, once ``kwargs`` are checked against the architecture arguments it
    declares (a ``ValueError`` listing them for unknown ones; undeclared entry points are not checked)."""
    _check_name(name)
    accepted = _ARGS.get(name)  # None: not declared (``**kwargs`` without ``args``), not validated
    if accepted is not None:
        unknown = sorted(set(kwargs or ()) - set(accepted))
        if unknown:
            raise ValueError(f"model {name!r} does not take {unknown}; it accepts: {', '.join(accepted)}")
    return _MODELS[name]


def image_cfg(
    architecture: str,
    *,
    num_classes: int,
    in_chans: int,
    image_size: int,
    mean,
    std,
    crop_pct: float = 1.0,
    interpolation: str = "bilinear",
    classes=None,
    data: str | None = None,
    hf_hub_id: str | None = None,
) -> dict:
    """An image model's ``pretrained_cfg`` in timm's keys and meanings, so that timm's data helpers
    (``resolve_data_config``, ``create_transform``) read it: ``architecture``, ``num_classes``, ``input_size``
    ``(in_chans, H, W)``, ``crop_pct`` (resize the shorter side to ``H / crop_pct``, centre-crop; 1: resize
    straight), ``crop_mode`` (``"center"``), ``interpolation``, ``mean``, ``std`` and, for published weights,
    ``hf_hub_id``; plus lambdanet's ``classes`` (class names, ``None``: ImageNet's for 1000 classes) and ``data``
    (what the weights were trained on). :func:`lambdanet.models.create_model` adds ``first_conv`` and
    ``classifier`` (module names in the built model), loading adds ``weights`` and ``load_notes``."""
    cfg = {
        "architecture": architecture,
        "num_classes": num_classes,
        "input_size": (in_chans, image_size, image_size),
        "crop_pct": crop_pct,
        "crop_mode": "center",
        "interpolation": interpolation,
        "mean": list(mean),
        "std": list(std),
        "classes": classes,
        "data": data,
    }
    return cfg | ({"hf_hub_id": hf_hub_id} if hf_hub_id else {})


def run_image_cfg(meta: dict) -> dict:
    """:func:`image_cfg` of a ``lambdanet train`` run's weights from their metadata (``model``, ``num_classes``,
    ``in_chans``, ``image_size``, ``mean``, ``std``, ``classes``, ``data``), preprocessed as the run evaluated:
    files (``imagefolder:`` data) with the shorter side resized to ``size / DEFAULT_CROP_PCT`` and centre-cropped,
    the built-in small datasets resized straight (``crop_pct`` 1), bilinear; a ``crop_pct`` and an
    ``interpolation`` in ``meta`` (weights shared from a model's own ``pretrained_cfg``) win. ``mean`` and ``std``
    get ``in_chans`` entries (the model's, where the weights were adapted to another count of channels), as
    :func:`pretrained_cfg`'s."""
    files = str(meta.get("data") or "").startswith("imagefolder:")
    return image_cfg(
        meta["model"],
        num_classes=meta["num_classes"],
        in_chans=meta["in_chans"],
        image_size=meta["image_size"],
        mean=_per_channel(meta["mean"], meta["in_chans"]),  # a grey run loaded into an RGB model: repeated
        std=_per_channel(meta["std"], meta["in_chans"]),
        crop_pct=meta.get("crop_pct") or (DEFAULT_CROP_PCT if files else 1.0),
        interpolation=meta.get("interpolation") or "bilinear",
        # a run written before its dataset's names were kept: the names of its built-in dataset
        classes=meta.get("classes") or _known_classes(meta.get("data"), meta["num_classes"]),
        data=meta.get("data"),
    )


def _known_classes(data, num_classes: int) -> list[str] | None:
    names = DATASET_CLASSES.get(data) if isinstance(data, str) else None
    return list(names) if names is not None and len(names) == num_classes else None


def pretrained_cfg(name: str, num_classes: int = 1000, in_chans: int = 3) -> dict:
    """``model.pretrained_cfg`` (:func:`image_cfg`) of ``create_model(name, num_classes=..., in_chans=...)`` before
    any weights are loaded: the model's :meth:`ModelInfo.preprocessing`, and for a model with published weights
    their ``hf_hub_id`` and ``data``. ``mean`` and ``std`` have ``in_chans`` entries: RGB's averaged for one
    channel (as the input convolution's RGB weights are summed), repeated in turn for more (as they are)."""
    p = model_info(name).preprocessing
    return image_cfg(
        name,
        num_classes=num_classes,
        in_chans=in_chans,
        image_size=p.input_size,
        mean=_per_channel(p.mean, in_chans),
        std=_per_channel(p.std, in_chans),
        crop_pct=p.crop_pct,
        interpolation=p.interpolation,
        data="imagenet" if p.hub_id else None,
        hf_hub_id=p.hub_id,
    )


def _per_channel(values, in_chans: int) -> list[float]:
    """Per-channel statistics of ``len(values)`` channels for ``in_chans``: themselves, their mean for one channel,
    else repeated in turn."""
    values = list(values)
    if in_chans == len(values):
        return values
    if in_chans == 1:
        return [sum(values) / len(values)]
    return [values[i % len(values)] for i in range(in_chans)]


def published_models() -> dict[str, PretrainedCfg]:
    """The registered models with published weights (a ``hub_id``) and their :class:`PretrainedCfg`."""
    return {n: p for n in list_models() if (p := _INFO[n].pretrained) and p.hub_id}
