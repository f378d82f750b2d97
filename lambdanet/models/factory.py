"""``create_model``: a registered model built, described (``pretrained_cfg``) and given its weights.

Separate from the registry (which imports no family and no weights code) as timm keeps ``_factory.py``
beside ``_registry.py``: factory -> {registry, pretrained}, families -> registry, no cycle. An image model is
built here (:class:`ImageAdapter`); a family with other build arguments (the language models) registers its own
:class:`~lambdanet.models.registry.ModelAdapter` with its models, which the factory calls without knowing it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from lambdanet.models import pretrained as weights
from lambdanet.models.hub import download_hub_weights, hub_repo
from lambdanet.models.registry import ModelAdapter, entry_point, model_info, pretrained_cfg

if TYPE_CHECKING:
    from lambdanet.models.registry import CreatedModel

__all__ = ["create_model", "ImageAdapter"]


def create_model(
    name: str,
    *,
    num_classes: int | None = None,
    in_chans: int | None = None,
    pretrained: bool = False,
    checkpoint_path: str | os.PathLike | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: one of :func:`lambdanet.models.list_models`, or ``"hf-hub:owner/name"``: a model shared with
            :func:`lambdanet.hub.push_to_hub` (its architecture, arguments, weights, classes and preprocessing;
            downloaded once into huggingface_hub's cache, then read offline).
        num_classes: classifier outputs (default 1000; 0 for no classifier: ``forward`` returns pooled features).
            Language models (``list_models(task="lm")``) take ``vocab_size`` instead.
        in_chans: input image channels (default 3).
        pretrained: load the published ImageNet checkpoint (the timm-architecture models of
            :mod:`lambdanet.models.byoa`): downloaded from the Hugging Face hub once, converted and cached
            (:mod:`lambdanet.models.pretrained`). With another ``num_classes`` the classifier is new.
        checkpoint_path: load a local weights file instead: timm's state dict of this model (``.pth``,
            ``.bin``, ``.safetensors``) or lambdanet's own weights (a run's ``model.safetensors``, or the run
            directory: :func:`lambdanet.files.run_file`), detected from its keys. A checkpoint with
            another number of input channels has its input convolution adapted to ``in_chans``.
        **kwargs: architecture options (:func:`lambdanet.models.model_args`); unknown ones raise a ``ValueError``.

    The model carries ``pretrained_cfg`` in timm's keys (:func:`lambdanet.models.registry.image_cfg`): what its
    inputs should look like (``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``), ``first_conv``,
    ``classifier``, and its ``classes`` (``None``: ImageNet's for 1000 classes); a language model's is
    ``{"architecture", "vocab_size"}``.
    """
    repo = hub_repo(name)
    if repo is not None:
        return _from_hub(
            repo,
            num_classes=num_classes,
            in_chans=in_chans,
            pretrained=pretrained,
            checkpoint_path=checkpoint_path,
            **kwargs,
        )
    build = entry_point(name, kwargs)
    return adapter(name).create(
        name,
        build,
        kwargs,
        num_classes=num_classes,
        in_chans=in_chans,
        pretrained=pretrained,
        checkpoint_path=checkpoint_path,
    )


class ImageAdapter(ModelAdapter):
    """The image models' building (every model registered without an adapter): ``num_classes``, ``in_chans``,
    published or local weights, timm's ``pretrained_cfg``."""

    build_args = {"num_classes": 1000, "in_chans": 3}

    def create(self, name, build, kwargs, *, num_classes, in_chans, pretrained, checkpoint_path) -> nn.Module:
        num_classes, in_chans = 1000 if num_classes is None else num_classes, 3 if in_chans is None else in_chans
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0:
            raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
        if not isinstance(in_chans, int) or isinstance(in_chans, bool) or in_chans <= 0:
            raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
        if pretrained and checkpoint_path is not None:
            raise ValueError("pass pretrained=True (the published checkpoint) or checkpoint_path=FILE, not both")
        if pretrained:
            weights.hub_id(name)  # fail before building when there are no weights
        model = cast("CreatedModel", build(num_classes=num_classes, in_chans=in_chans, **kwargs))
        model.model_name, model.model_kwargs = name, dict(kwargs)
        first_conv = next((n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
        modules = dict(model.named_modules())
        last_linear = next((n for n, m in reversed(modules.items()) if isinstance(m, nn.Linear)), None)
        model.pretrained_cfg = pretrained_cfg(name, num_classes, in_chans) | {
            "first_conv": first_conv,
            "classifier": "fc" if "fc" in modules else last_linear,  # a registered model's own layout: its last Linear
        }
        model.default_cfg = model.pretrained_cfg  # timm's older name for the same dict
        if pretrained or checkpoint_path is not None:
            weights.load_into(model, name, pretrained=pretrained, checkpoint_path=checkpoint_path)
        if kwargs.get("img_size") is not None:  # what it was built for, not its family's size (nor a loaded run's)
            size = getattr(model, "img_size", None) or kwargs["img_size"]  # the families' (H, W), checked
            model.pretrained_cfg["input_size"] = (in_chans, *((size, size) if isinstance(size, int) else size))
        return model

    def from_hub(self, repo, name, path, meta, kwargs, *, num_classes, in_chans) -> nn.Module:
        """Another ``num_classes`` / ``in_chans`` adapts the weights as ``checkpoint_path`` does."""
        model = cast(
            "CreatedModel",
            create_model(
                name,
                num_classes=meta["num_classes"] if num_classes is None else num_classes,
                in_chans=meta["in_chans"] if in_chans is None else in_chans,
                checkpoint_path=path,
                **kwargs,
            ),
        )
        model.pretrained_cfg.update(weights=f"hf-hub:{repo}", hf_hub_id=repo.partition("@")[0])
        return model


IMAGE = ImageAdapter()


def adapter(name: str) -> ModelAdapter:
    """How :func:`create_model` builds the registered model ``name``: its family's
    :class:`~lambdanet.models.registry.ModelAdapter`, else :class:`ImageAdapter`."""
    return model_info(name).adapter or IMAGE


def _from_hub(repo: str, *, num_classes, in_chans, pretrained, checkpoint_path, **kwargs) -> nn.Module:
    """``create_model("hf-hub:...")``: the repository's architecture and arguments (``kwargs`` override them)
    with its weights, built by the architecture's adapter."""
    if pretrained or checkpoint_path is not None:
        raise ValueError(f"hf-hub:{repo} brings its own weights: pass neither pretrained nor checkpoint_path")
    path, meta = download_hub_weights(repo)
    arch, saved = adapter(meta["model"]).saved(meta["model"], meta.get("model_kwargs", {}))  # as written then
    arch_kwargs = {**saved, **kwargs}
    model = cast(
        "CreatedModel",
        adapter(arch).from_hub(repo, arch, path, meta, arch_kwargs, num_classes=num_classes, in_chans=in_chans),
    )
    model.model_kwargs = arch_kwargs
    return model
