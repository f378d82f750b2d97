"""The chunked causal lambda in PyTorch ops (:func:`lambdanet.functional.causal.causal_lambda`): the CPU's form, and
the reference the kernels are measured against on a GPU."""

from lambdanet.functional.causal import causal_lambda as chunk_causal_lambda

__all__ = ["chunk_causal_lambda"]
