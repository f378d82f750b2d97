"""The position lambdas as defined (Fig. 5: ``lambda^p_n = sum_m E[n, m] V[m]^T`` over explicit embeddings, or the
lambda convolution over a relative kernel), from the paper-reading API :mod:`lambdanet.functional.reference`, and
the fused op's plain PyTorch reference (``E[n, m]`` materialised): the references of the tests."""

from lambdanet.functional.reference import compute_position_lambdas as naive_position_lambdas
from lambdanet.ops.position_lambda.fused import lambda_position_output_reference as naive_position_output

__all__ = ["naive_position_lambdas", "naive_position_output"]
