"""Which position implementation a lambda layer's forward call runs: the :class:`LambdaPlan` (the implementation and
the step that computes it) and the static cost model that picks it under the device's
:class:`~lambdanet.ops.position_lambda.policy.ImplPolicy` (:func:`static_impl`, :func:`whole_embeddings_fit`).
The measured ``impl="auto"`` on top of it is :mod:`~lambdanet.ops.position_lambda.tuning`; the layer's side, which
reads its position embedding and runs the steps, is :class:`lambdanet.layers.lambda_plan.LambdaPositionMixin`."""

from __future__ import annotations

from dataclasses import dataclass

from lambdanet.ops.position_lambda.policy import DEFAULT_IMPL_POLICY, ImplPolicy

__all__ = [
    "LambdaPlan",
    "QUERIES_FIRST_STEPS",
    "LAMBDAS_FIRST_STEPS",
    "CAUSAL_OP",
    "static_impl",
    "whole_embeddings_fit",
]

# position steps of a plan: queries-first steps give y^p [b n h v], lambdas-first steps give lambda^p [b n g v k]
QUERIES_FIRST_STEPS = ("einsum_qe_absolute", "einsum_qe_whole", "einsum_qe_chunked", "triton")
LAMBDAS_FIRST_STEPS = ("depthwise_conv_tokens", "conv", "einsum", "einsum_absolute")
CAUSAL_OP = "causal_op"  # the whole masked lambda (content and position) in lambdanet.ops.causal_lambda


@dataclass(frozen=True)
class LambdaPlan:
    """How one forward call computes its position part, decided once per call by :meth:`LambdaLayer.plan`.

    Attributes:
        impl: the implementation, as :meth:`LambdaLayer.choose_impl` reports it (``"einsum_qe"``,
            ``"einsum"``, ``"conv"``, ``"depthwise_conv"``; ``"none"`` without position lambdas; ``"causal_op"``
            where the whole masked lambda is :func:`lambdanet.ops.causal_lambda`'s, :data:`CAUSAL_OP`).
        position: the step that runs it, or ``None`` (``position=False``). Queries-first steps
            (:data:`QUERIES_FIRST_STEPS`) return the position output ``y^p``: ``"einsum_qe_absolute"``,
            ``"einsum_qe_whole"`` (the whole ``E``, cached in eval), ``"einsum_qe_chunked"`` (rows of ``E``
            rebuilt per query chunk), ``"triton"`` (the fused kernels of :mod:`lambdanet.ops.position_lambda.fused`).
            Lambdas-first steps (:data:`LAMBDAS_FIRST_STEPS`) return the position lambdas ``lambda^p``:
            ``"depthwise_conv_tokens"`` (depthwise lambda convolution on the value tokens), ``"conv"``,
            ``"einsum"``, ``"einsum_absolute"``.

    A new implementation is one more step: its name here, the condition that picks it in :meth:`LambdaLayer.plan`
    and a branch of ``LambdaLayer._position_output`` (returning ``y^p``, as ``"triton"``) or ``_position_lambdas``
    (returning ``lambda^p``).
    """

    impl: str
    position: str | None
    qe_chunk_fraction: float = DEFAULT_IMPL_POLICY.qe_chunk_fraction

    @property
    def queries_first(self) -> bool:
        return self.position in QUERIES_FIRST_STEPS


def whole_embeddings_fit(n: int, pair_elements: int, policy: ImplPolicy) -> bool:
    """Whether the gathered ``E[n, m]`` of ``n`` positions, ``pair_elements`` (``k u g``) per ``(n, m)`` pair, may be
    materialised (``policy.max_whole_positions`` positions and ``policy.max_whole_elements`` elements at most)."""
    elements = n * n * pair_elements
    return n <= policy.max_whole_positions and elements <= policy.max_whole_elements


def static_impl(
    policy: ImplPolicy, *, n: int, taps: int, heads: int, dim_k: int, dim_v: int, whole: bool, qe_ok: bool
) -> str:
    """The static cost model's pick for a relative table (``impl="auto"`` where nothing is measured; see
    :meth:`LambdaLayer.choose_impl`): ``"einsum_qe"``, ``"einsum"``, ``"conv"`` or ``"depthwise_conv"``.

    Args:
        policy: the device's :class:`~lambdanet.ops.position_lambda.policy.ImplPolicy`.
        n: positions of the input.
        taps: kernel taps of the table cropped to the input.
        heads, dim_k, dim_v: the layer's ``h``, ``k``, ``v``.
        whole: whether the whole ``E[n, m]`` may be materialised (:func:`whole_embeddings_fit`).
        qe_ok: whether the queries-first contraction applies (multi-query, ``u = 1``, not causal).
    """
    fewest, most = policy.dense_conv_taps
    dense = fewest <= taps <= most  # the dense lambda convolution beats the depthwise one at this scope
    conv_speedup = policy.dense_conv_speedup if dense else 1.0
    qe_speedup = (policy.gemm_speedup if whole else 1.0) / conv_speedup  # einsum_qe's per multiply-add edge
    if qe_ok and n * heads * (dim_k + dim_v) <= qe_speedup * taps * dim_k * dim_v:
        return "einsum_qe"
    if whole and n <= policy.einsum_positions_per_tap * taps:
        return "einsum"
    return "conv" if dense else "depthwise_conv"
