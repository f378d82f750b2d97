"""Peer implementations at matched configurations, for side-by-side benchmarks (``pip install -e ".[bench]"``).

* timm: ``LambdaLayer`` (local ``r`` through Conv3d, or global relative), ``HaloAttn``, ``BottleneckAttn``.
* lucidrains ``lambda-networks``: ``LambdaLayer`` (local ``r`` through Conv3d, or global relative over
  ``n x n`` inputs).

Each factory leaves out a peer whose package cannot be imported or whose configuration is outside what
the peer supports (e.g. lucidrains has no stride), so callers can skip it; :func:`missing_peers_warning`
tells the user which packages are missing and how to install them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable, Mapping

from torch import nn

__all__ = [
    "PEER_PACKAGES",
    "INSTALL_HINT",
    "available_peers",
    "missing_peers_warning",
    "peer_lambda_layers",
    "peer_attention_layers",
]

# import name -> the name pip installs it under (both in the ``bench`` extra)
PEER_PACKAGES = {"timm": "timm", "lambda_networks": "lambda-networks"}
INSTALL_HINT = 'pip install -e ".[bench]"'


def available_peers(modules: Iterable[str] = tuple(PEER_PACKAGES)) -> dict[str, bool]:
    """Whether each peer package (import name) imports; a broken install counts as missing."""
    have = {}
    for module in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(module)
            have[module] = True
        except Exception:  # noqa: BLE001 - not importable for any reason (a broken install) counts as missing
            have[module] = False
    return have


def missing_peers_warning(needed: Mapping[str, Iterable[str]]) -> str | None:
    """One line naming the peer packages of ``needed`` (``{import name: parts that compare against it}``)
    that cannot be imported, the parts that run without them and how to install them; ``None`` if none."""
    have = available_peers(needed)
    missing = {PEER_PACKAGES[m]: list(parts) for m, parts in needed.items() if not have[m]}
    if not missing:
        return None
    parts = list(dict.fromkeys(p for ps in missing.values() for p in ps))
    return (
        f"peers not installed: {', '.join(missing)} ({', '.join(parts)} run without their rows); install "
        f"them with {INSTALL_HINT} or pip install {' '.join(missing)}"
    )


def peer_lambda_layers(dim: int, side: int, r: int | None, *, dim_k: int = 16, heads: int = 4) -> dict[str, nn.Module]:
    """Peer lambda layers with ``dim -> dim`` channels on ``side x side`` inputs, matched to
    ``LambdaLayer(dim, dim_k=dim_k, heads=heads, r=r, feat_size=side)``."""
    peers: dict[str, nn.Module] = {}
    have = available_peers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if have["timm"]:
            from timm.layers.lambda_layer import LambdaLayer as TimmLambda

            # timm annotates r as int, but None is its relative-position mode (unused ignore: timm not installed)
            peers["timm.LambdaLayer"] = TimmLambda(
                dim,
                dim,
                feat_size=None if r else (side, side),
                num_heads=heads,
                dim_head=dim_k,
                r=r,  # type: ignore[arg-type, unused-ignore]
            )
        if have["lambda_networks"]:
            from lambda_networks import LambdaLayer as LucidLambda

            peers["lucidrains.LambdaLayer"] = LucidLambda(
                dim=dim, dim_out=dim, dim_k=dim_k, heads=heads, r=r, n=None if r else side
            )
    return peers


def peer_attention_layers(
    dim: int, side: int, *, heads: int = 4, block_size: int = 8, halo_size: int = 3
) -> dict[str, nn.Module]:
    """timm's HaloAttn and BottleneckAttn (global relative attention) at matched sizes."""
    peers: dict[str, nn.Module] = {}
    if not available_peers(["timm"])["timm"]:
        return peers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from timm.layers.bottleneck_attn import BottleneckAttn
        from timm.layers.halo_attn import HaloAttn

        if side % block_size == 0:
            peers["timm.HaloAttn"] = HaloAttn(
                dim, dim, feat_size=(side, side), num_heads=heads, block_size=block_size, halo_size=halo_size
            )
        peers["timm.BottleneckAttn"] = BottleneckAttn(dim, dim, feat_size=(side, side), num_heads=heads)
    return peers
