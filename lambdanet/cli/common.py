"""Checks several commands make the same way (one-line ``ValueError``s, which ``lambdanet.cli.main`` prints
with exit status 2)."""

from __future__ import annotations

from lambdanet.runtime import check_device

__all__ = ["check_device"]
