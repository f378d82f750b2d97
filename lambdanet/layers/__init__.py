"""Reusable layers: the lambda layer and the spatial layers it is compared against."""

from lambdanet.layers.lambda_layer import LambdaLayer
from lambdanet.layers.position_embedding import AbsolutePositionEmbedding, RelativePositionEmbedding

__all__ = ["LambdaLayer", "RelativePositionEmbedding", "AbsolutePositionEmbedding"]
