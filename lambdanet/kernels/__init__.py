"""The fused Triton position kernels moved to :mod:`lambdanet.ops.position_lambda` (the op:
:mod:`~lambdanet.ops.position_lambda.fused`; the kernels: :mod:`~lambdanet.ops.position_lambda.triton_position`):
this path and its modules work for one release, with a DeprecationWarning."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.ops.position_lambda", globals())
