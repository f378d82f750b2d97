"""The position kernels' ``torch.library`` op moved to :mod:`lambdanet.ops.position_lambda.fused`: this path works for
one release, with a DeprecationWarning."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.ops.position_lambda.fused")
