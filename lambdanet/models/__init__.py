"""Architectures and their registry: ``create_model(name, num_classes=..., **kwargs)``, ``list_models()``."""

from lambdanet.models import halonet, mobilenet, zoo_resnet  # noqa: F401  (register the families)
from lambdanet.models.registry import ModelInfo, create_model, list_models, model_info, register_model
from lambdanet.models.resnet import Bottleneck, ResNet, ResNetConfig

__all__ = ["create_model", "list_models", "model_info", "register_model", "ModelInfo", "ResNet", "ResNetConfig",
           "Bottleneck"]
