"""The two terms of the causal lambda apart, for the layer options the fused op (:mod:`..causal_lambda`) does not
cover: the content term with another key normalisation than the prefix softmax (``key_norm="l2"`` or ``"none"``,
the paper's Table 12 for sequences) and the position term alone (``content=False``, Table 10's position-only
lambdas). Same layouts and calling convention as :func:`lambdanet.ops.causal_lambda`:

* :func:`content_lambda` ``(q [b, n, h, k], k [b, n, k, u], v [b, n, v, u], *, key_norm, chunk_size,
  initial_state, output_final_state)``: ``o_n = q_n^T sum_u sum_{m<=n} Kn[m] V[m]^T`` with the keys normalised
  over the prefix per channel ``(k, u)``; state ``S [b, u, k, v]`` (the running ``sum K V^T``) and
  ``ss [b, u, k]`` (the running ``sum K^2``);
* :func:`position_lambda` ``(q, v, emb [r, k, u], *, chunk_size, initial_state, output_final_state)``:
  ``o_n = q_n^T sum_u sum_{j<r, j<=n} emb[j] V[n-j]^T``; state ``window [b, u, r - 1, v]`` (the last ``r - 1``
  values, the layout of :func:`lambdanet.ops.causal_lambda`'s state).

Both states have a size independent of the context's length (the constant-size state of the pure lambda
models). :mod:`.naive` holds the definitions (position by position; the tests' references), :mod:`.chunk` the
chunked PyTorch forms every device runs (no kernels: these are ablation options, not the default layer).
"""

from lambdanet.ops.lambda_terms.chunk import (
    KEY_NORMS,
    content_lambda,
    init_content_state,
    init_position_state,
    position_lambda,
)
from lambdanet.ops.lambda_terms.naive import naive_content_lambda, naive_position_lambda

__all__ = [
    "KEY_NORMS",
    "content_lambda",
    "position_lambda",
    "init_content_state",
    "init_position_state",
    "naive_content_lambda",
    "naive_position_lambda",
]
