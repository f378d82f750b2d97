"""Architectures and their registry: ``create_model(name, num_classes=..., **kwargs)``, ``list_models()``,
``model_info(name)``, ``model_args(name)``."""

from lambdanet.models import byoa, halonet, lm_zoo, mobilenet, zoo_resnet  # noqa: F401  (register the families)
from lambdanet.models.factory import create_model
from lambdanet.models.registry import (
    ModelInfo,
    PretrainedCfg,
    list_models,
    model_args,
    model_info,
    register_model,
    unregister_model,
)
from lambdanet.models.resnet import Bottleneck, ResNet, ResNetArgs, ResNetConfig

__all__ = [
    "create_model",
    "list_models",
    "model_info",
    "model_args",
    "register_model",
    "unregister_model",
    "ModelInfo",
    "PretrainedCfg",
    "ResNet",
    "ResNetConfig",
    "ResNetArgs",
    "Bottleneck",
]
