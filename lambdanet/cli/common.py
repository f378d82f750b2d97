"""Checks several commands make the same way (one-line ``ValueError``s, which ``lambdanet.cli.main`` prints
with exit status 2)."""

from __future__ import annotations

__all__ = ["check_device"]


def check_device(device: str, name: str = "--device") -> None:
    """A ``ValueError`` for ``--device cuda`` on a machine without a usable CUDA device (before anything is
    loaded, instead of torch's traceback at the first tensor moved there)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} cuda but no CUDA device is available; use {name} cpu")
