"""Peer implementations at matched configurations, for side-by-side benchmarks (``pip install lambdanet[bench]``).

* timm: ``LambdaLayer`` (local ``r`` through Conv3d, or global relative), ``HaloAttn``, ``BottleneckAttn``.
* lucidrains ``lambda-networks``: ``LambdaLayer`` (local ``r`` through Conv3d, or global relative over
  ``n x n`` inputs).

Each factory returns ``None`` when the package is missing or the configuration is outside what the peer
supports (e.g. lucidrains has no stride), so callers can skip it.
"""

from __future__ import annotations

import importlib.util
import warnings

from torch import nn

__all__ = ["available_peers", "peer_lambda_layers", "peer_attention_layers"]


def available_peers() -> dict[str, bool]:
    return {"timm": importlib.util.find_spec("timm") is not None,
            "lambda_networks": importlib.util.find_spec("lambda_networks") is not None}


def peer_lambda_layers(dim: int, side: int, r: int | None, *, dim_k: int = 16, heads: int = 4) -> dict[str, nn.Module]:
    """Peer lambda layers with ``dim -> dim`` channels on ``side x side`` inputs, matched to
    ``LambdaLayer(dim, dim_k=dim_k, heads=heads, r=r, feat_size=side)``."""
    peers: dict[str, nn.Module] = {}
    have = available_peers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if have["timm"]:
            from timm.layers.lambda_layer import LambdaLayer as TimmLambda

            peers["timm.LambdaLayer"] = TimmLambda(dim, dim, feat_size=None if r else (side, side), r=r,
                                                   num_heads=heads, dim_head=dim_k)
        if have["lambda_networks"]:
            from lambda_networks import LambdaLayer as LucidLambda

            peers["lucidrains.LambdaLayer"] = LucidLambda(dim=dim, dim_out=dim, dim_k=dim_k, heads=heads, r=r,
                                                         n=None if r else side)
    return peers


def peer_attention_layers(dim: int, side: int, *, heads: int = 4, block_size: int = 8,
                          halo_size: int = 3) -> dict[str, nn.Module]:
    """timm's HaloAttn and BottleneckAttn (global relative attention) at matched sizes."""
    peers: dict[str, nn.Module] = {}
    if not available_peers()["timm"]:
        return peers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from timm.layers.bottleneck_attn import BottleneckAttn
        from timm.layers.halo_attn import HaloAttn

        if side % block_size == 0:
            peers["timm.HaloAttn"] = HaloAttn(dim, dim, feat_size=(side, side), num_heads=heads,
                                              block_size=block_size, halo_size=halo_size)
        peers["timm.BottleneckAttn"] = BottleneckAttn(dim, dim, feat_size=(side, side), num_heads=heads)
    return peers
