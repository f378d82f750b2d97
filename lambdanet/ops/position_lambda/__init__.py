"""The lambda layer's position lambdas (paper Sec. 3.3-3.4, App. B.1), in fla's shape: one folder for the definition,
the implementations, the kernels and the dispatch that picks one.

* :mod:`.naive`: the definition (Fig. 5, from the paper-reading :mod:`lambdanet.functional.reference`) and the
  fused op's plain reference: the tests' references.
* :mod:`.fast`: the PyTorch implementations (re-exported by :mod:`lambdanet.functional`): the lambda convolution
  (``"conv"``, ``"depthwise_conv"``), the gathered ``E[n, m]`` (``"einsum"``), the queries-first ``"einsum_qe"``
  (whole or row-chunked ``E``), and :func:`apply_lambdas`.
* :mod:`.fused` (the ``torch.library`` op) + :mod:`.triton_position` (its Triton kernels): ``impl="triton"``.
* :mod:`.dispatch`: :class:`LambdaPlan` (an implementation and the step that runs it) and the static cost model;
  :mod:`.policy`: its constants per device type (:class:`ImplPolicy`); :mod:`.tuning`: the measured
  ``impl="auto"`` on top of it, with its winners file (:mod:`.cache`) and when it may time (:mod:`.guard`).

The layer's side of the dispatch, which reads its position embedding and runs the steps, stays in
:mod:`lambdanet.layers.lambda_plan`.
"""

from lambdanet.ops.position_lambda.dispatch import (
    CAUSAL_OP,
    LAMBDAS_FIRST_STEPS,
    QUERIES_FIRST_STEPS,
    LambdaPlan,
    static_impl,
    whole_embeddings_fit,
)
from lambdanet.ops.position_lambda.fast import (
    POSITION_IMPLS,
    POSITION_OUTPUT_IMPLS,
    apply_lambdas,
    crop_relative_kernel,
    cropped_kernel_size,
    einsum_position_lambdas,
    gather_relative_embeddings,
    permute_copy,
    position_lambdas,
    position_output_qe,
    relative_position_output_qe,
    token_position_lambdas,
)
from lambdanet.ops.position_lambda.fused import (
    kernels_available,
    lambda_position_output,
    lambda_position_output_reference,
)
from lambdanet.ops.position_lambda.policy import (
    CUDA_IMPL_POLICY,
    DEFAULT_IMPL_POLICY,
    ImplPolicy,
    impl_policy,
    set_impl_policy,
)
from lambdanet.ops.position_lambda.tuning import (
    TUNING_MODES,
    auto_choice,
    clear_impl_cache,
    impl_cache_file,
    impl_tuning_mode,
    isolated_tuning,
    set_impl_cache_file,
    set_impl_timer,
    set_impl_tuning,
    tuned_impls,
    tuned_plan,
)

__all__ = [
    # the implementations (fast.py)
    "POSITION_IMPLS",
    "POSITION_OUTPUT_IMPLS",
    "position_lambdas",
    "einsum_position_lambdas",
    "token_position_lambdas",
    "position_output_qe",
    "relative_position_output_qe",
    "gather_relative_embeddings",
    "crop_relative_kernel",
    "cropped_kernel_size",
    "apply_lambdas",
    "permute_copy",
    # the Triton op (fused.py)
    "lambda_position_output",
    "lambda_position_output_reference",
    "kernels_available",
    # the dispatch (dispatch.py, policy.py, tuning.py)
    "LambdaPlan",
    "QUERIES_FIRST_STEPS",
    "LAMBDAS_FIRST_STEPS",
    "CAUSAL_OP",
    "static_impl",
    "whole_embeddings_fit",
    "ImplPolicy",
    "DEFAULT_IMPL_POLICY",
    "CUDA_IMPL_POLICY",
    "impl_policy",
    "set_impl_policy",
    "TUNING_MODES",
    "set_impl_tuning",
    "impl_tuning_mode",
    "set_impl_cache_file",
    "impl_cache_file",
    "clear_impl_cache",
    "tuned_impls",
    "set_impl_timer",
    "isolated_tuning",
    "tuned_plan",
    "auto_choice",
]
