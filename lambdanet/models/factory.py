"""``create_model``: a registered model built, described (``pretrained_cfg``) and given its weights.

Separate from the registry (which imports no family and no weights code) as timm keeps ``_factory.py``
beside ``_registry.py``: factory -> {registry, pretrained}, families -> registry, no cycle.
"""

from __future__ import annotations

import os

from torch import nn

from lambdanet.models import pretrained as weights
from lambdanet.models.registry import entry_point, model_info, pretrained_cfg

__all__ = ["create_model"]


def create_model(name: str, *, num_classes: int | None = None, in_chans: int | None = None, pretrained: bool = False,
                 checkpoint_path: str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: one of :func:`lambdanet.models.list_models`.
        num_classes: classifier outputs (default 1000; 0 for no classifier: ``forward`` returns pooled features).
            Language models (``model_info(name).task == "lm"``) take ``vocab_size`` instead.
        in_chans: input image channels (default 3).
        pretrained: load the published ImageNet checkpoint (the timm-architecture models of
            :mod:`lambdanet.models.byoa`): downloaded from the Hugging Face hub once, converted and cached
            (:mod:`lambdanet.models.pretrained`). With another ``num_classes`` the classifier is new.
        checkpoint_path: load a local weights file instead: timm's state dict of this model (``.pth``,
            ``.bin``, ``.safetensors``) or lambdanet's own weights (a run's ``model.safetensors``, or the run
            directory: :func:`lambdanet.files.run_file`), detected from its keys. A checkpoint with
            another number of input channels has its input convolution adapted to ``in_chans``.
        **kwargs: architecture options (:func:`lambdanet.models.model_args`); unknown ones raise a ``ValueError``.

    The model carries ``pretrained_cfg``: what its inputs should look like (``image_size``, ``mean``, ``std``,
    ``crop_pct``, ``interpolation``) and its ``classes`` (``None``: ImageNet's for 1000 classes).
    """
    build = entry_point(name, kwargs)
    if model_info(name).task == "lm":
        if num_classes is not None or in_chans is not None or pretrained or checkpoint_path is not None:
            raise ValueError(f"{name} is a language model: it takes vocab_size=..., not num_classes, in_chans or "
                             "weights (load a trained one with lambdanet.lm.load_lm)")
        model = build(**kwargs)
        model.model_name = name
        model.pretrained_cfg = {"model": name, "vocab_size": model.vocab_size}
        return model
    num_classes, in_chans = 1000 if num_classes is None else num_classes, 3 if in_chans is None else in_chans
    if not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
    if not isinstance(in_chans, int) or in_chans <= 0:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    if pretrained and checkpoint_path is not None:
        raise ValueError("pass pretrained=True (the published checkpoint) or checkpoint_path=FILE, not both")
    if pretrained:
        weights.hub_id(name)  # fail before building when there are no weights
    model = build(num_classes=num_classes, in_chans=in_chans, **kwargs)
    model.model_name = name
    model.pretrained_cfg = pretrained_cfg(name, num_classes, in_chans)
    if pretrained or checkpoint_path is not None:
        weights.load_into(model, name, pretrained=pretrained, checkpoint_path=checkpoint_path)
    return model
