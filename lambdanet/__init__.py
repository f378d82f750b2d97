"""lambdanet: LambdaNetworks (Bello, ICLR 2021) in PyTorch.

Lambda layers, LambdaResNets and the convolution and attention baselines they are measured against.
"""

from lambdanet import functional
from lambdanet.layers import AbsolutePositionEmbedding, LambdaLayer, RelativePositionEmbedding

__version__ = "0.1.0"

__all__ = [
    "functional",
    "LambdaLayer",
    "RelativePositionEmbedding",
    "AbsolutePositionEmbedding",
    "__version__",
]
