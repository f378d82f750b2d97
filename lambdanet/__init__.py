"""lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch.

Lambda layers, LambdaResNets and the convolution and attention baselines they are measured against.
"""

from lambdanet import functional
from lambdanet.layers import (
    AbsolutePositionEmbedding,
    LambdaLayer,
    RelativePositionEmbedding,
    create_spatial_layer,
    list_spatial_layers,
)
from lambdanet.models import create_model, list_models, model_args, model_info, register_model

__version__ = "0.1.0"

__all__ = [
    "functional",
    "LambdaLayer",
    "RelativePositionEmbedding",
    "AbsolutePositionEmbedding",
    "create_spatial_layer",
    "list_spatial_layers",
    "create_model",
    "list_models",
    "model_info",
    "model_args",
    "register_model",
    "__version__",
]
