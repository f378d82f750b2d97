"""Reusable layers: the lambda layer and the spatial layers it is compared against.

``create_spatial_layer(name, dim, dim_out, stride=..., feat_size=..., **kwargs)`` builds any of
``list_spatial_layers()`` as a drop-in replacement for a bottleneck's 3x3 convolution.
"""

from lambdanet.layers.axial_attention import AxialAttention
from lambdanet.layers.causal_attention import CausalSelfAttention
from lambdanet.layers.causal_lambda import CausalLambdaLayer
from lambdanet.layers.conv import ConvLayer, ConvSE
from lambdanet.layers.eca import EfficientChannelAttention
from lambdanet.layers.lambda_layer import ImplPolicy, LambdaLayer, LambdaPlan, impl_policy, set_impl_policy
from lambdanet.layers.linear_attention import DoubleAttention, EfficientAttention
from lambdanet.layers.local_attention import BlockedLocalAttention, HaloAttention, LocalSelfAttention
from lambdanet.layers.position_embedding import AbsolutePositionEmbedding, RelativePositionEmbedding
from lambdanet.layers.registry import create_spatial_layer, list_spatial_layers, spatial_layer_info
from lambdanet.layers.relative_attention import AttentionAugmentedConv, RelativeSelfAttention
from lambdanet.layers.relative_position import attend, auto_attention_impl, use_attention_impl
from lambdanet.layers.squeeze_excite import SqueezeExcite
from lambdanet.ops.position_lambda.tuning import (
    clear_impl_cache,
    impl_tuning_mode,
    set_impl_cache_file,
    set_impl_tuning,
)

__all__ = [
    "LambdaLayer",
    "LambdaPlan",
    "ImplPolicy",
    "impl_policy",
    "set_impl_policy",
    "set_impl_tuning",
    "impl_tuning_mode",
    "set_impl_cache_file",
    "clear_impl_cache",
    "RelativePositionEmbedding",
    "AbsolutePositionEmbedding",
    "ConvLayer",
    "ConvSE",
    "SqueezeExcite",
    "EfficientChannelAttention",
    "EfficientAttention",
    "DoubleAttention",
    "RelativeSelfAttention",
    "AttentionAugmentedConv",
    "AxialAttention",
    "BlockedLocalAttention",
    "HaloAttention",
    "LocalSelfAttention",
    "create_spatial_layer",
    "list_spatial_layers",
    "spatial_layer_info",
    "attend",
    "auto_attention_impl",
    "use_attention_impl",
    "CausalLambdaLayer",
    "CausalSelfAttention",
]
