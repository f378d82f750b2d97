"""Sequence operations with one calling convention, one folder per operation (fla's ``fla/ops/<op>/`` shape):
``naive`` (the definition), ``chunk`` (PyTorch), ``fused_chunk`` (Triton, training), ``fused_recurrent``
(generation), and a ``mode`` argument that picks one."""

from lambdanet.ops.causal_lambda import MODES, causal_lambda, resolve_mode

__all__ = ["causal_lambda", "resolve_mode", "MODES"]
