"""Operations with one calling convention, one folder per operation (fla's ``fla/ops/<op>/`` shape): ``naive``
(the definition) beside the PyTorch and Triton forms, and a dispatch that picks one.

* :mod:`.causal_lambda`: the causal (masked) lambdas of sequences, ``mode`` ``naive`` / ``chunk`` (PyTorch) /
  ``fused_chunk`` (Triton, training) / ``fused_recurrent`` (generation);
* :mod:`.lambda_terms`: the causal content and position terms apart (the layer options the fused op does not
  cover: other key normalisations, position-only lambdas);
* :mod:`.position_lambda`: the position lambdas of images (``LambdaLayer``): the PyTorch implementations, the
  Triton kernel, and ``impl="auto"``'s policy, cost model and measured choice.
"""

from lambdanet.ops.causal_lambda import MODES, causal_lambda, resolve_mode

__all__ = ["causal_lambda", "resolve_mode", "MODES"]
