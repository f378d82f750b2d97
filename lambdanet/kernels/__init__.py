"""Fused kernels (Triton) for the lambda layer, registered as ``torch.library`` custom ops.

``lambda_position_output(q, values, table, center, spatial)`` is the op ``LambdaLayer(impl="triton")`` runs
(:mod:`lambdanet.kernels.ops`); the kernels themselves are in :mod:`lambdanet.kernels.lambda_position`.
Triton is imported only when an op runs: on a CUDA device, or on CPU tensors under ``TRITON_INTERPRET=1``
(Triton's interpreter; set it before the first run in the process).
"""

from lambdanet.kernels.ops import kernels_available, lambda_position_output, lambda_position_output_reference

__all__ = ["lambda_position_output", "lambda_position_output_reference", "kernels_available"]
